"""FlashInfer page lists of a sparse step, built by pure tensor code, against hand-computed lists;
the mapping they encode, emulated on the CPU request by request, against the PyTorch reference;
the dispatcher's choice on a machine without CUDA. The FlashInfer kernel itself: see the CUDA tests
at the end (skipped without CUDA)."""

from __future__ import annotations

import logging

import pytest
import torch

from dd_sglang.kernels.dispatch import SparseAttention
from dd_sglang.kernels.flashinfer_decode import FlashInferSparseDecode, paged_kv_indices
from dd_sglang.kernels.sparse_decode import fold_gqa, sparse_decode_attention, unfold_gqa

# Two rows, two query positions, four columns, two KV heads, ring column capacity five.
MASK = torch.tensor(
    [
        [[1, 1, 0, 0], [1, 1, 0, 1]],  # row 0: real query reads columns 0, 1; speculated also 3
        [[1, 0, 1, 0], [0, 0, 0, 0]],  # row 1: real query reads 0, 2; an empty request
    ],
    dtype=torch.bool,
)
# Request b = (r * 2 + h) * 2 + s; page (r, h, c) = (r * 2 + h) * 5 + c.
WANT_INDPTR = [0, 2, 5, 7, 10, 12, 12, 14, 14]
WANT_INDICES = [0, 1, 0, 1, 3, 5, 6, 5, 6, 8, 10, 12, 15, 17]
WANT_LAST = [1, 1, 1, 1, 1, 0, 1, 0]


def test_page_lists_equal_hand_computed_ones():
    indptr, indices, last = paged_kv_indices(MASK, num_kv_heads=2, columns=5)
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32
    assert indptr.tolist() == WANT_INDPTR
    assert indices[: indptr[-1]].tolist() == WANT_INDICES
    assert last.tolist() == WANT_LAST


def test_buffers_are_filled_in_place_and_a_smaller_step_reuses_them():
    indptr_buf = torch.full((40,), -7, dtype=torch.int32)
    indices_buf = torch.full((200,), -7, dtype=torch.int32)
    last_buf = torch.full((40,), -7, dtype=torch.int32)
    ptrs = (indptr_buf.data_ptr(), indices_buf.data_ptr(), last_buf.data_ptr())
    big = torch.ones(3, 2, 6, dtype=torch.bool)  # a larger step first
    paged_kv_indices(big, 3, 8, indptr=indptr_buf, indices=indices_buf, last_page_len=last_buf)
    indptr, indices, last = paged_kv_indices(
        MASK, 2, 5, indptr=indptr_buf, indices=indices_buf, last_page_len=last_buf
    )
    assert (indptr.data_ptr(), indices.data_ptr(), last.data_ptr()) == ptrs
    assert indptr.tolist() == WANT_INDPTR
    assert indices[:14].tolist() == WANT_INDICES
    assert last.tolist() == WANT_LAST


def test_single_head_single_position_lists_are_the_columns_themselves():
    m = torch.tensor([[[0, 1, 1, 0, 1]]], dtype=torch.bool)
    indptr, indices, last = paged_kv_indices(m, 1, 5)
    assert indptr.tolist() == [0, 3] and indices[:3].tolist() == [1, 2, 4] and last.tolist() == [1]


def test_three_positions_two_speculated_each_with_its_own_column():
    # The real query reads column 0; speculated position 1 also its column 2, position 2 its column 3.
    m = torch.tensor([[[1, 0, 0, 0], [1, 0, 1, 0], [1, 0, 0, 1]]], dtype=torch.bool)
    indptr, indices, last = paged_kv_indices(m, 2, 6)  # request b = h * 3 + s; page h * 6 + c
    assert indptr.tolist() == [0, 1, 3, 5, 6, 8, 10]
    assert indices[:10].tolist() == [0, 0, 2, 0, 3, 6, 6, 8, 6, 9]
    assert last.tolist() == [1] * 6


def test_bad_inputs_are_refused_with_the_field_named():
    with pytest.raises(ValueError, match="bool"):
        paged_kv_indices(MASK.int(), 2, 5)
    with pytest.raises(ValueError, match="num_kv_heads"):
        paged_kv_indices(MASK, 0, 5)
    with pytest.raises(ValueError, match="columns"):
        paged_kv_indices(MASK, 2, 3)
    with pytest.raises(ValueError, match="indices buffer"):
        paged_kv_indices(MASK, 2, 5, indices=torch.zeros(10, dtype=torch.int32))
    with pytest.raises(ValueError, match="indptr buffer"):
        paged_kv_indices(MASK, 2, 5, indptr=torch.zeros(20, dtype=torch.int64))


