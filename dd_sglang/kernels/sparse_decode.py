"""Sparse decode attention: every sparse row of a step in one call, over per-KV-head token subsets.

Layout (what :class:`dd_sglang.prefetch.plan.StepPlan` and the layer ring produce):

* ``q``: ``shape: [rows, num_kv_heads, L, head_dim]``. GQA is folded into the
  query axis: KV head ``g`` of a row carries the ``L = queries x group`` query
  vectors that read it (query position ``s``, query head ``h = g x group + j``
  at index ``s x group + j``). A row has one or two query positions: its real
  token and, when a token was speculated, the speculated one.
* ``keys`` / ``values``: ``shape: [rows, num_kv_heads, n, head_dim]``: the
  row's resident set, its critical set (different tokens per KV head) and a
  column for the speculated token's own K/V, padded to a common ``n``.
* ``mask``: ``shape: [rows, 1 or num_kv_heads, L, n], dtype: torch.bool``,
  True where a query may attend: padding is False for both queries, the
  speculated token's own column is True only for the speculated query.

Per row ``r``, KV head ``g`` and query index ``i``::

    out[r, g, i] = softmax(scale * q[r, g, i] . keys[r, g, mask[r, g, i]]) @ values[r, g, mask[r, g, i]]

computed by one ``torch.nn.functional.scaled_dot_product_attention`` call
(PyTorch picks its fused CPU / CUDA kernel). This is the PyTorch reference used
everywhere; the FlashInfer path for CUDA will sit behind the same function.
With a row's whole context in its token set, the result equals dense attention
up to floating-point summation order (``tests/test_sparse_decode.py`` compares
against an independent per-row softmax).
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention


def fold_gqa(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``[rows, S, num_q_heads, D]`` -> ``[rows, num_kv_heads, S x group, D]`` (see the module docstring).

    Raises:
        ValueError: ``num_q_heads`` is not a multiple of ``num_kv_heads``.
    """
    r, s, hq, d = q.shape
    if hq % num_kv_heads:
        raise ValueError(f"num_q_heads {hq} is not a multiple of num_kv_heads {num_kv_heads}")
    g = hq // num_kv_heads
    return q.view(r, s, num_kv_heads, g, d).permute(0, 2, 1, 3, 4).reshape(r, num_kv_heads, s * g, d)


def unfold_gqa(out: torch.Tensor, positions: int) -> torch.Tensor:
    """Inverse of :func:`fold_gqa`: ``[rows, Hkv, S x group, D]`` -> ``[rows, S, Hkv x group, D]``."""
    r, hkv, n_q, d = out.shape
    g = n_q // positions
    return out.view(r, hkv, positions, g, d).permute(0, 2, 1, 3, 4).reshape(r, positions, hkv * g, d)


def sparse_decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Decode attention of every sparse row of a step (module docstring for the layout).

    Args:
        q: ``shape: [rows, num_kv_heads, L, head_dim]``, float dtype (GQA folded, :func:`fold_gqa`).
        keys: ``shape: [rows, num_kv_heads, n, head_dim]``, same dtype as ``q``.
        values: ``shape: [rows, num_kv_heads, n, v_head_dim]``.
        mask: ``shape: [rows, 1 or num_kv_heads, L, n], dtype: torch.bool`` (True: attend), or None
            (every column of every row is valid). Every query must have at least one True column.
            Masked columns must hold finite values (a NaN there still poisons the row: the
            mask is added to the scores); the layer ring is zero-filled for this reason.
        scale: softmax scale, usually ``head_dim ** -0.5``.

    Returns:
        ``shape: [rows, num_kv_heads, L, v_head_dim]``, ``q.dtype``.

    Raises:
        ValueError: a tensor is not 4-D, or the shapes disagree (the message gives them).
    """
    if q.dim() != 4 or keys.dim() != 4 or values.dim() != 4:
        raise ValueError(
            f"q, keys, values must be 4-D [rows, num_kv_heads, len, dim], got "
            f"{tuple(q.shape)}, {tuple(keys.shape)}, {tuple(values.shape)}"
        )
    r, hkv, n_q, d = q.shape
    if keys.shape[:2] != (r, hkv) or keys.shape[3] != d or values.shape[:3] != keys.shape[:3]:
        raise ValueError(
            f"keys {tuple(keys.shape)} / values {tuple(values.shape)} do not match q {tuple(q.shape)}"
        )
    if mask is not None and (mask.dim() != 4 or mask.shape[0] != r or mask.shape[2:] != (n_q, keys.shape[2])):
        raise ValueError(f"mask must be [{r}, 1|{hkv}, {n_q}, {keys.shape[2]}], got {tuple(mask.shape)}")
    if r == 0:
        return q.new_empty((0, hkv, n_q, values.shape[3]))
    return scaled_dot_product_attention(
        q, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask, scale=scale
    )


def dense_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """One request's decode attention over its whole context, called exactly as SGLang's dense decode calls it.

    SGLang's ``torch_native`` decode (``TorchNativeAttnBackend._run_sdpa_forward_decode``) runs one
    ``scaled_dot_product_attention`` per request: the query ``[1, Hq, 1, D]``, the context's K/V
    ``[1, Hkv, n, D]`` in position order (views of the pool's ``[n, Hkv, D]`` rows), no mask,
    ``enable_gqa``. Fused CPU kernels pick their blocking from the shapes, and in bfloat16 a
    different blocking, column order, padding or mask changes outputs in their last bit (enough to
    flip a greedy token some tens of tokens later). A sparse row whose critical set is its whole
    context is therefore attended here, with the same shapes, layout and call, so that its output is
    the dense server's bit for bit on any CPU (``tests/test_sparse_decode.py``).

    Args:
        q: ``shape: [Hq, D]``, the request's query (any strides).
        keys: ``shape: [n, Hkv, D]``, the context's keys in position order (as ``k_cache[tokens]``).
        values: ``shape: [n, Hkv, Dv]``, same order.
        scale: softmax scale.

    Returns:
        ``shape: [Hq, Dv]``, ``q.dtype``.

    Raises:
        ValueError: the shapes disagree, or ``Hq`` is not a multiple of ``Hkv``.
    """
    if q.dim() != 2 or keys.dim() != 3 or values.dim() != 3:
        raise ValueError(f"q must be [Hq, D] and keys/values [n, Hkv, D], got {tuple(q.shape)}, "
                         f"{tuple(keys.shape)}, {tuple(values.shape)}")  # fmt: skip
    if keys.shape[2] != q.shape[1] or values.shape[:2] != keys.shape[:2] or q.shape[0] % keys.shape[1]:
        raise ValueError(
            f"keys {tuple(keys.shape)} / values {tuple(values.shape)} do not match q {tuple(q.shape)}"
        )
    k = keys.movedim(0, 1).unsqueeze(0).to(q.dtype)
    v = values.movedim(0, 1).unsqueeze(0).to(q.dtype)
    out = scaled_dot_product_attention(
        q.unsqueeze(1).unsqueeze(0), k, v, scale=scale, enable_gqa=q.shape[0] != keys.shape[1]
    )
    return out[0, :, 0]
