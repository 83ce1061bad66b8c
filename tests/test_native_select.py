"""The C selection kernel (``dd_sglang/kernels/cpu_select.c``) against ``spec_host``'s PyTorch path.

Both must choose the same critical sets: same positions per layer, row and KV head, their host
slots, best first. Skipped where no C compiler can build the kernel (the runtime then uses the
PyTorch path, ``experimental.kernel: auto``).
"""

from __future__ import annotations

import pytest
import torch

from dd_sglang.kernels import native, native_build
from dd_sglang.prefetch.index import QuantKeyIndex
from dd_sglang.prefetch.runner import use_native_kernel
from dd_sglang.prefetch.scoring import row_blocks
from dd_sglang.prefetch.selectors import make_selector

pytestmark = pytest.mark.skipif(not native.available(), reason=f"no CPU selection kernel here: "
                                f"{native.unavailable_reason()}")  # fmt: skip


@pytest.fixture(params=["native", "haswell", "x86-64"], scope="module")
def march(request, tmp_path_factory):
    """Each test runs on the library built for this CPU, for AVX2 (no AVX-512: ``haswell``) and
    for plain x86-64 (no SIMD path): CI may land on a machine with any of them. A target this
    machine cannot run is skipped."""
    if request.param != "native":
        import platform

        if platform.machine() != "x86_64":
            pytest.skip("x86 targets only")
        flags = native_build._cpu_flags()
        if request.param == "haswell" and not all(f in flags.split() for f in ("avx2", "fma")):
            pytest.skip("this CPU has no AVX2/FMA")
        try:
            native.load(native.build(tmp_path_factory.mktemp("native"), march=request.param))
        except native.NativeUnavailable as err:
            pytest.skip(f"cannot build for {request.param}: {err}")
    yield request.param
    native.load(native.build())  # back to this CPU's build