def _step(r, hkv, g, n, cap, d, seed=0, dtype=torch.float32):
    """Random step: a ring slot with column capacity ``cap`` (views [:, :, :n]), a plan-shaped mask
    (resident prefix, per-row critical length, the speculated column for some rows)."""
    gen = torch.Generator().manual_seed(seed)
    slot_k = torch.randn(r + 1, hkv, cap, d, generator=gen).to(dtype)  # a spare row: a larger ring's slot
    slot_v = torch.randn(r + 1, hkv, cap, d, generator=gen).to(dtype)
    keys, values = slot_k[:r, :, :n], slot_v[:r, :, :n]
    mask = torch.zeros(r, 2, n, dtype=torch.bool)
    for i in range(r):
        k = int(torch.randint(1, n - 1, (1,), generator=gen))
        mask[i, :, :k] = True
        if i % 2 == 0:
            mask[i, 1, n - 1] = True
    q = fold_gqa(torch.randn(r, 2, hkv * g, d, generator=gen), hkv).to(dtype)
    return q, keys, values, mask


def _emulate(q, keys, values, mask, scale, cap):
    """FlashInfer's contract, request by request: request b's G query heads over pages
    indices[indptr[b]:indptr[b+1]] of the ring slot viewed as one-token pages."""
    r, hkv, nq, d = q.shape
    indptr, indices, _ = paged_kv_indices(mask, hkv, cap)
    n = keys.shape[2]
    kp = torch.zeros(r, hkv, cap, d, dtype=torch.float64)  # page p = (r * hkv + h) * cap + c -> [D]
    vp = torch.zeros_like(kp)
    kp[:, :, :n], vp[:, :, :n] = keys, values
    kp, vp = kp.view(-1, d), vp.view(-1, d)
    qb = q.reshape(r * hkv * 2, nq // 2, d)
    out = torch.zeros_like(qb, dtype=torch.float64)
    for b in range(qb.shape[0]):
        pages = indices[indptr[b] : indptr[b + 1]].long()
        w = torch.softmax(qb[b].double() @ kp[pages].double().T * scale, dim=-1)
        out[b] = w @ vp[pages].double()
    return out.view(r, hkv, nq, d)


@pytest.mark.parametrize("g", [1, 3, 4])
def test_page_mapping_emulated_on_cpu_equals_the_reference(g):
    r, hkv, n, cap, d = 3, 2, 11, 16, 8
    q, keys, values, mask = _step(r, hkv, g, n, cap, d)
    scale = d**-0.5
    got = _emulate(q, keys, values, mask, scale, cap)
    m4 = mask.repeat_interleave(g, dim=1).unsqueeze(1)
    want = sparse_decode_attention(q, keys, values, m4, scale)
    torch.testing.assert_close(got, want.double(), atol=1e-5, rtol=1e-5)


def test_dispatch_chooses_the_reference_without_cuda_and_logs_once(caplog, monkeypatch):
    monkeypatch.delenv("DD_SPARSE_ATTENTION", raising=False)
    with caplog.at_level(logging.INFO, logger="dd_sglang.kernels.dispatch"):
        att = SparseAttention("cpu")
        r, hkv, g, n, cap, d = 3, 2, 3, 11, 16, 8
        q, keys, values, mask = _step(r, hkv, g, n, cap, d, seed=1)
        for _ in range(2):  # two steps, three layers each
            att.plan(mask, hkv, None, cap, keys.dtype, "cpu")
            for _ in range(3):
                out = att.run(q, keys, values, d**-0.5)
    assert att.kind == "torch" and "not CUDA" in att.reason
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "dd_sglang.kernels.dispatch"]
    assert lines == ["dd_sglang sparse decode attention: torch (device cpu is not CUDA)"]
    # The reference's result, column sets computed independently per row and head.
    want = _emulate(q, keys, values, mask, d**-0.5, cap)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    assert unfold_gqa(out, 2).shape == (r, 2, hkv * g, d)


def test_dispatch_refuses_bad_choices_with_the_field_named(monkeypatch):
    with pytest.raises(ValueError, match="DD_SPARSE_ATTENTION"):
        SparseAttention("cpu", impl="triton")
    monkeypatch.setenv("DD_SPARSE_ATTENTION", "bogus")
    with pytest.raises(ValueError, match="'bogus'"):
        SparseAttention("cpu")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        SparseAttention("cpu", impl="flashinfer")
    att = SparseAttention("cpu", impl="torch")
    with pytest.raises(RuntimeError, match="before plan"):
        att.run(torch.zeros(1, 1, 2, 8), torch.zeros(1, 1, 3, 8), torch.zeros(1, 1, 3, 8), 1.0)
    with pytest.raises(ValueError, match="columns must be"):
        att.plan(MASK, 2, 1, 3, torch.float32, "cpu")


