"""Guaranteed recall's set arithmetic (:func:`dd_sglang.prefetch.verify.verify_sets`), against sets
worked out by hand and against Python set operations on random sets."""

from __future__ import annotations

import pytest
import torch

from dd_sglang.prefetch.verify import verify_sets


def _t(x):
    return torch.tensor(x, dtype=torch.int64)


def test_misses_take_the_freed_columns_in_column_order():
    """Prefetched positions [5, 7, 9, 11], real set [9, 2, 5, 30] (best first): 5 and 9 stay in their
    columns; columns 1 and 3 (7, 11) are freed and take 2 and 30, the misses, best first."""
    have = _t([[[5, 7, 9, 11]]])
    want = _t([[[9, 2, 5, 30]]])
    v = verify_sets(have, have + 100, want, want + 100, _t([4]))
    assert v.slots.tolist() == [[[105, 102, 109, 130]]]
    assert v.fetched.tolist() == [[[False, True, False, True]]]
    assert v.hits.tolist() == [2]


def test_columns_past_a_rows_top_k_are_left_alone():
    """Row 0 has top_k 2 of 3 columns: only its first two entries count on either side (prefetched
    {4, 8}, real {8, 5}: 4's column takes 5), and its third column keeps its value; row 1 held all."""
    have = _t([[[4, 8, 1]], [[3, 6, 9]]])
    want = _t([[[8, 5, 4]], [[9, 6, 3]]])
    v = verify_sets(have, have, want, want, _t([2, 3]))
    assert v.slots.tolist() == [[[5, 8, 1]], [[3, 6, 9]]]
    assert v.fetched.tolist() == [[[True, False, False]], [[False, False, False]]]
    assert v.hits.tolist() == [1, 3]


@pytest.mark.parametrize("seed", range(20))
def test_the_attended_set_is_the_real_querys_set(seed):
    """Random sets of distinct positions, top_k per row below k: the verified columns hold exactly the
    real query's first top_k positions, every kept column still holds its prefetched token, the fetched
    columns are the misses, and hits count the overlap."""
    g = torch.Generator().manual_seed(seed)
    n, h, k, universe = 3, 2, 16, 40
    top_k = torch.randint(1, k + 1, (n,), generator=g)
    have = torch.stack([torch.stack([torch.randperm(universe, generator=g)[:k] for _ in range(h)]) for _ in range(n)])
    want = torch.stack([torch.stack([torch.randperm(universe, generator=g)[:k] for _ in range(h)]) for _ in range(n)])
    v = verify_sets(have, have * 10, want, want * 10, top_k)
    for r in range(n):
        kr = int(top_k[r])
        for j in range(h):
            got = v.slots[r, j, :kr].tolist()
            assert sorted(got) == sorted((want[r, j, :kr] * 10).tolist())
            wanted = set(want[r, j, :kr].tolist())
            for c in range(kr):
                kept = int(have[r, j, c]) in wanted
                assert bool(v.fetched[r, j, c]) == (not kept)
                if kept:
                    assert got[c] == int(have[r, j, c]) * 10
            assert v.slots[r, j, kr:].tolist() == (have[r, j, kr:] * 10).tolist()
        assert int(v.hits[r]) == sum(len(set(have[r, j, :kr].tolist()) & set(want[r, j, :kr].tolist()))
                                     for j in range(h))  # fmt: skip


def test_bad_inputs_are_refused_with_the_field_named():
    a = _t([[[1, 2]]])
    with pytest.raises(ValueError, match="top_k"):
        verify_sets(a, a, a, a, _t([3]))
    with pytest.raises(ValueError, match="alike"):
        verify_sets(a, a, a[..., :1], a[..., :1], _t([1]))
    with pytest.raises(ValueError, match="distinct"):
        verify_sets(_t([[[1, 1]]]), a, a, a, _t([2]))
