"""One decode forward's backend-side state, and its end (the logits hook).

:class:`DecodeStep` rides on the batch as ``forward_batch.dd_step`` from the
``dualdecoder`` backend's ``init_forward_metadata`` until :func:`finish_step`,
which SGLang's ``LogitsProcessor.forward`` hook (``patches/layers_logits_processor.py``)
calls with the step's logits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from dd_sglang.attention.coupling import coupled_guesses
from dd_sglang.prefetch.events import PrefetchEvents
from dd_sglang.prefetch.plan import StepPlan


class BackendEvents(PrefetchEvents):
    """What the backend reports (the plugin turns it into Prometheus metrics); no-ops here."""

    def sparse_rows(self, n: int) -> None:
        """``n`` (request, layer) rows were decoded sparsely."""

    def exact_rows(self, n: int) -> None:
        """``n`` of them had their whole context as critical set and were attended with dense's own call."""

    def extend_rows_skipped(self, n: int) -> None:
        """An extend layer skipped ``n`` query rows of cached prefixes (:mod:`dd_sglang.attention.extend`)."""

    def step(self, kind: str, seconds: float) -> None:
        """A decode forward finished: ``kind`` ``sparse`` (it had sparse rows) or ``dense``."""


@dataclass
class DecodeStep:
    """Backend-side state of one decode forward (on the batch as ``forward_batch.dd_step``)."""

    plan: StepPlan | None
    dense_rows: torch.Tensor | None
    dense_batch: object
    events: BackendEvents
    started: float
    attention_s: float = 0.0
    #: Layers that ran the plan's sparse rows (their counts are reported once, at the step's end).
    sparse_layers: int = 0


def finish_step(output, forward_batch) -> None:
    """End of a decode forward (the ``LogitsProcessor.forward`` hook calls it with its output).

    Cuts the speculated positions' rows from ``output`` (``next_token_logits`` goes from
    ``[batch_size + n_spec, vocab]`` to ``[batch_size, vocab]``, hidden states alike),
    storing each one's two most likely next tokens and their probabilities in its request's
    ``SpecState`` (``dual_token``; under coupled sampling, the token the coupled draw will give if
    the riding token was right, :mod:`dd_sglang.attention.coupling`), and reports the step's time. A no-op for batches this backend did not plan.
    """
    step = getattr(forward_batch, "dd_step", None)
    if not isinstance(step, DecodeStep):
        return
    forward_batch.dd_step = None
    plan = step.plan
    logits = getattr(output, "next_token_logits", None)
    if plan is not None and plan.spec.states and logits is not None:
        n, extra = plan.batch_size, len(plan.spec.states)
        if logits.shape[0] == n + extra:
            guesses = coupled_guesses(output, plan, forward_batch, n)
            if guesses is not None:  # the draw the sampler will make: certain, no runner-up
                for (state, i), g in zip(plan.spec.states, guesses, strict=True):
                    state.top[i] = (g, 1.0, g, 0.0)
            else:
                top = torch.softmax(logits[n:].float(), dim=-1).topk(2, dim=-1)
                states = plan.spec.states
                for (state, i), p, t in zip(states, top.values.tolist(), top.indices.tolist(), strict=True):
                    state.top[i] = (t[0], p[0], t[1], p[1])
            output.next_token_logits = logits[:n]
            hs = getattr(output, "hidden_states", None)
            if isinstance(hs, torch.Tensor) and hs.shape[0] == n + extra:
                output.hidden_states = hs[:n]
    if plan is not None and step.sparse_layers:
        step.events.sparse_rows(plan.num_rows * step.sparse_layers)
        if plan.exact.batch_rows:
            step.events.exact_rows(len(plan.exact.batch_rows) * step.sparse_layers)
    step.events.phase("attention", step.attention_s)
    step.events.step("sparse" if plan is not None else "dense", time.perf_counter() - step.started)