class EmulatedWrapper:
    """``BatchDecodeWithPagedKVCacheWrapper``'s documented contract on the CPU, request by request
    (float64): checks the arguments it is given and computes what the kernel would."""

    def __init__(self, workspace, tensor_cores):
        self.tensor_cores, self.plans, self.runs = tensor_cores, [], 0

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
             q_data_type, kv_data_type):  # fmt: skip
        assert indptr.dtype == indices.dtype == last_page_len.dtype == torch.int32
        assert indptr.numel() == last_page_len.numel() + 1 and (num_kv_heads, page_size) == (1, 1)
        self.plans.append((indptr.clone(), indices.clone(), last_page_len.clone(), num_qo_heads, head_dim))
        self.dtypes = (q_data_type, kv_data_type)

    def run(self, q, paged_kv_cache, out=None, q_scale=None):
        indptr, indices, last, g, d = self.plans[-1]
        k, v = paged_kv_cache
        assert k.shape[1:] == (1, 1, d) and k.stride()[-1] == 1 and q.shape == (last.numel(), g, d)
        assert out is not None and out.shape == q.shape and (q.dtype, k.dtype) == self.dtypes
        sm = d**-0.5 * (1.0 if q_scale is None else q_scale)
        for b in range(q.shape[0]):
            pages = indices[indptr[b] : indptr[b + 1]].long()
            assert pages.numel() == 0 or last[b] == 1  # page_size 1: the last page holds one token
            w = torch.softmax(q[b].double() @ k[pages, 0, 0].double().T * sm, dim=-1)
            out[b] = (w @ v[pages, 0, 0].double()).to(out.dtype)
        self.runs += 1
        return out


@pytest.mark.parametrize("g,tell_shape", [(1, True), (3, False), (4, True), (8, False)])
def test_flashinfer_glue_against_an_emulated_kernel_equals_the_reference(g, tell_shape):
    wrappers = []

    def factory(workspace, tc):
        wrappers.append(EmulatedWrapper(workspace, tc))
        return wrappers[-1]

    fi = FlashInferSparseDecode("cpu", workspace_bytes=16, wrapper_factory=factory)
    r, hkv, n, cap, d = 3, 2, 11, 16, 64
    q, keys, values, mask = _step(r, hkv, g, n, cap, d, seed=g, dtype=torch.bfloat16)
    scale = 0.5 * d**-0.5
    want = _emulate(q, keys, values, mask, scale, cap)
    for _ in range(2):  # two steps, two layers each
        fi.plan(mask, hkv, cap, torch.bfloat16, g if tell_shape else None, d if tell_shape else None)
        for _ in range(2):
            got = fi.run(q, keys, values, scale)
            torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)
    assert [w.tensor_cores for w in wrappers] == [g >= 4]  # one wrapper, built once
    assert wrappers[0].runs == 4 and len(wrappers[0].plans) == 2  # FlashInfer planned once per step
    assert fi.group == g and fi.head_dim == d
    indptr, indices, last, _, _ = wrappers[0].plans[-1]
    want_ptr, want_idx, want_last = paged_kv_indices(mask, hkv, cap)
    assert torch.equal(indptr, want_ptr) and torch.equal(last, want_last)
    assert torch.equal(indices[: indptr[-1]], want_idx[: want_ptr[-1]])
    # Keys that are not a view of a slot with the planned column stride are refused.
    with pytest.raises(ValueError, match="ring slot view"):
        fi.run(q, keys.contiguous(), values.contiguous(), scale)


# ---------------------------------------------------------------------------- CUDA (skipped here)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")


def _flashinfer():
    pytest.importorskip("flashinfer", reason="flashinfer not installed")
    return SparseAttention("cuda", impl="flashinfer")


@cuda
@pytest.mark.parametrize("g,d", [(1, 64), (3, 64), (4, 128), (8, 128)])
@pytest.mark.parametrize("tell_shape", [True, False])
def test_flashinfer_equals_the_reference_on_ring_slot_views(g, d, tell_shape):
    att = _flashinfer()
    assert att.kind == "flashinfer"
    r, hkv, n, cap = 5, 4, 300, 320
    q, keys, values, mask = _step(r, hkv, g, n, cap, d, seed=g)
    q, keys, values = (t.to("cuda", torch.bfloat16) for t in (q, keys, values))
    keys_slot = torch.zeros(r + 1, hkv, cap, d, dtype=torch.bfloat16, device="cuda")
    values_slot = torch.zeros_like(keys_slot)
    keys_slot[:r, :, :n] = keys
    values_slot[:r, :, :n] = values
    kv = keys_slot[:r, :, :n], values_slot[:r, :, :n]
    mask = mask.cuda()
    scale = 0.7 * d**-0.5  # not the default scale: goes through q_scale
    m4 = mask.repeat_interleave(g, dim=1).unsqueeze(1)
    want = sparse_decode_attention(q.float(), kv[0].float(), kv[1].float(), m4, scale)
    for _step_i in range(2):  # the second step plans FlashInfer in plan() (shape learned)
        att.plan(mask, hkv, g if tell_shape else None, cap, torch.bfloat16, "cuda", d if tell_shape else None)
        for _layer in range(2):
            got = att.run(q, *kv, scale)
            torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
