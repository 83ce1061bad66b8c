"""The logits hook's cut: speculated positions' rows leave the batch before sampling, their argmax stays."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from dd_sglang.attention import backend
from dd_sglang.prefetch.speculators import SpecState


def test_cut_keeps_batch_rows_and_records_argmax():
    logits = torch.randn(5, 11)
    hidden = torch.randn(5, 7)
    out = SimpleNamespace(next_token_logits=logits, hidden_states=hidden)
    a, b = SpecState(), SpecState()
    backend._pending_spec = backend._SpecLayout(3, [a, b])
    backend.cut_speculated_logits(out)
    assert torch.equal(out.next_token_logits, logits[:3])
    assert torch.equal(out.hidden_states, hidden[:3])
    assert (a.argmax, b.argmax) == (int(logits[3].argmax()), int(logits[4].argmax()))
    assert backend._pending_spec is None  # consumed once


def test_cut_is_a_no_op_without_speculated_positions():
    logits = torch.randn(3, 11)
    out = SimpleNamespace(next_token_logits=logits, hidden_states=None)
    backend.cut_speculated_logits(out)
    assert out.next_token_logits is logits
    # A layout whose row count does not match (another logits call) leaves the output alone.
    backend._pending_spec = backend._SpecLayout(3, [SpecState()])
    backend.cut_speculated_logits(out)
    assert out.next_token_logits is logits
