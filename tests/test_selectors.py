"""The block index and the selectors against scores computed by hand (brute force over every key)."""

from __future__ import annotations

import math

import pytest
import torch

from dd_sglang.prefetch.index import KeyBlockIndex, QuantKeyIndex
from dd_sglang.prefetch.scoring import BLOCK_TOKENS, row_blocks
from dd_sglang.prefetch.selectors import SELECTORS, gqa_token_scores, make_selector

HQ, HKV, D, LAYERS = 9, 3, 16, 2
SCALE = D**-0.5


def _tier(lens, seed=0, pages=None):
    """A host tier whose requests own shuffled whole 64-slot pages (as HostSparseKVPool allocates)."""
    g = torch.Generator().manual_seed(seed)
    page = 64
    need = [-(-n // page) for n in lens]
    n_pages = pages or sum(need) + 2
    host_k = torch.randn(LAYERS, n_pages * page, HKV, D, generator=g)
    order = torch.randperm(n_pages, generator=g).tolist()
    slots, start = [], 0
    for n in need:
        pg = order[start : start + n]
        start += n
        slots.append(torch.cat([torch.arange(p * page, (p + 1) * page) for p in pg]))
    return host_k, slots


def _exact_topk(q, keys, cand, k):
    """Brute force: per KV head, the k candidates with the largest group-max softmax probability."""
    s = gqa_token_scores(q, keys[cand], SCALE)  # softmax over the candidates only
    return [set(cand[s[h].topk(k).indices].tolist()) for h in range(HKV)]


def test_scores_are_max_over_group_softmax():
    g = torch.Generator().manual_seed(0)
    q, keys = torch.randn(HQ, D, generator=g), torch.randn(40, HKV, D, generator=g)
    s = gqa_token_scores(q, keys, 0.125)
    for kv in range(HKV):
        per_head = [torch.softmax(keys[:, kv] @ q[h] * 0.125, 0) for h in range(kv * 3, kv * 3 + 3)]
        torch.testing.assert_close(s[kv], torch.stack(per_head).amax(0))


def test_block_index_holds_min_and_max_of_each_block_including_a_partial_one():
    host_k, slots = _tier([150])
    idx = KeyBlockIndex(host_k)
    idx.update(slots[0], 0, 100)
    idx.update(slots[0], 100, 150)  # the block holding 96..111 is redone, 144..149 is partial
    for b in range(-(-150 // BLOCK_TOKENS)):
        pos = torch.arange(b * 16, min(150, b * 16 + 16))
        keys = host_k[:, slots[0][pos]]
        blk = int(slots[0][b * 16]) // 16
        assert torch.equal(idx.mins[:, blk], keys.amin(dim=1))
        assert torch.equal(idx.maxs[:, blk], keys.amax(dim=1))
    assert idx.nbytes == 2 * host_k.nbytes // 16


def test_block_index_refuses_slots_that_are_not_whole_blocks():
    host_k, slots = _tier([64])
    with pytest.raises(ValueError, match="16-aligned"):
        KeyBlockIndex(host_k).update(slots[0] + 3, 0, 64)
    with pytest.raises(ValueError, match="multiple of 16"):
        KeyBlockIndex(host_k[:, :40])


def _rows(lens, his, seed=0, keep=None):
    host_k, slots = _tier(lens, seed)
    keep = keep or [torch.arange(4) for _ in lens]
    rows = row_blocks(slots, [4] * len(lens), his, keep)
    return host_k, slots, rows, keep


def test_row_blocks_mark_candidates_and_count_holes():
    keep = [torch.tensor([0, 1, 2, 3, 40, 41]), torch.arange(4)]
    _, _, rows, _ = _rows([200, 90], [170, 70], keep=keep)
    assert rows.cand.shape == (2, 176)
    cand0 = torch.ones(176, dtype=torch.bool)
    cand0[[0, 1, 2, 3, 40, 41]] = False
    cand0[170:] = False
    assert torch.equal(rows.cand[0], cand0)
    assert rows.n_valid.tolist() == [11, 5]
    # Row 0: 6 kept positions and the 6 past 170 inside its last block (12); row 1: 4 sinks and the
    # 10 past 70 (14).
    assert rows.holes == 14


@pytest.mark.parametrize("name", ["oracle", "recency", "spec_host_exact"])
def test_exact_selectors_return_the_brute_force_top_k(name):
    lens, his, k = [300, 180], [260, 150], 20
    host_k, slots, rows, _ = _rows(lens, his, seed=1)
    q = torch.randn(2, HQ, D, generator=torch.Generator().manual_seed(5))
    pos, sl = make_selector(name).select(q, rows, host_k[1], k, SCALE)
    assert pos.shape == sl.shape == (2, HKV, k)
    for r in range(2):
        cand = torch.arange(4, his[r])
        want = _exact_topk(q[r], host_k[1][slots[r]], cand, k)
        for h in range(HKV):
            assert set(pos[r, h].tolist()) == want[h]
            assert torch.equal(sl[r, h], slots[r][pos[r, h]])


def test_quant_index_holds_int8_keys_and_absmax_scales():
    host_k, slots = _tier([150])
    idx = QuantKeyIndex(host_k)
    idx.update(slots[0], 0, 100)
    idx.update(slots[0], 100, 150)  # a flush after the offload
    sl = slots[0][:150]
    for layer in range(host_k.shape[0]):
        k = host_k[layer, sl]  # [150, Hkv, D]
        scale = k.abs().amax(dim=-1) / 127
        torch.testing.assert_close(idx.scale[layer, sl], scale)
        assert torch.equal(idx.q8[layer, sl], (k / scale.unsqueeze(-1)).round().to(torch.int8))
        # the dequantised keys are within half a step of the real ones
        assert ((idx.q8[layer, sl].float() * idx.scale[layer, sl].unsqueeze(-1) - k).abs()
                <= scale.unsqueeze(-1) / 2 + 1e-6).all()
    assert idx.nbytes == host_k.shape[0] * host_k.shape[1] * HKV * (D + 4)


def test_spec_host_rerank_covering_every_candidate_is_exact_and_reads_fewer_keys_otherwise():
    lens, his, k = [1200], [1100], 16
    host_k, slots, rows, _ = _rows(lens, his, seed=2)
    idx = QuantKeyIndex(host_k)
    idx.update(slots[0], 0, 1200)
    q = torch.randn(1, HQ, D, generator=torch.Generator().manual_seed(3))
    exact = make_selector("spec_host_exact").select(q, rows, host_k[0], k, SCALE)[0]
    wide = make_selector("spec_host", rerank=100).select(q, rows, host_k[0], k, SCALE, idx, 0)[0]
    assert torch.equal(wide.sort(dim=-1).values, exact.sort(dim=-1).values)
    sel = SELECTORS["spec_host"](rerank=2)
    chosen_pos, _, score = sel.score(q, rows, host_k[0], k, SCALE, idx, 0)
    assert chosen_pos.shape[2] == 2 * k  # exact keys read per KV head, not all ~1100 candidates
    pos, _ = sel.select(q, rows, host_k[0], k, SCALE, idx, 0)
    assert ((pos >= 4) & (pos < 1100)).all()
    assert all(len(set(pos[0, h].tolist())) == k for h in range(HKV))
    # int8 scores rank like the exact ones: rerank 2 finds the exact top-k (random keys, no ties)
    assert torch.equal(pos.sort(dim=-1).values, exact.sort(dim=-1).values)


def test_spec_host_int8_logits_are_the_quantised_product_and_keep_the_exact_top_k():
    """A bf16 tier: the approximate logits equal ``s_q s_k (q8 . k8)`` computed by hand from the
    quantised query and keys, lie within the two quantisation steps of the exact logits, and
    rerank 2 still finds the exact top-k."""
    lens, his, k = [1200], [1100], 16
    host_k, slots, rows, _ = _rows(lens, his, seed=2)
    host_k = host_k.bfloat16()
    idx = QuantKeyIndex(host_k)
    idx.update(slots[0], 0, 1200)
    q = torch.randn(1, HQ, D, generator=torch.Generator().manual_seed(3))
    got = idx.candidate_logits(q[None], slice(0, 1), rows, SCALE)[0]  # [1, Hkv, G, P]
    p = got.shape[-1]
    qg = q.view(1, HKV, HQ // HKV, D)
    sq = qg.abs().amax(-1, keepdim=True) / 127
    q8 = (qg / sq).round()
    sl = slots[0][:p]
    k8, sk = idx.q8[0, sl].float(), idx.scale[0, sl]  # [P, Hkv, D], [P, Hkv]
    want = torch.einsum("hgd,phd->hgp", q8[0], k8) * sk.T.unsqueeze(1) * sq[0] * SCALE
    cand = rows.cand[0, :p]
    fin = got[0][:, :, cand]
    assert got.dtype is torch.float32 and got[0][:, :, ~cand].isinf().all() and not fin.isinf().any()
    torch.testing.assert_close(fin, want[:, :, cand], rtol=1e-5, atol=1e-4)
    exact = torch.einsum("hgd,phd->hgp", qg[0], host_k[0, sl].float())[:, :, cand] * SCALE
    assert (fin - exact).abs().max() < 0.05 * exact.abs().max()
    top = make_selector("spec_host", rerank=2).select(q, rows, host_k[0], k, SCALE, idx, 0)[0]
    ref = make_selector("spec_host_exact").select(q, rows, host_k[0], k, SCALE)[0]
    assert torch.equal(top.sort(dim=-1).values, ref.sort(dim=-1).values)


def test_runs_follow_consecutive_slots_and_score_like_a_gather(monkeypatch):
    """A row over shuffled pages splits into one run per page (hand-computed), and scoring those runs
    in place equals scoring one gather of every slot (the fragmented-row path)."""
    from dd_sglang.prefetch import scoring

    host_k, slots, rows, _ = _rows([300, 180], [260, 150], seed=1)
    for r, hi in enumerate([260, 150]):
        runs = rows.runs[r]
        assert runs[0][0] == 4 and runs[-1][1] == hi  # first to last candidate
        for p0, p1, s0 in runs:
            assert torch.equal(slots[r][p0:p1], torch.arange(s0, s0 + p1 - p0))
        cuts = [p for p in range(5, hi) if int(slots[r][p]) != int(slots[r][p - 1]) + 1]
        assert [p0 for p0, _, _ in runs[1:]] == cuts and len(runs) == len(cuts) + 1
    q = torch.randn(2, HQ, D, generator=torch.Generator().manual_seed(5))
    idx = QuantKeyIndex(host_k)
    for sl, n in zip(slots, [300, 180], strict=True):
        idx.update(sl, 0, n)
    in_place = scoring.candidate_logits(q[None], host_k[1:2], rows, SCALE)[0]
    in_place8 = idx.candidate_logits(q[None], slice(1, 2), rows, SCALE)[0]
    monkeypatch.setattr(scoring, "MAX_RUNS", 0)
    again = rows.take(torch.arange(2))
    gathered = scoring.candidate_logits(q[None], host_k[1:2], again, SCALE)[0]
    assert torch.equal(in_place.isinf(), gathered.isinf())
    torch.testing.assert_close(in_place, gathered)
    assert torch.equal(in_place8, idx.candidate_logits(q[None], slice(1, 2), again, SCALE)[0])
    by_hand = torch.einsum("hgd,phd->hgp", q[0].view(HKV, -1, D), host_k[1][slots[0][:260]]) * SCALE
    torch.testing.assert_close(in_place[0, :, :, 4:260], by_hand[:, :, 4:])


@pytest.mark.parametrize("name", ["spec_host", "spec_host_exact", "oracle", "quest_device"])
def test_selecting_every_layer_in_one_call_equals_one_call_per_layer(name):
    """``select_layers`` over every layer (the CPU's end-of-step selection) returns, layer by layer,
    the sets ``select`` returns for that layer alone."""
    host_k, slots, rows, _ = _rows([700, 420], [650, 400], seed=9)
    sel = make_selector(name)
    idx = None
    if sel.index_location:
        idx = (QuantKeyIndex if name == "spec_host" else KeyBlockIndex)(host_k)
        for sl, n in zip(slots, [700, 420], strict=True):
            idx.update(sl, 0, n)
    q = torch.randn(LAYERS, 2, HQ, D, generator=torch.Generator().manual_seed(10))
    pos, sl = sel.select_layers(q, rows, host_k, 24, SCALE, idx, slice(0, LAYERS))
    assert pos.shape == sl.shape == (LAYERS, 2, HKV, 24)
    for layer in range(LAYERS):
        p1, s1 = sel.select(q[layer], rows, host_k[layer], 24, SCALE, idx, layer)
        assert torch.equal(pos[layer].sort(-1).values, p1.sort(-1).values)
        assert torch.equal(sl[layer].sort(-1).values, s1.sort(-1).values)


def test_spec_host_finds_tokens_aligned_with_the_query():
    """Keys aligned with the query at 12 scattered positions: the int8 scores rank them first."""
    lens, his, k = [2000], [1900], 12
    host_k, slots, rows, _ = _rows(lens, his, seed=4)
    q = torch.randn(1, HQ, D, generator=torch.Generator().manual_seed(6))
    hot = torch.tensor([130, 311, 402, 533, 700, 871, 902, 1003, 1500, 1611, 1702, 1803])
    host_k *= 0.2
    for h in range(HKV):
        host_k[0, slots[0][hot], h] = 3 * q[0, h * 3] / q[0, h * 3].norm()
    idx = QuantKeyIndex(host_k)
    idx.update(slots[0], 0, 2000)
    pos, _ = make_selector("spec_host", rerank=1).select(q, rows, host_k[0], k, SCALE, idx, 0)
    exact = make_selector("spec_host_exact").select(q, rows, host_k[0], k, SCALE)[0]
    for h in range(HKV):
        assert set(exact[0, h].tolist()) == set(hot.tolist())
        assert set(pos[0, h].tolist()) == set(exact[0, h].tolist())


def test_quest_takes_the_candidates_of_the_blocks_with_the_best_bound():
    lens, his, k = [500], [480], 40
    host_k, slots, rows, _ = _rows(lens, his, seed=7)
    idx = KeyBlockIndex(host_k)
    idx.update(slots[0], 0, 500)
    q = torch.randn(1, HQ, D, generator=torch.Generator().manual_seed(8))
    pos, _ = make_selector("quest_device").select(q, rows, host_k[0], k, SCALE, idx, 0)
    for h in range(HKV):
        # Brute force bound of every block for this KV head: max over its query heads of
        # sum_d max(q_d min_d, q_d max_d), each head's bounds less logsumexp(bounds + log 16).
        bounds = []
        for b in range(30):
            kb = host_k[0, slots[0][b * 16 : b * 16 + 16], h]
            lo, hi = kb.amin(0), kb.amax(0)
            bounds.append([torch.maximum(q[0, j] * lo, q[0, j] * hi).sum() * SCALE for j in range(h * 3, h * 3 + 3)])
        b = torch.tensor(bounds)  # [30 blocks, 3 heads]
        score = (b - torch.logsumexp(b + math.log(16), dim=0)).amax(dim=1)
        blocks = set((pos[0, h] // 16).tolist())
        worst_taken = min(score[list(blocks)])
        assert all(score[x] <= worst_taken for x in range(30) if x not in blocks)
        assert ((pos[0, h] >= 4) & (pos[0, h] < 480)).all()


def test_unknown_selector_and_bad_k_are_refused():
    with pytest.raises(ValueError, match="selector must be one of"):
        make_selector("nope")
    with pytest.raises(ValueError, match="rerank"):
        make_selector("spec_host", rerank=0.5)
    host_k, _, rows, _ = _rows([100], [90])
    with pytest.raises(ValueError, match="k must be"):
        make_selector("oracle").select(torch.zeros(1, HQ, D), rows, host_k[0], 0, SCALE)
    with pytest.raises(ValueError, match="needs an index"):
        make_selector("spec_host").select(torch.zeros(1, HQ, D), rows, host_k[0], 4, SCALE)


def test_two_riding_queries_rank_by_the_max_of_their_scores():
    """Two speculated positions' queries join each KV head's group: the set is the top-k of the max of
    the two queries' scores (same budget k), as built by the runner from the step's tokens."""
    from dd_sglang.prefetch.ahead_selection import selection_queries

    lens, his, k = [300], [260], 20
    host_k, slots, rows, _ = _rows(lens, his, seed=9)
    g = torch.Generator().manual_seed(10)
    q3 = torch.randn(3, HQ, D, generator=g)  # tokens: the real row, then two riding positions
    q = selection_queries(q3, torch.tensor([[1, 2]]), HKV)
    assert q.shape == (1, 2 * HQ, D)
    pos, _ = make_selector("spec_host_exact").select(q, rows, host_k[0], k, SCALE)
    cand = torch.arange(4, 260)
    keys = host_k[0][slots[0][cand]]
    both = torch.maximum(gqa_token_scores(q3[1], keys, SCALE), gqa_token_scores(q3[2], keys, SCALE))
    for h in range(HKV):
        assert set(pos[0, h].tolist()) == set(cand[both[h].topk(k).indices].tolist())
