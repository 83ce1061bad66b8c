"""The dualdecoder backend's planning and slot selection, against hand-computed sets."""

from __future__ import annotations

import pytest
import torch

from dd_sglang.attention.backend import SparseParams, critical_slots, sparse_plan
from dd_sglang.prefetch.selectors import OracleSelector

P = SparseParams(min_sparse_len=100, top_k=8, n_sink=2, n_recent=4, selector="oracle")


@pytest.mark.parametrize("n,sparse", [(99, False), (100, True), (14, False), (1000, True)])
def test_sparse_plan(n, sparse):
    assert sparse_plan(n, P) is sparse


def test_whole_context_coverage_stays_dense():
    # n_sink + n_recent + top_k = 14 >= n: the sparse set would be the whole context.
    assert not sparse_plan(
        14, SparseParams(min_sparse_len=1, top_k=8, n_sink=2, n_recent=4, selector="oracle")
    )
    assert sparse_plan(15, SparseParams(min_sparse_len=1, top_k=8, n_sink=2, n_recent=4, selector="oracle"))


def test_critical_slots_are_resident_plus_exact_topk_of_the_middle():
    g = torch.Generator().manual_seed(0)
    n, hq, hkv, d = 120, 9, 3, 64
    k_buf = torch.randn(500, hkv, d, generator=g)
    slots = torch.randperm(500, generator=g)[:n]
    q = torch.randn(hq, d, generator=g)
    out = critical_slots(q, slots, k_buf, P, OracleSelector(), d**-0.5)
    assert out.shape == (hkv, 2 + 4 + 8)
    middle = slots[2 : n - 4]
    for kv in range(hkv):
        row = out[kv].tolist()
        assert row[:6] == slots[:2].tolist() + slots[n - 4 :].tolist()
        assert len(set(row)) == len(row)
        probs = torch.stack(
            [torch.softmax(k_buf[middle, kv] @ q[h] * d**-0.5, 0) for h in range(kv * 3, kv * 3 + 3)]
        ).amax(0)
        assert set(row[6:]) == set(middle[probs.topk(8).indices].tolist())
