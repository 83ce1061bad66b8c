"""The two-level selection (``experimental.first_level_tokens``) against a brute force in plain PyTorch.

The C kernel (``first_level`` in ``dd_sglang/kernels/cpu_select.c``) first keeps, per row, the
tokens of each KV head's best 16-token blocks (ranked by the blocks' int8 mean keys), the union
over the KV heads, then selects among them as the full scan does. The reference here recomputes
all of it from the float keys: block means and their int8 quantisation, the block ranking, the
union, the int8 scores, the exact re-ranking and the top-k, with no dd_sglang selection code.
"""

from __future__ import annotations

import math

import pytest
import torch

from dd_sglang.kernels import native
from dd_sglang.prefetch.index import QuantKeyIndex
from dd_sglang.prefetch.scoring import row_blocks
from dd_sglang.prefetch.selectors import make_selector

pytestmark = pytest.mark.skipif(not native.available(), reason=f"no CPU selection kernel here: "
                                f"{native.unavailable_reason()}")  # fmt: skip

PAGE = 64


def _q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127
    return (x / s).round().clamp(-127, 127), s


def _tier(lens, d, seed, hkv=3, layers=2, keys=None):
    """Host keys over shuffled 64-slot pages, the int8 index with block means, and the rows."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // PAGE) for n in lens]
    n_pages = sum(need) + 2
    if keys is None:
        keys = torch.randn(layers, n_pages * PAGE, hkv, d, generator=g) + 1.5 * torch.randn(layers, 1, hkv, d,
                                                                                              generator=g)  # fmt: skip
    order = torch.randperm(n_pages, generator=g).tolist()
    slots, start = [], 0
    for n in need:
        slots.append(torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in order[start : start + n]]))
        start += n
    idx = QuantKeyIndex(keys, native=True, block_means=True)
    for sl, n in zip(slots, lens, strict=True):
        idx.update(sl, 0, n)
    rows = row_blocks(slots, [4] * len(lens), [n - 128 for n in lens], [torch.arange(4)] * len(lens))
    return keys, idx, rows, slots


def _brute_force(q, keys, slots, lens, k, m, pages, scale):
    """``[L, R, Hkv, k]`` positions: the two-level selection recomputed in plain PyTorch, float32."""
    n_layers, _, hkv, d = keys.shape
    g = q.shape[2] // hkv
    out = torch.empty(n_layers, len(lens), hkv, k, dtype=torch.int64)
    for r, (sl, n) in enumerate(zip(slots, lens, strict=True)):
        cand = torch.arange(4, n - 128)  # the sinks and the recent window are resident, not candidates
        for layer in range(n_layers):
            kk = keys[layer, sl[:n]]  # [n, Hkv, D] by position
            qq = q[layer, r].view(hkv, g, d)
            q8, qs = _q8(qq)
            keep = torch.zeros(n, dtype=torch.bool)
            blocks = sorted({int(p) // 16 for p in cand})
            if pages < len(blocks):
                means = torch.stack([kk[b * 16 : min(b * 16 + 16, n)].mean(0) for b in blocks])  # [B, Hkv, D]
                m8, ms = _q8(means)
                a = torch.einsum("hgd,bhd->hgb", q8, m8) * ms.squeeze(-1).T[:, None, :] * qs * scale
                bs = (a - a.logsumexp(-1, keepdim=True)).amax(1)  # [Hkv, B]
                for h in range(hkv):
                    # the best `pages`, ties to the first block (a stable sort on the negated score)
                    order = torch.sort(-bs[h], stable=True).indices[:pages]
                    for i in order.tolist():
                        keep[blocks[i] * 16 : blocks[i] * 16 + 16] = True
                c = cand[keep[cand]]
                if c.numel() < m:  # too few left to re-rank m: the kernel keeps every candidate
                    c = cand
            else:
                c = cand
            k8, ks = _q8(kk[c])  # [C, Hkv, D]
            a = torch.einsum("hgd,chd->hgc", q8, k8) * ks.squeeze(-1).T[:, None, :] * qs * scale
            z = a.logsumexp(-1, keepdim=True)
            s = (a - z).amax(1)  # [Hkv, C]
            for h in range(hkv):
                top = torch.sort(-s[h], stable=True).indices[:m]
                e = torch.einsum("gd,cd->gc", qq[h], kk[c[top], h]) * scale
                taken = (a[h][:, top] - z[h]).exp().sum(-1, keepdim=True).clamp(max=1)
                rest = z[h] + torch.log1p(-taken) if float(taken.max()) < 1 else torch.full_like(z[h], -math.inf)
                zz = torch.logaddexp(e.logsumexp(-1, keepdim=True), rest)
                f = (e - zz).amax(0)
                out[layer, r, h] = c[top[torch.sort(-f, stable=True).indices[:k]]]
    return out


def _select(q, keys, idx, rows, k, pages):
    sl, ok = rows.tokens
    arg = (idx.block_means[0], idx.block_means[1], pages) if pages else None
    return native.spec_host_select(q, sl, ok, idx.q8, idx.scale, keys, k, 2 * k, 0.125, None, arg)[0]


def _agree(a, b):
    pairs = list(zip(a.flatten(0, -2).tolist(), b.flatten(0, -2).tolist(), strict=True))
    return sum(set(x) == set(y) for x, y in pairs) / len(pairs)


@pytest.mark.parametrize("pages", [12, 40])
def test_two_level_sets_equal_the_brute_force(pages):
    """Rows of two lengths over shuffled pages, 2 layers, 3 KV heads of 3 queries: every set the
    kernel chooses with a first level of ``pages`` blocks is the brute force's."""
    lens = [1500, 2300]
    keys, idx, rows, slots = _tier(lens, 64, seed=1)
    q = torch.randn(2, 2, 9, 64, generator=torch.Generator().manual_seed(2)) * 2
    got = _select(q, keys, idx, rows, 64, pages)
    ref = _brute_force(q, keys, slots, lens, 64, 128, pages, 0.125)
    assert _agree(got, ref) == 1.0


