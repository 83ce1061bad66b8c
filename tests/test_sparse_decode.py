"""The PyTorch reference sparse-decode kernel against dense attention computed independently."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dd_sglang.kernels.sparse_decode import sparse_decode_attention

B, HQ, HKV, D, SLOTS = 3, 9, 3, 64, 200  # SmolLM2's head layout


def _pool(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(SLOTS, HKV, D, generator=g).to(dtype)
    v = torch.randn(SLOTS, HKV, D, generator=g).to(dtype)
    q = torch.randn(B, HQ, D, generator=g).to(dtype)
    return q, k, v


def _dense_reference(q, k, v, slots_per_req):
    """SDPA over each request's own slots (all tokens), GQA by repeating KV heads."""
    outs = []
    for b, slots in enumerate(slots_per_req):
        kk = k[slots].float().permute(1, 0, 2).repeat_interleave(HQ // HKV, 0)  # [HQ, n, D]
        vv = v[slots].float().permute(1, 0, 2).repeat_interleave(HQ // HKV, 0)
        o = F.scaled_dot_product_attention(q[b].float().unsqueeze(1), kk, vv)  # [HQ, 1, D]
        outs.append(o.squeeze(1))
    return torch.stack(outs)


def test_full_index_set_equals_dense_attention():
    q, k, v = _pool()
    lens = [50, 120, 77]
    slots = [
        torch.randperm(SLOTS, generator=torch.Generator().manual_seed(b))[:n] for b, n in enumerate(lens)
    ]
    max_len = max(lens)
    idx = torch.zeros(B, HKV, max_len, dtype=torch.int64)
    for b, s in enumerate(slots):
        idx[b, :, : len(s)] = s
    lengths = torch.tensor(lens).view(B, 1).expand(B, HKV).contiguous()
    out = sparse_decode_attention(q, k, v, idx, lengths, D**-0.5)
    torch.testing.assert_close(out, _dense_reference(q, k, v, slots), rtol=1e-5, atol=1e-6)


def test_per_head_subsets_match_a_hand_loop():
    q, k, v = _pool(seed=1)
    g = torch.Generator().manual_seed(2)
    L = 16
    idx = torch.stack(
        [torch.stack([torch.randperm(SLOTS, generator=g)[:L] for _ in range(HKV)]) for _ in range(B)]
    )
    lengths = torch.randint(1, L + 1, (B, HKV), generator=g)
    out = sparse_decode_attention(q, k, v, idx, lengths, 0.125)
    for b in range(B):
        for h in range(HQ):
            kv = h // (HQ // HKV)
            s = idx[b, kv, : lengths[b, kv]]
            p = torch.softmax((k[s, kv] @ q[b, h]) * 0.125, dim=0)
            torch.testing.assert_close(out[b, h], p @ v[s, kv], rtol=1e-5, atol=1e-6)


def test_bf16_output_dtype_and_closeness():
    q, k, v = _pool(torch.bfloat16)
    idx = torch.arange(SLOTS).view(1, 1, SLOTS).expand(B, HKV, SLOTS).contiguous()
    lengths = torch.full((B, HKV), SLOTS)
    out = sparse_decode_attention(q, k, v, idx, lengths, D**-0.5)
    assert out.dtype == torch.bfloat16
    ref = _dense_reference(q, k, v, [torch.arange(SLOTS)] * B)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    "mutate,needle",
    [
        (lambda a: {**a, "lengths": torch.zeros(B, HKV, dtype=torch.int64)}, "lengths must lie in"),
        (lambda a: {**a, "q": torch.zeros(B, 8, D)}, "multiple of num_kv_heads"),
        (lambda a: {**a, "indices": a["indices"][:1]}, "must start with"),
    ],
)
def test_bad_shapes_raise_clear_errors(mutate, needle):
    q, k, v = _pool()
    args = {
        "q": q, "k_buffer": k, "v_buffer": v,
        "indices": torch.zeros(B, HKV, 4, dtype=torch.int64), "lengths": torch.ones(B, HKV, dtype=torch.int64),
        "scale": 1.0,
    }  # fmt: skip
    with pytest.raises(ValueError, match=needle):
        sparse_decode_attention(**mutate(args))