def _case(lens, d, dtype, seed, hq=9, hkv=3, layers=3, n_keep=0):
    """Host tier over shuffled 64-slot pages (as HostSparseKVPool allocates), its int8 index, rows."""
    g = torch.Generator().manual_seed(seed)
    page = 64
    need = [-(-n // page) for n in lens]
    n_pages = sum(need) + 3
    # a shared direction per head plus noise: attention concentrates like a real model's
    host_k = (torch.randn(layers, n_pages * page, hkv, d, generator=g)
              + 1.5 * torch.randn(layers, 1, hkv, d, generator=g)).to(dtype)  # fmt: skip
    order = torch.randperm(n_pages, generator=g).tolist()
    slots, start = [], 0
    for n in need:
        slots.append(torch.cat([torch.arange(p * page, (p + 1) * page) for p in order[start : start + n]]))
        start += n
    idx = QuantKeyIndex(host_k)
    for sl, n in zip(slots, lens, strict=True):
        idx.update(sl, 0, n)
    keep = [torch.randperm(n - 200, generator=g)[:n_keep] + 4 for n in lens]
    rows = row_blocks(slots, [4] * len(lens), [n - 128 for n in lens], keep)
    q = torch.randn(layers, len(lens), hq, d, generator=g) + torch.randn(layers, 1, hq, d, generator=g)
    return host_k, idx, rows, q


def _same_sets(a, b):
    return [set(x) == set(y) for x, y in zip(a.flatten(0, -2).tolist(), b.flatten(0, -2).tolist(), strict=True)]


@pytest.mark.parametrize(
    ("d", "dtype", "hq"),
    [(64, torch.bfloat16, 9), (64, torch.float32, 9), (16, torch.bfloat16, 9), (128, torch.bfloat16, 32),
     (64, torch.bfloat16, 18)],  # fmt: skip
)
def test_native_selection_chooses_the_pytorch_sets(d, dtype, hq, march):
    """SIMD (head_dim 64, 128) and plain (16) paths, bf16 and float32 tiers, two riding queries
    (18 query vectors over 3 KV heads), rows of different lengths over shuffled pages with kept
    tokens: every (layer, row, KV head) set equals PyTorch's, with the same slots, best first."""
    hkv = 8 if hq == 32 else 3
    host_k, idx, rows, q = _case([1500, 2300, 900], d, dtype, seed=d + hq, hq=hq, hkv=hkv, n_keep=5)
    k, scale = 96, d**-0.5
    torch_sel, native_sel = make_selector("spec_host", 2.0), make_selector("spec_host", 2.0, native=True)
    layers = slice(0, host_k.shape[0])
    want_pos, want_slots = torch_sel.select_layers(q, rows, host_k, k, scale, idx, layers)
    got_pos, got_slots = native_sel.select_layers(q, rows, host_k, k, scale, idx, layers)
    assert got_pos.shape == want_pos.shape == (3, 3, hkv, k) and got_pos.dtype is torch.int64
    assert all(_same_sets(got_pos, want_pos))
    table, ok = rows.tokens
    for r in range(3):
        assert torch.equal(got_slots[:, r], table[r][got_pos[:, r]])  # each slot is its position's
        assert ok[r][got_pos[:, r]].all()  # only candidates
    # best first: the kernel's order is PyTorch's order by score (ties aside)
    _, _, score = torch_sel.score_layers(q, rows, host_k, k, scale, idx, layers)
    pos_all, _, _ = torch_sel.score_layers(q, rows, host_k, k, scale, idx, layers)
    s = torch.full((*score.shape[:3], table.shape[1]), float("-inf")).scatter_(-1, pos_all, score)
    ranked = s.gather(-1, got_pos)
    assert (ranked[..., :-1] >= ranked[..., 1:] - 1e-5).all()


def test_native_selection_splits_over_threads_like_one_call(march):
    """The two-thread split (first half of the tasks here, second on the helper) gives the sets of
    a single-layer call per layer."""
    host_k, idx, rows, q = _case([1300, 1700], 64, torch.bfloat16, seed=4, layers=4)
    sel = make_selector("spec_host", 2.0, native=True)
    pos, slots = sel.select_layers(q, rows, host_k, 64, 0.125, idx, slice(0, 4))
    for layer in range(4):
        p1, s1 = sel.select(q[layer], rows, host_k[layer], 64, 0.125, idx, layer)
        assert torch.equal(pos[layer], p1) and torch.equal(slots[layer], s1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_task_on_several_threads_chooses_the_one_thread_sets(dtype, march):
    """One row of one layer (a selection at attention time, a verification at batch 1) runs on every
    thread, its candidates' scores split in 16-candidate blocks and then its KV heads: the same
    sets in the same order on 1, 2 and 3 threads, and PyTorch's sets."""
    host_k, idx, rows, q = _case([1500], 64, dtype, seed=21, layers=2, n_keep=5)
    sel, ref = make_selector("spec_host", 2.0, native=True), make_selector("spec_host", 2.0)
    threads = torch.get_num_threads()
    got = {}
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            pos, slots = sel.select(q[1], rows, host_k[1], 96, 0.125, idx, 1)
            got[n] = (pos, slots)
    finally:
        torch.set_num_threads(threads)
    for n in (2, 3):
        assert all(torch.equal(a, b) for a, b in zip(got[n], got[1], strict=True))
    assert all(_same_sets(got[1][0], ref.select(q[1], rows, host_k[1], 96, 0.125, idx, 1)[0]))


@pytest.mark.parametrize("n_len", [1500, 1507])
def test_scores_tied_at_the_threshold_take_the_first_candidates(n_len, march):
    """Keys in three levels along one direction per KV head give three groups of equal int8 scores.
    With ``m = k`` (rerank 1) the ``m`` re-ranked are every candidate above the ``m``-th score and
    then the first of those tied with it, in position order: best first, the top level's positions
    ascending, then the first ``k - n_top`` of the middle level (1,368 and 1,375 candidates: whole
    16-candidate blocks and a tail)."""
    host_k, _, rows, q = _case([n_len], 64, torch.bfloat16, seed=31, layers=2)
    g = torch.Generator().manual_seed(32)
    level = torch.randint(1, 4, (host_k.shape[1],), generator=g).float()  # 1, 2 or 3 per host slot
    u = torch.randn(host_k.shape[0], 1, host_k.shape[2], 64, generator=g)
    host_k = (level.view(1, -1, 1, 1) * u).to(torch.bfloat16)
    idx = QuantKeyIndex(host_k)
    table, ok = rows.tokens
    idx.update(table[0][:n_len], 0, n_len)
    q = u.expand(2, 1, 3, 64).repeat_interleave(3, dim=2).contiguous()  # each query head along its KV head's u
    cand = ok[0].nonzero().flatten()
    lv = level[table[0][cand]]
    n_top = int((lv == 3).sum())
    k = n_top + 40
    pos, slots = make_selector("spec_host", 1.0, native=True).select_layers(q, rows, host_k, k, 0.125, idx, slice(0, 2))
    want = torch.cat([cand[lv == 3], cand[lv == 2][:40]])
    for layer in range(2):
        for h in range(3):
            assert pos[layer, 0, h].tolist() == want.tolist()
            assert torch.equal(slots[layer, 0, h], table[0][want])


def test_selection_writes_into_given_tensors_and_refuses_bad_ones():
    """``out``: both selectors write the sets into the given tensors (the next step's sets, in
    place), equal to a call without; a wrong shape, dtype or layout is refused."""
    from dd_sglang.kernels import native

    host_k, idx, rows, q = _case([1300, 1700], 64, torch.bfloat16, seed=5, layers=4)
    for sel in (make_selector("spec_host", 2.0, native=True), make_selector("spec_host", 2.0)):
        want = sel.select_layers(q, rows, host_k, 64, 0.125, idx, slice(0, 4))
        buf = torch.full((2, 4, 2, 3, 64), -1, dtype=torch.int64)
        got = sel.select_layers(q, rows, host_k, 64, 0.125, idx, slice(0, 4), out=(buf[0], buf[1]))
        assert got[0].data_ptr() == buf[0].data_ptr() and got[1].data_ptr() == buf[1].data_ptr()
        assert torch.equal(buf[0], want[0]) and torch.equal(buf[1], want[1])
    slots, ok = rows.tokens
    args = (q.float(), slots, ok, idx.q8[0:4], idx.scale[0:4], host_k, 64, 128, 0.125)
    good = torch.empty(4, 2, 3, 64, dtype=torch.int64)
    for bad in (torch.empty(4, 2, 3, 63, dtype=torch.int64), torch.empty(4, 2, 3, 64, dtype=torch.int32),
                torch.empty(4, 2, 3, 128, dtype=torch.int64)[..., ::2]):  # fmt: skip
        with pytest.raises(ValueError, match="out must be contiguous int64"):
            native.spec_host_select(*args, out=(good, bad))


@pytest.mark.parametrize("first_level", [None, 512])
def test_bound_selection_chooses_the_pytorch_sets_layer_after_layer(first_level, march):
    """``SpecHostSelector.bind`` (the chooser's per-step form: candidates, outputs and per-layer
    addresses prepared once, :class:`native.LayerSelection`): layer after layer, each call's sets
    are PyTorch's for that layer (the full scan) or the unbound C call's (with a first level, which
    PyTorch has not), though the bound outputs are reused; bad queries are refused by name."""
    lens = (1472, 2304, 896)  # the candidates (all but the last 128) fill whole 64-slot pages
    host_k, idx, rows, q = _case(list(lens), 64, torch.bfloat16, seed=41, layers=4, n_keep=5)
    if first_level is not None:  # the block means of every candidate's block
        idx = QuantKeyIndex(host_k, native=True, block_means=True)
        table, _ = rows.tokens
        for r, n in enumerate(lens):
            idx.update(table[r][: n - 128], 0, n - 128)
    k, scale = 96, 0.125
    sel = make_selector("spec_host", 2.0, native=True, first_level_tokens=first_level)
    ref = make_selector("spec_host", 2.0) if first_level is None else sel
    bound = sel.bind(rows, host_k, k, idx, q.shape[2])
    assert isinstance(bound, native.LayerSelection)
    for layer in (2, 0, 3, 1):
        want_pos, want_slots = ref.select(q[layer], rows, host_k[layer], k, scale, idx, layer)
        got_pos, got_slots = bound(q[layer].float().contiguous(), layer, scale)
        assert got_pos.shape == (3, 3, k)
        assert all(_same_sets(got_pos, want_pos)) and all(_same_sets(got_slots, want_slots))
    for bad in (q[0].bfloat16(), q[0, :2].float(), q[0].float().transpose(0, 1).contiguous().transpose(0, 1)):
        with pytest.raises(ValueError, match="q must be float32 contiguous"):
            bound(bad, 0, scale)
    assert make_selector("spec_host", 2.0).bind(rows, host_k, k, idx, q.shape[2]) is None  # PyTorch: select()
    assert sel.bind(rows, host_k, 1200, idx, q.shape[2]) is None  # rerank x k covers a row: the exact path


def test_next_sets_are_written_in_place_only_for_every_row_in_order():
    """``NextSets.direct``: views of the buffer for every row in order at full width (marked
    filled), None for a subset, another order or a narrower selection."""
    from dd_sglang.prefetch.plan import NextSets

    nxt = NextSets(("a", "b", "c"), k=8, layers=4)
    assert nxt.direct(1, 3, torch.tensor([0, 2]), 8, 3) is None
    assert nxt.direct(1, 3, torch.tensor([1, 0, 2]), 8, 3) is None
    assert nxt.direct(1, 3, torch.arange(3), 6, 3) is None
    assert not nxt.filled
    pos, slots = nxt.direct(1, 3, torch.arange(3), 8, 3)
    assert pos.shape == slots.shape == (2, 3, 3, 8) and pos.is_contiguous()
    pos.fill_(7)
    assert nxt.filled == {1, 2} and (nxt.pos[1:3] == 7).all() and (nxt.pos[0] == 0).all()
    with pytest.raises(ValueError, match="outside"):
        nxt.direct(3, 5, torch.arange(3), 8, 3)


def test_rerank_covering_every_candidate_uses_the_exact_path():
    """With ``rerank x k`` at least the candidates the native selector defers to exact scoring,
    as the PyTorch one does."""
    host_k, idx, rows, q = _case([700], 64, torch.bfloat16, seed=5, layers=1)
    wide = make_selector("spec_host", 100.0, native=True).select(q[0], rows, host_k[0], 32, 0.125, idx, 0)[0]
    exact = make_selector("spec_host_exact").select(q[0], rows, host_k[0], 32, 0.125)[0]
    assert all(_same_sets(wide, exact))


def test_bad_shapes_are_refused_with_the_field():
    host_k, idx, rows, q = _case([900], 64, torch.bfloat16, seed=6, layers=1)
    slots, ok = rows.tokens
    with pytest.raises(ValueError, match="k <= m"):
        native.spec_host_select(q, slots, ok, idx.q8, idx.scale, host_k, 64, 32, 0.125)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        native.spec_host_select(q, slots, ok, idx.q8, idx.scale, host_k.half(), 32, 64, 0.125)
    with pytest.raises(ValueError, match="does not match"):
        native.spec_host_select(q[:, :, :, :32], slots, ok, idx.q8, idx.scale, host_k, 32, 64, 0.125)


def test_kernel_setting_decides_and_native_fails_loudly(monkeypatch):
    assert use_native_kernel("torch") is False
    assert use_native_kernel("auto") is True and use_native_kernel("native") is True
    monkeypatch.setattr(native, "available", lambda: False)
    assert use_native_kernel("auto") is False
    with pytest.raises(RuntimeError, match="experimental.kernel: native"):
        use_native_kernel("native")


def test_build_without_a_compiler_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "no-such-compiler-dd")
    with pytest.raises(native.NativeUnavailable, match="no C compiler"):
        native.build(tmp_path)


@pytest.mark.parametrize("rows", [slice(0, 3), torch.tensor([2, 0])])
def test_ring_gather_copies_the_same_bytes_as_pytorch(rows, march):
    """The CPU ring copy through the C kernel writes exactly what PyTorch's index_select path does,
    for the fixed rows (a slice) and for a few rows (repairs), and nothing else of the slot."""
    from dd_sglang.prefetch.gather import RingGather, flat_rows

    g = torch.Generator().manual_seed(7)
    hk, hv = torch.randn(2, 512, 3, 64, generator=g).bfloat16(), torch.randn(2, 512, 3, 64, generator=g).bfloat16()
    n = 3 if isinstance(rows, slice) else 2
    slots = torch.randint(0, 512, (n, 3, 40), generator=g)
    out = []
    for use_native in (True, False):
        gather = RingGather(hk, hv, "cpu", "cpu", native=use_native)
        assert gather.native is use_native
        kd, vd = torch.full((4, 3, 60, 64), -1.0).bfloat16(), torch.full((4, 3, 60, 64), -1.0).bfloat16()
        moved = gather.copy(1, flat_rows(slots), kd, vd, rows, 7, 40)
        assert moved == 2 * n * 3 * 40 * 64 * 2
        out.append((kd, vd))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
    r = torch.arange(4)[rows]
    assert torch.equal(out[0][0][r[0], 1, 7 + 5], hk[1, slots[0, 1, 5], 1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ring_gather_copies_sets_to_the_rows_plain_pytorch_names(dtype, march):
    """``RingGather.copy_sets`` (sets chosen at attention time, row indices built in C): every K and V
    row lands where a plain loop over (set, KV head, column) puts ``host[slot, head]``, for plan rows
    out of order, at a column offset; nothing else of the slot changes; the PyTorch path (no C
    kernel) writes the same bytes; a slot of another dtype or too narrow is refused by name."""
    from dd_sglang.prefetch.gather import RingGather

    g = torch.Generator().manual_seed(9)
    hk, hv = (torch.randn(2, 700, 3, 64, generator=g).to(dtype) for _ in range(2))
    slots = torch.randint(0, 700, (2, 3, 50), generator=g)
    rows = torch.tensor([3, 1])
    want_k, want_v = torch.full((4, 3, 64, 64), -1.0).to(dtype), torch.full((4, 3, 64, 64), -1.0).to(dtype)
    for i, r in enumerate(rows.tolist()):
        for h in range(3):
            for c in range(50):
                want_k[r, h, 9 + c] = hk[1, slots[i, h, c], h]
                want_v[r, h, 9 + c] = hv[1, slots[i, h, c], h]
    for use_native in (True, False):
        gather = RingGather(hk, hv, "cpu", "cpu", native=use_native)
        kd, vd = torch.full_like(want_k, -1.0), torch.full_like(want_v, -1.0)
        assert gather.copy_sets(1, slots, kd, vd, rows, 9) == 2 * 2 * 3 * 50 * 64 * hk.element_size()
        assert torch.equal(kd, want_k) and torch.equal(vd, want_v)
    kd = torch.zeros(4, 3, 64, 64, dtype=dtype)
    with pytest.raises(ValueError, match="dtypes differ"):
        native.gather_sets(hk[1], hv[1], kd.half(), kd.half(), slots, rows, 9)
    with pytest.raises(ValueError, match="do not fit"):
        native.gather_sets(hk[1], hv[1], kd, kd.clone(), slots, rows, 20)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_hit_rate_measurement_counts_like_pytorch(dtype, march):
    """The sampled hit-rate measurement: hits, mass on the prefetched set and on the exact top-k,
    per row (summed over KV heads), equal to the PyTorch version's; rows with different top_k."""

    from dd_sglang.prefetch.hit_rate import hit_counts_torch

    host_k, idx, rows, q = _case([1500, 2100], 64, dtype, seed=11, layers=1)
    k, scale = 96, 0.125
    q_real = q[0] + 0.3 * torch.randn_like(q[0])  # the prefetch came from a different query
    have, _ = make_selector("spec_host", 2.0).select(q[0], rows, host_k[0], k, scale, idx, 0)
    top_k = torch.tensor([96, 64])
    want = hit_counts_torch(make_selector("oracle"), k, rows, host_k[0], q_real, top_k.view(-1, 1, 1), have, scale)
    slots, ok = rows.tokens
    hits, mh, mt = native.measure_hits(q_real, slots, ok, host_k[0], have, top_k, scale)
    assert torch.equal(hits.sum(1), want[0])
    assert 0 < int(hits.sum()) < 3 * (96 + 64)  # neither trivial nor perfect
    torch.testing.assert_close(mh.sum(1), want[1].float(), rtol=2e-4, atol=1e-5)
    torch.testing.assert_close(mt.sum(1), want[2].float(), rtol=2e-4, atol=1e-5)


@pytest.mark.parametrize("resident,in_place", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize(
    ("dtype", "rows", "positions", "columns", "d", "hq", "hkv"),
    [(torch.bfloat16, 1, 2, 390, 64, 9, 3), (torch.bfloat16, 8, 2, 140, 64, 9, 3), (torch.float32, 3, 3, 37, 16, 9, 3),
     (torch.float32, 2, 1, 100, 128, 32, 8), (torch.float32, 2, 2, 21, 64, 9, 3)],  # fmt: skip
)
def test_fused_sparse_attention_equals_fold_sdpa_scatter(dtype, rows, positions, columns, d, hq, hkv, resident,
                                                         in_place, march):  # fmt: skip
    """``sparse_attend`` (the CPU fast path's one call a layer) against the PyTorch path it replaces:
    the queries folded from a strided view of the fused QKV projection, SDPA with the step's mask,
    the outputs scattered to their tokens. Positions without an output token are not written;
    per-position masks differ (a column only the speculated query reads); the 16-column SIMD
    blocks and the scalar tail (21 columns) both run. ``resident``: the first columns come from
    the device pool by slot (the ring slot's copies of them are garbage, never read). ``in_place``:
    the next columns come from a host tier by slot where the slot is >= 0 (the critical set read
    in place; the ring holds garbage there), from the ring where it is -1."""
    from dd_sglang.kernels.sparse_decode import fold_gqa, sparse_decode_attention, unfold_gqa

    g = torch.Generator().manual_seed(rows * 100 + columns)
    tokens = rows * positions + 2
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=g).to(dtype)
    q3 = qkv[:, : hq * d].view(tokens, hq, d)  # token stride (hq + 2 hkv) d: not contiguous
    q_tok = torch.randint(0, tokens, (rows, positions), generator=g)
    keys = torch.randn(rows + 1, hkv, columns + 9, d, generator=g).to(dtype)
    values = torch.randn(rows + 1, hkv, columns + 9, d, generator=g).to(dtype)
    mask = torch.rand(rows, positions, columns, generator=g) > 0.3
    mask[:, :, 0] = True
    out_tok = torch.randperm(tokens, generator=g)[: rows * positions].view(rows, positions).clone()
    skipped = int(out_tok[0, -1])
    if positions > 1:
        out_tok[0, -1] = -1  # nothing rides there: its token's output stays untouched
    out = torch.full((tokens, hq, d), 7.0, dtype=dtype)
    res = None
    if resident:
        n_res = columns // 3
        pool_k = torch.randn(50, hkv, d, generator=g).to(dtype)
        pool_v = torch.randn(50, hkv, d, generator=g).to(dtype)
        slots = torch.randint(0, 50, (rows, n_res), generator=g)
        res = (pool_k, pool_v, slots)
        keys, values = keys.clone(), values.clone()
        want_k, want_v = keys.clone(), values.clone()
        want_k[:rows, :, :n_res] = pool_k[slots].transpose(1, 2)
        want_v[:rows, :, :n_res] = pool_v[slots].transpose(1, 2)
        keys[:, :, :n_res] = float("nan")  # never read
        values[:, :, :n_res] = float("nan")
    crit = None
    if in_place:
        c_lo, n_crit = columns // 3, columns - columns // 3 - 1  # the last column stays in the ring
        host_k = torch.randn(70, hkv, d, generator=g).to(dtype)
        host_v = torch.randn(70, hkv, d, generator=g).to(dtype)
        cslots = torch.randint(0, 70, (rows, hkv, n_crit), generator=g)
        cslots[:, :, ::5] = -1  # these columns are read from the ring
        crit = (host_k, host_v, cslots, c_lo)
        for r in range(rows):
            for h in range(hkv):
                for j in range(n_crit):
                    if cslots[r, h, j] >= 0:
                        want_k[r, h, c_lo + j] = host_k[cslots[r, h, j], h]
                        want_v[r, h, c_lo + j] = host_v[cslots[r, h, j], h]
                        keys[r, h, c_lo + j] = float("nan")
                        values[r, h, c_lo + j] = float("nan")
    native.sparse_attend(q3, q_tok, keys, values, mask, out, out_tok, 0.125, res, crit)
    if resident:
        keys, values = want_k, want_v
    group = hq // hkv
    o = sparse_decode_attention(fold_gqa(q3[q_tok].float(), hkv), keys[:rows, :, :columns].float(),
                                values[:rows, :, :columns].float(),
                                mask.repeat_interleave(group, dim=1).unsqueeze(1), 0.125)  # fmt: skip
    o = unfold_gqa(o, positions)  # [rows, positions, hq, d]
    want = torch.full((tokens, hq, d), 7.0)
    for r in range(rows):
        for p in range(positions):
            if out_tok[r, p] >= 0:
                want[out_tok[r, p]] = o[r, p]
    tol = 8e-3 if dtype == torch.bfloat16 else 1e-5  # bfloat16: one rounding of the output
    torch.testing.assert_close(out.float(), want, rtol=tol, atol=tol)
    if positions > 1:
        assert (out[skipped] == 7.0).all()


def test_fused_sparse_attention_refuses_what_it_does_not_take():
    q = torch.randn(4, 9, 64)
    keys = torch.randn(2, 3, 10, 64)
    tok = torch.zeros(1, 2, dtype=torch.int64)
    mask = torch.ones(1, 2, 10, dtype=torch.bool)
    with pytest.raises(ValueError, match="dtypes"):
        native.sparse_attend(q.half(), tok, keys, keys, mask, torch.empty(4, 9, 64).half(), tok, 0.1)
    with pytest.raises(ValueError, match="layouts"):
        native.sparse_attend(q.transpose(1, 2), tok, keys, keys, mask, torch.empty(4, 9, 64), tok, 0.1)
    with pytest.raises(ValueError, match="mask"):
        native.sparse_attend(q, tok, keys, keys, torch.ones(1, 2, 11, dtype=torch.bool), torch.empty(4, 9, 64), tok, 0.1)


def test_int8_index_update_in_chunks_equals_per_layer_quantisation(monkeypatch):
    """``QuantKeyIndex.update`` quantises every layer at once in chunks of positions: the same int8
    keys and scales as quantising each layer's keys on its own (absmax / 127, round half to even)."""
    from dd_sglang.prefetch import index as index_mod

    g = torch.Generator().manual_seed(5)
    host_k = torch.randn(3, 300, 3, 64, generator=g).bfloat16()
    slots = torch.randperm(300, generator=g)
    monkeypatch.setattr(index_mod, "UPDATE_CHUNK_BYTES", 3 * 3 * 64 * 4 * 7)  # 7 positions a chunk
    idx = QuantKeyIndex(host_k)
    idx.update(slots, 10, 250)
    for layer in range(3):
        keys = host_k[layer, slots[10:250]].float()
        s = keys.abs().amax(dim=-1).clamp(min=1e-12) / 127.0
        assert torch.equal(idx.q8[layer, slots[10:250]], (keys / s.unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8))
        assert torch.equal(idx.scale[layer, slots[10:250]], s)
    assert not idx.q8[:, slots[:10]].any() and not idx.q8[:, slots[250:]].any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_index_update_writes_the_pytorch_bytes(dtype, march):
    """``QuantKeyIndex(native=True).update`` (``dd_quantize_keys``, one pass) writes the same int8
    keys and scales as the PyTorch path, byte for byte, at the given slots only: keys of every
    magnitude, rows of zeros (the 1e-12 floor), values landing on .5 steps (round half to even)."""
    g = torch.Generator().manual_seed(6)
    host_k = (torch.randn(4, 500, 3, 64, generator=g) * torch.logspace(-3, 3, 500)[None, :, None, None]).to(dtype)
    host_k[:, 7] = 0
    host_k[1, 9, 0, :] = torch.tensor([127.0, 63.5, -0.5, 1.5] * 16, dtype=dtype)  # absmax 127: k / s = k
    slots = torch.randperm(500, generator=g)
    want, got = QuantKeyIndex(host_k), QuantKeyIndex(host_k, native=True)
    assert got.native and not want.native
    for a, b in ((0, 3), (3, 480)):
        want.update(slots, a, b)
        got.update(slots, a, b)
    assert torch.equal(got.q8, want.q8) and torch.equal(got.scale, want.scale)
    assert not got.q8[:, slots[480:]].any()
    assert got.q8[1, 9, 0, :4].tolist() == [127, 64, 0, 2]


def test_native_index_update_refusals():
    """Wrong dtypes, shapes or layouts are refused before the kernel runs; a non-contiguous host tier
    falls back to the PyTorch path."""
    k = torch.zeros(2, 8, 3, 64, dtype=torch.bfloat16)
    q8, sc = torch.zeros(2, 8, 3, 64, dtype=torch.int8), torch.zeros(2, 8, 3)
    slots = torch.arange(4)
    for bad, match in (((k.half(), slots, q8, sc), "keys must be"), ((k, slots, q8.float(), sc), "q8 must be"),
                       ((k, slots, q8, sc[..., :2]), "scale must be"),
                       ((k.transpose(1, 2).contiguous().transpose(1, 2), slots, q8, sc), "keys must be a contiguous")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            native.quantize_keys(*bad)
    assert not QuantKeyIndex(k.transpose(0, 1).contiguous().transpose(0, 1), native=True).native


def test_the_c_copies_are_never_chosen_for_a_cuda_ring():
    """``experimental.gather: cpu`` on a CUDA ring gathers on the host and copies to the device: the C row
    copies write through host pointers, so they stay off (no GPU needed to build the gather)."""
    from dd_sglang.prefetch.gather import RingGather

    hk = torch.zeros(1, 4, 3, 64)
    assert RingGather(hk, hk, "cpu", "cpu").native
    assert not RingGather(hk, hk, torch.device("cuda"), "cpu").native


def test_select_kernel_bench_writes_both_layouts(tmp_path):
    """``bench.select_kernel`` at a tiny size: both layouts timed every round, the ratio per round."""
    import json

    from bench.select_kernel import main

    if not native.available():
        pytest.skip(f"the C kernel is not built here: {native.unavailable_reason()}")
    assert main(["--cells", "600x2", "--rounds", "2", "--calls", "3", "--k", "32", "--chunk", "1",
                 "--out", str(tmp_path / "s.json")]) == 0  # fmt: skip
    out = json.loads((tmp_path / "s.json").read_text())
    (cell,) = out["cells"]
    assert (cell["tokens"], cell["rows"], out["settings"]["m"], out["settings"]["chunk"]) == (600, 2, 64, 1)
    for name in ("huge_pages", "base_pages"):
        assert len(cell["rounds_ms"][name]) == 2 and all(x > 0 for x in cell["rounds_ms"][name])
    lo, hi = cell["base_over_huge_range"]
    assert 0 < lo <= cell["base_over_huge"] <= hi


@pytest.mark.parametrize("argv, needle", [(["--cells", "600"], "--cells"), (["--cells", "0x2"], "--cells"),
                                          (["--k", "0"], "--k and --rerank"), (["--chunk", "7"], "--chunk")])  # fmt: skip
def test_select_kernel_bench_rejects_bad_arguments(argv, needle, capsys):
    from bench.select_kernel import main

    if not native.available():
        pytest.skip(f"the C kernel is not built here: {native.unavailable_reason()}")
    with pytest.raises(SystemExit) as exc:
        main(argv + ["--out", "/nonexistent/never-written.json"])
    assert exc.value.code == 2 and needle in capsys.readouterr().err