def _cuts_nothing(lens: list[int], seed: int, budget: int) -> None:
    """A first level of ``budget`` tokens (k 32, rerank 2) that must cut nothing: the sets equal the full
    scan's (the kernel without a first level) and the brute force's."""
    keys, idx, rows, slots = _tier(lens, 64, seed=seed)
    q = torch.randn(2, 1, 9, 64, generator=torch.Generator().manual_seed(seed + 1))
    got = _select(q, keys, idx, rows, 32, budget)
    assert torch.equal(got, _select(q, keys, idx, rows, 32, 0))
    assert _agree(got, _brute_force(q, keys, slots, lens, 32, 64, budget, 0.125)) == 1.0


def test_a_budget_covering_every_block_is_the_full_scan():
    """With more blocks kept than the row has, the first level cuts nothing: the sets are the full
    scan's (the kernel without a first level) and the brute force's."""
    _cuts_nothing([1000], seed=3, budget=10_000)


def test_a_request_shorter_than_one_block_beyond_its_resident_set():
    """140 tokens: 8 candidates (positions 4-11) in one block, fewer than k + m: every candidate is
    kept, as the full scan keeps them."""
    lens = [140]
    keys, idx, rows, slots = _tier(lens, 64, seed=5)
    q = torch.randn(2, 1, 9, 64, generator=torch.Generator().manual_seed(6))
    got = _select(q, keys, idx, rows, 4, 1)
    assert got.shape[-1] == 4
    assert _agree(got, _brute_force(q, keys, slots, lens, 4, 8, 1, 0.125)) == 1.0
    assert torch.equal(got, _select(q, keys, idx, rows, 4, 0))


def test_equal_keys_tie_to_the_first_blocks():
    """Every key equal: every block ties, and the first level keeps the first 4 blocks in position
    order (positions 4-63: block 0 starts with the 4 resident sinks), as the brute force's stable
    order does; every set is k distinct positions from them. (Among tied tokens the kernel's
    final top-k takes any k, as the full scan's does.)"""
    lens = [1200]
    keys = torch.ones(2, 22 * PAGE, 3, 64)
    keys, idx, rows, slots = _tier(lens, 64, seed=7, keys=keys)
    q = torch.randn(2, 1, 9, 64, generator=torch.Generator().manual_seed(8))
    got = _select(q, keys, idx, rows, 16, 4)
    for s in got.flatten(0, -2).tolist():
        assert len(set(s)) == 16 and all(4 <= p < 64 for p in s), s


