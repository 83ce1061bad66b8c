"""The PyTorch reference sparse-decode kernel against dense attention computed independently."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dd_sglang.kernels.sparse_decode import sparse_decode_attention

B, HQ, HKV, D, SLOTS = 3, 9, 3, 64, 5000  # SmolLM2's head layout


def _pool(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(SLOTS, HKV, D, generator=g).to(dtype)
    v = torch.randn(SLOTS, HKV, D, generator=g).to(dtype)
    q = torch.randn(B, HQ, D, generator=g).to(dtype)
    return q, k, v


def _torch_native_decode(q, k_cache, v_cache, slots, scale):
    """SGLang torch_native's per-request decode call (torch_native_backend.py, _run_sdpa_forward_decode)."""
    query = q.unsqueeze(0).movedim(0, 1)  # [HQ, 1, D]
    key = k_cache[slots].movedim(0, 1)
    value = v_cache[slots].movedim(0, 1)
    out = F.scaled_dot_product_attention(
        query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0), enable_gqa=True, scale=scale
    )
    return out.squeeze(0).movedim(1, 0)[0]  # [HQ, D]


@pytest.mark.parametrize("n", [1, 129, 3048])
def test_whole_context_in_position_order_is_bit_identical_to_torch_native(n):
    """The exactness guarantee: the same K/V (here copied, as the host tier does) in position order."""
    q, k, v = _pool(torch.bfloat16)
    slots = torch.randperm(SLOTS, generator=torch.Generator().manual_seed(n))[:n]
    host_k, host_v = k.clone(), v.clone()
    keys = [host_k[slots].permute(1, 0, 2).contiguous() for _ in range(B)]
    values = [host_v[slots].permute(1, 0, 2).contiguous() for _ in range(B)]
    out = sparse_decode_attention(q, keys, values, D**-0.5)
    assert out.dtype == torch.bfloat16
    for b in range(B):
        assert torch.equal(out[b], _torch_native_decode(q[b], k, v, slots, D**-0.5))


def test_per_head_subsets_match_a_hand_loop():
    q, k, v = _pool(seed=1)
    g = torch.Generator().manual_seed(2)
    lens = [16, 40, 7]
    idx = [torch.stack([torch.randperm(SLOTS, generator=g)[:n] for _ in range(HKV)]) for n in lens]
    heads = torch.arange(HKV).unsqueeze(1)
    keys = [k[i, heads] for i in idx]  # [HKV, n, D]
    values = [v[i, heads] for i in idx]
    out = sparse_decode_attention(q, keys, values, 0.125)
    for b in range(B):
        for h in range(HQ):
            kv = h // (HQ // HKV)
            s = idx[b][kv]
            p = torch.softmax((k[s, kv] @ q[b, h]) * 0.125, dim=0)
            torch.testing.assert_close(out[b, h], p @ v[s, kv], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "mutate,needle",
    [
        (lambda a: {**a, "q": torch.zeros(B, HQ)}, r"must be \[batch"),
        (lambda a: {**a, "keys": a["keys"][:1]}, "need 3 key and value tensors"),
        (lambda a: {**a, "keys": [torch.zeros(HKV, 0, D)] * B}, "n >= 1"),
        (lambda a: {**a, "values": [torch.zeros(HKV, 5, D)] * B}, "does not match"),
        (lambda a: {**a, "q": torch.zeros(B, 8, D)}, "multiple of num_kv_heads"),
    ],
)
def test_bad_input_is_rejected_with_the_field_named(mutate, needle):
    args = {
        "q": torch.zeros(B, HQ, D),
        "keys": [torch.zeros(HKV, 4, D)] * B,
        "values": [torch.zeros(HKV, 4, D)] * B,
        "scale": 0.125,
    }
    with pytest.raises(ValueError, match=needle):
        sparse_decode_attention(**mutate(args))
