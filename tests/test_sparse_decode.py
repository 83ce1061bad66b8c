"""The batched sparse-decode kernel against attention computed independently, row by row and head by head."""

from __future__ import annotations

import pytest
import torch

from dd_sglang.kernels.sparse_decode import (
    dense_decode_attention,
    fold_gqa,
    sparse_decode_attention,
    unfold_gqa,
)

HQ, HKV, D = 9, 3, 64  # SmolLM2's head layout
G = HQ // HKV


def _reference(q, keys, values, cols, scale):
    """Per (row, query position, query head): softmax over the listed columns of its KV head, in float64."""
    r, s = q.shape[:2]
    out = torch.zeros(r, s, HQ, D, dtype=torch.float64)
    for i in range(r):
        for j in range(s):
            for h in range(HQ):
                kv = h // G
                c = cols[i][j]
                k = keys[i, kv, c].double()
                w = torch.softmax(k @ q[i, j, h].double() * scale, dim=0)
                out[i, j, h] = w @ values[i, kv, c].double()
    return out


def test_fold_and_unfold_gqa_are_inverse_and_group_query_heads_by_kv_head():
    q = torch.arange(2 * 2 * HQ * 1, dtype=torch.float32).view(2, 2, HQ, 1)
    f = fold_gqa(q, HKV)
    assert f.shape == (2, HKV, 2 * G, 1)
    # KV head 1 of row 0 reads query heads 3..5 of the real position, then of the speculated one.
    assert f[0, 1, :, 0].tolist() == q[0, 0, 3:6, 0].tolist() + q[0, 1, 3:6, 0].tolist()
    assert torch.equal(unfold_gqa(f, 2), q)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_rows_equal_a_per_head_softmax_over_their_columns(dtype):
    g = torch.Generator().manual_seed(0)
    r, n = 3, 50
    q = torch.randn(r, 2, HQ, D, generator=g)
    keys = torch.randn(r, HKV, n, D, generator=g)
    values = torch.randn(r, HKV, n, D, generator=g)
    mask = torch.zeros(r, 2, n, dtype=torch.bool)
    lens = [50, 17, 33]
    cols = []
    for i, m in enumerate(lens):
        mask[i, :, : m - 1] = True  # the real query: the first m-1 columns
        mask[i, 1, n - 1] = True  # the speculated query also reads the last column (its own K/V)
        cols.append([list(range(m - 1)), list(range(m - 1)) + [n - 1]])
    keys[1, :, 40:49] = 1e4  # masked padding (finite, as the zero-filled ring guarantees) is never read
    values[1, :, 40:49] = 1e4
    m4 = mask.repeat_interleave(G, dim=1).unsqueeze(1)
    out = sparse_decode_attention(fold_gqa(q.to(dtype), HKV), keys.to(dtype), values.to(dtype), m4, D**-0.5)
    out = unfold_gqa(out, 2)
    assert out.dtype == dtype and not out.isnan().any()
    ref = _reference(q.to(dtype).float(), keys.to(dtype).float(), values.to(dtype).float(), cols, D**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def test_bad_shapes_are_refused_with_the_shapes_named():
    q = torch.zeros(2, HKV, 6, D)
    k = torch.zeros(2, HKV, 10, D)
    with pytest.raises(ValueError, match="4-D"):
        sparse_decode_attention(q[0], k, k, None, 1.0)
    with pytest.raises(ValueError, match="do not match"):
        sparse_decode_attention(q, k[:1], k[:1], None, 1.0)
    with pytest.raises(ValueError, match="mask must be"):
        sparse_decode_attention(q, k, k, torch.ones(2, 1, 6, 9, dtype=torch.bool), 1.0)
    with pytest.raises(ValueError, match="multiple"):
        fold_gqa(torch.zeros(1, 2, 8, D), 3)
    assert sparse_decode_attention(q[:0], k[:0], k[:0], None, 1.0).shape == (0, HKV, 6, D)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_ctx", [1100, 3001, 7900])
def test_dense_decode_attention_is_sglangs_torch_native_decode_bit_for_bit(dtype, n_ctx):
    """A context gathered out of order (a shuffled pool, as the host tier and resident set hold it) and
    put back in position order gives, through ``dense_decode_attention``, SGLang's own torch_native
    decode output for the same request to the bit (``_run_sdpa_forward_decode`` over a pool)."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    g = torch.Generator().manual_seed(n_ctx)
    slots = torch.randperm(n_ctx + 50, generator=g)[:n_ctx]  # the request's pool slot per position
    k_pool = (torch.randn(n_ctx + 50, HKV, D, generator=g) * 2).to(dtype)
    v_pool = torch.randn(n_ctx + 50, HKV, D, generator=g).to(dtype)
    q = torch.randn(3, HQ, D, generator=g).to(dtype)  # a batch of 3; the request is row 1
    r2t = torch.zeros(2, n_ctx + 10, dtype=torch.int64)
    r2t[1, :n_ctx] = slots
    out = torch.empty(3, HQ, D, dtype=dtype)
    TorchNativeAttnBackend._run_sdpa_forward_decode(
        None, q[1:2], out[1:2], k_pool, v_pool, r2t, torch.tensor([1]), torch.tensor([n_ctx]),
        scaling=D**-0.5, enable_gqa=True,
    )  # fmt: skip
    held = torch.randperm(n_ctx, generator=g)  # positions in the order some buffer holds them
    k_held, v_held = k_pool[slots[held]], v_pool[slots[held]]
    order = held.argsort()
    got = dense_decode_attention(q[1], k_held[order].contiguous(), v_held[order].contiguous(), D**-0.5)
    assert got.dtype == dtype and torch.equal(got, out[1])


def test_dense_decode_attention_refuses_shapes_that_do_not_match():
    k = torch.zeros(10, HKV, D)
    with pytest.raises(ValueError, match="must be"):
        dense_decode_attention(torch.zeros(1, HQ, D), k, k, 1.0)
    with pytest.raises(ValueError, match="do not match"):
        dense_decode_attention(torch.zeros(HQ, D + 1), k, k, 1.0)
    with pytest.raises(ValueError, match="do not match"):
        dense_decode_attention(torch.zeros(HQ + 1, D), k, k, 1.0)
