"""Sparse decode attention: one query token per request over a per-KV-head token subset.

This is the PyTorch reference used everywhere (the FlashInfer kernel for CUDA
will sit behind :func:`sparse_decode_attention`). For request ``b`` and query
head ``h`` in KV-head group ``g = h // (Hq // Hkv)`` (GQA):

    out[b, h] = softmax(scale * q[b, h] . K_b[g, :]) @ V_b[g, :]

where ``K_b``/``V_b`` hold, per KV head, the keys/values of the tokens that
request attends to (its resident set plus its critical set), already gathered
from the device pool and the host tier by the caller.

Each request is one call of ``torch.nn.functional.scaled_dot_product_attention``
with ``enable_gqa=True`` on ``[Hq, 1, D]`` x ``[Hkv, n, D]``, the same call
SGLang's ``torch_native`` backend makes per request
(``sglang/srt/layers/attention/torch_native_backend.py``,
``_run_sdpa_forward_decode``). So when a request's token set is its whole
context in position order, the output is bit-identical to the dense path
(``tests/test_sparse_decode.py`` checks this with ``torch.equal``).
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention


def sparse_decode_attention(
    q: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    scale: float,
) -> torch.Tensor:
    """Decode attention of ``b`` requests, each over its own gathered tokens.

    Args:
        q: queries, ``shape: [b, num_q_heads, head_dim]``, float dtype.
        keys: ``b`` tensors, ``keys[i]`` of ``shape: [num_kv_heads, n_i, head_dim]``,
            ``n_i >= 1``; row ``g`` holds the keys KV head ``g`` attends to (the
            token sets may differ between heads, their count may not).
        values: ``b`` tensors, ``values[i]`` of ``shape: [num_kv_heads, n_i, v_head_dim]``,
            in the same token order as ``keys[i]``.
        scale: softmax scale, usually ``head_dim ** -0.5``.

    Returns:
        ``shape: [b, num_q_heads, v_head_dim]``, ``q.dtype``.

    Raises:
        ValueError: ``q`` is not 3-D; the lists' lengths differ from ``b``; a key or
            value tensor has the wrong shape or no tokens; ``num_q_heads`` is not a
            multiple of ``num_kv_heads``.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [batch, num_q_heads, head_dim], got {tuple(q.shape)}")
    b, hq, d = q.shape
    if len(keys) != b or len(values) != b:
        raise ValueError(f"need {b} key and value tensors, got {len(keys)} and {len(values)}")
    outs = []
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        if k.dim() != 3 or k.shape[2] != d or k.shape[1] < 1:
            raise ValueError(f"keys[{i}] must be [num_kv_heads, n >= 1, {d}], got {tuple(k.shape)}")
        if v.dim() != 3 or v.shape[:2] != k.shape[:2]:
            raise ValueError(f"values[{i}] {tuple(v.shape)} does not match keys[{i}] {tuple(k.shape)}")
        if hq % k.shape[0]:
            raise ValueError(f"num_q_heads {hq} is not a multiple of num_kv_heads {k.shape[0]}")
        qi = q[i].unsqueeze(1).unsqueeze(0)  # [1, Hq, 1, D], as torch_native passes it
        ki, vi = k.to(q.dtype).unsqueeze(0), v.to(q.dtype).unsqueeze(0)
        out = scaled_dot_product_attention(qi, ki, vi, scale=scale, enable_gqa=hq != k.shape[0])
        outs.append(out[0, :, 0])
    if not outs:
        return q.new_empty((0, hq, d))
    return torch.stack(outs)
