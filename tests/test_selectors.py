"""Selectors against scores computed by hand: oracle (GQA max aggregation), Quest's page summaries
and page selection, device-state reporting, bad input."""

from __future__ import annotations

import pytest
import torch

from dd_sglang.prefetch.selectors import (
    SELECTORS,
    OracleSelector,
    QuestDeviceSelector,
    gqa_token_scores,
    make_selector,
    quest_page_summaries,
    quest_select,
)

HQ, HKV, D = 9, 3, 64


def _data(lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(len(lens), HQ, D, generator=g)
    keys = [torch.randn(n, HKV, D, generator=g) for n in lens]
    return q, keys


def _host(keys, seed=0):
    """Scatter the requests' keys into a shuffled host buffer; return (host_keys, locations)."""
    total = sum(len(k) for k in keys)
    perm = torch.randperm(total + 10, generator=torch.Generator().manual_seed(seed))[:total]
    host = torch.zeros(total + 10, HKV, D)
    locations, start = [], 0
    for kt in keys:
        loc = perm[start : start + len(kt)]
        host[loc] = kt
        locations.append(loc)
        start += len(kt)
    return host, locations


def test_scores_are_max_over_group_softmax():
    q, keys = _data([40])
    s = gqa_token_scores(q[0], keys[0], 0.125)
    for kv in range(HKV):
        per_head = [torch.softmax(keys[0][:, kv] @ q[0, h] * 0.125, 0) for h in range(kv * 3, kv * 3 + 3)]
        torch.testing.assert_close(s[kv], torch.stack(per_head).amax(0))


def test_oracle_returns_exact_topk_per_kv_head():
    q, keys = _data([100, 7, 33], seed=1)
    host, loc = _host(keys)
    cs = OracleSelector().select(q, loc, 16, host, D**-0.5)
    assert cs.positions.shape == (3, HKV, 16)
    assert cs.lengths.tolist() == [[16] * HKV, [7] * HKV, [16] * HKV]
    for r, kt in enumerate(keys):
        for kv in range(HKV):
            # Brute force: rank every token by the group's max probability.
            probs = torch.stack(
                [torch.softmax(kt[:, kv] @ q[r, h] * D**-0.5, 0) for h in range(kv * 3, kv * 3 + 3)]
            )
            best = probs.amax(0).argsort(descending=True)[: min(16, len(kt))]
            assert cs.as_sets(r, kv) == set(best.tolist())


def test_k_at_least_context_selects_everything():
    q, keys = _data([12])
    host, loc = _host(keys)
    cs = OracleSelector().select(q, loc, 64, host, 1.0)
    assert all(cs.as_sets(0, kv) == set(range(12)) for kv in range(HKV))


@pytest.mark.parametrize("name", ["oracle", "spec_host", "recency"])
def test_host_side_selectors_keep_no_device_state(name):
    assert make_selector(name).device_aux_bytes() == 0


def test_lookahead_flags():
    assert {n for n, c in SELECTORS.items() if c.lookahead} == {"spec_host", "recency"}
    assert {n for n, c in SELECTORS.items() if c.uses_speculator} == {"spec_host"}


def test_quest_summaries_are_page_min_max():
    keys = torch.randn(37, HKV, D, generator=torch.Generator().manual_seed(3))
    mins, maxs = quest_page_summaries(keys, 16)
    assert mins.shape == maxs.shape == (3, HKV, D)  # 16 + 16 + 5 tokens
    for i, (a, b) in enumerate([(0, 16), (16, 32), (32, 37)]):
        torch.testing.assert_close(mins[i], keys[a:b].amin(0))
        torch.testing.assert_close(maxs[i], keys[a:b].amax(0))


def test_quest_selects_pages_by_upper_bound_then_their_tokens():
    g = torch.Generator().manual_seed(4)
    q = torch.randn(HQ, D, generator=g)
    keys = torch.randn(70, HKV, D, generator=g)
    mins, maxs = quest_page_summaries(keys, 16)
    got = quest_select(q, mins, maxs, 70, 20, 16)
    assert got.shape == (HKV, 20)
    for kv in range(HKV):
        # Brute force: Quest's per-page bound, max over the KV head's 3 query heads.
        bound = [
            max(
                float(torch.maximum(q[h] * mins[p, kv], q[h] * maxs[p, kv]).sum())
                for h in range(kv * 3, kv * 3 + 3)
            )
            for p in range(mins.shape[0])
        ]
        pages = sorted(range(len(bound)), key=lambda p: -bound[p])
        expect = [t for p in pages for t in range(p * 16, min(p * 16 + 16, 70))][:20]
        assert got[kv].tolist() == expect


def test_quest_selector_interface_and_aux_bytes():
    q, keys = _data([100, 9], seed=5)
    host, loc = _host(keys)
    sel = QuestDeviceSelector()
    cs = sel.select(q, loc, 32, host, D**-0.5)
    assert cs.lengths.tolist() == [[32] * HKV, [9] * HKV]
    mins, maxs = quest_page_summaries(keys[0], 16)
    assert cs.positions[0].tolist() == quest_select(q[0], mins, maxs, 100, 32, 16).tolist()
    assert sel.device_aux_bytes() == 0  # the backend keeps the summaries and reports them per request


@pytest.mark.parametrize(
    "call,needle",
    [
        (lambda s, q, h, loc: s.select(q, loc, 0, h, 1.0), "k must be >= 1"),
        (lambda s, q, h, loc: s.select(q, loc[:1], 4, h, 1.0), "one locations tensor per request"),
        (
            lambda s, q, h, loc: s.select(q, [loc[0], torch.zeros(0, dtype=torch.int64)], 4, h, 1.0),
            r"locations\[1\]",
        ),
        (lambda s, q, h, loc: s.select(q, loc, 4, h[:, :, :8], 1.0), "host_keys must be"),
    ],
)
def test_bad_input(call, needle):
    q, keys = _data([5, 6])
    host, loc = _host(keys)
    with pytest.raises(ValueError, match=needle):
        call(OracleSelector(), q, host, loc)


def test_unknown_selector_name():
    with pytest.raises(ValueError, match="selector must be one of"):
        make_selector("nope")