def test_an_outlier_in_a_dull_block_is_lost_by_the_means_and_found_by_the_full_scan():
    """One key far above every other in a block whose other 15 keys point away from the query:
    the block's mean ranks it last, so a small first level misses the outlier (as the brute
    force does), while the full scan picks it first. The first level is a heuristic, not a bound:
    what it costs is measured in ``bench.select_recall``."""
    g = torch.Generator().manual_seed(9)
    lens = [1200]
    d = 64
    keys = torch.randn(1, 22 * PAGE, 3, d, generator=g) * 0.1
    q = torch.zeros(1, 1, 9, d)
    q[..., 0] = 1.0
    _, _, _, slots = _tier(lens, d, seed=10, layers=1, keys=keys.clone())
    outlier = 500  # a position; its block 31 holds positions 496-511
    keys[0, slots[0][496:512], :, 0] = -3.0
    keys[0, slots[0][outlier], :, 0] = 40.0
    keys, idx, rows, slots = _tier(lens, d, seed=10, layers=1, keys=keys)
    full = _select(q, keys, idx, rows, 8, 0)
    two = _select(q, keys, idx, rows, 8, 4)
    assert int(full[0, 0, 0, 0]) == outlier
    assert outlier not in two[0, 0, 0].tolist()
    assert _agree(two, _brute_force(q, keys, slots, lens, 8, 16, 4, 0.125)) == 1.0


def test_the_selector_passes_its_budget_and_refuses_it_without_the_kernel():
    """``first_level_tokens`` reaches the kernel as blocks (tokens / 16); a ``rerank x k`` above the
    budget less 32 scans every candidate; without the C kernel the setting is refused."""
    lens = [2000]
    keys, idx, rows, slots = _tier(lens, 64, seed=11)
    q = torch.randn(2, 1, 9, 64, generator=torch.Generator().manual_seed(12))
    sel = make_selector("host_sync", 2.0, True, 320)
    pos, _ = sel.select_layers(q, rows, keys, 64, 0.125, idx, slice(0, 2))
    assert torch.equal(pos, _select(q, keys, idx, rows, 64, 20))
    assert _agree(pos, _brute_force(q, keys, slots, lens, 64, 128, 20, 0.125)) == 1.0
    pos, _ = sel.select_layers(q, rows, keys, 160, 0.125, idx, slice(0, 2))  # m = 320 > 320 - 32
    assert torch.equal(pos, _select(q, keys, idx, rows, 160, 0))
    assert _agree(pos, _brute_force(q, keys, slots, lens, 160, 320, 10_000, 0.125)) == 1.0
    with pytest.raises(ValueError, match="first_level_tokens"):
        make_selector("host_sync", 2.0, False, 320)
    with pytest.raises(ValueError, match="blocks kept per KV head"):
        native.spec_host_select(q, *rows.tokens, idx.q8, idx.scale, keys, 8, 16, 0.125, None,
                                (idx.block_means[0], idx.block_means[1], 0))  # fmt: skip


def test_block_means_are_the_quantised_means_of_each_block():
    """The index's block means, rebuilt from the float keys here: whole blocks and the last partial
    one (positions below the request's end only), after an offload and a later flush."""
    keys, idx, _, slots = _tier([1000], 64, seed=13)
    idx.update(slots[0], 1000, 1010)  # a flush of 10 more positions into the partial block 62
    means, scales = idx.block_means
    for pos0, n in ((0, 16), (496, 16), (992, 16), (1008, 2)):
        blk = int(slots[0][pos0]) // 16
        ref8, refs = _q8(keys[:, slots[0][pos0 : pos0 + n]].mean(1))
        assert torch.equal(means[:, blk].float(), ref8)
        torch.testing.assert_close(scales[:, blk], refs.squeeze(-1))


def test_a_cut_that_leaves_fewer_than_m_candidates_scans_every_one():
    """One block kept per KV head holds at most 3 x 16 = 48 candidates, fewer than the 64 (2 x 32)
    the exact re-rank takes: the kernel cuts nothing and selects as the full scan does."""
    _cuts_nothing([1500], seed=14, budget=1)
