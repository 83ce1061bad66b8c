"""Sparse decode attention: one query token per request over a per-KV-head token subset.

This is the PyTorch reference used everywhere (the FlashInfer kernel for CUDA
will sit behind the same function signature). For request ``b`` and query head
``h`` in KV-head group ``g = h // (Hq // Hkv)`` (GQA):

    out[b, h] = softmax(scale * q[b, h] . K[idx[b, g, :n], g]) @ V[idx[b, g, :n], g]

where ``n = lengths[b, g]`` and ``K``/``V`` are SGLang's token-indexed per-layer
KV buffers (``MHATokenToKVPool.k_buffer[layer]``, shape ``[slots, Hkv, D]``).
Scores and softmax are computed in float32 and the result is cast to ``q``'s
dtype. With ``idx`` covering every token of a request, the result equals dense
attention over that request (tests/test_sparse_decode.py checks against
``torch.nn.functional.scaled_dot_product_attention``).
"""

from __future__ import annotations

import torch


def sparse_decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    indices: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode attention over per-(request, KV head) token subsets.

    Args:
        q: queries, ``shape: [batch, num_q_heads, head_dim]``, float dtype.
        k_buffer: keys, ``shape: [num_slots, num_kv_heads, head_dim]``, same dtype as ``q``.
        v_buffer: values, ``shape: [num_slots, num_kv_heads, v_head_dim]``.
        indices: slot indices, ``shape: [batch, num_kv_heads, max_len], dtype: torch.int64``;
            entries at positions ``>= lengths[b, g]`` are padding (any valid slot, e.g. 0).
            Each row's valid entries must be distinct (a duplicate would count twice).
        lengths: valid entries per row, ``shape: [batch, num_kv_heads], dtype: torch.int32 or int64``,
            each in ``[1, max_len]``.
        scale: softmax scale, usually ``head_dim ** -0.5``.

    Returns:
        ``shape: [batch, num_q_heads, v_head_dim]``, ``q.dtype``.

    Raises:
        ValueError: shapes disagree, ``num_q_heads`` is not a multiple of ``num_kv_heads``,
            or a length is outside ``[1, max_len]``.
    """
    if q.dim() != 3 or k_buffer.dim() != 3 or v_buffer.dim() != 3 or indices.dim() != 3:
        raise ValueError("q, k_buffer, v_buffer and indices must be 3-D")
    b, hq, d = q.shape
    hkv = k_buffer.shape[1]
    if k_buffer.shape[2] != d or v_buffer.shape[:2] != k_buffer.shape[:2]:
        raise ValueError(
            f"k_buffer {tuple(k_buffer.shape)} / v_buffer {tuple(v_buffer.shape)} do not fit q {tuple(q.shape)}"
        )
    if hq % hkv:
        raise ValueError(f"num_q_heads {hq} is not a multiple of num_kv_heads {hkv}")
    if indices.shape[:2] != (b, hkv) or lengths.shape != (b, hkv):
        raise ValueError(
            f"indices {tuple(indices.shape)} / lengths {tuple(lengths.shape)} must start with [{b}, {hkv}]"
        )
    max_len = indices.shape[2]
    if lengths.numel() and (int(lengths.min()) < 1 or int(lengths.max()) > max_len):
        raise ValueError(
            f"lengths must lie in [1, {max_len}], got [{int(lengths.min())}, {int(lengths.max())}]"
        )

    heads = torch.arange(hkv, device=indices.device).view(1, hkv, 1)
    k_sel = k_buffer[indices, heads].float()  # [b, hkv, L, d]
    v_sel = v_buffer[indices, heads].float()  # [b, hkv, L, dv]
    qg = q.float().view(b, hkv, hq // hkv, d)  # [b, hkv, g, d]
    scores = torch.einsum("bhgd,bhld->bhgl", qg, k_sel) * scale
    valid = torch.arange(max_len, device=indices.device).view(1, 1, max_len) < lengths.unsqueeze(-1)
    scores = scores.masked_fill(~valid.unsqueeze(2), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgl,bhld->bhgd", probs, v_sel)
    return out.reshape(b, hq, v_buffer.shape[2]).to(q.dtype)
