"""Prefill attention of a request whose prefix is cached, without recomputing the prefix's queries.

SGLang's ``torch_native`` backend (``TorchNativeAttnBackend._run_sdpa_forward_extend``,
``sglang/srt/layers/attention/torch_native_backend.py``) attends an extend of ``e`` new tokens
over a cached prefix of ``p`` tokens by building a query of the *whole* sequence (``s = p + e``
rows, the prefix rows left uninitialised) and running one causal
``scaled_dot_product_attention`` over it, then keeping the last ``e`` rows. A one-token extend
after a 4,000-token cached prefix (a repeated prompt, a multi-turn follow-up) therefore costs a
whole 4k x 4k causal attention per layer: ~150 ms a layer, ~4.5 s a request on this project's
2-core CPU, measured.

Computing only the ``e`` new rows (with a causal mask offset by ``p``) gives the same values but
not the same bits: PyTorch's fused CPU kernel (``aten/src/ATen/native/cpu/FlashAttentionKernel.cpp``)
splits the query into blocks whose size it picks from the query length (256 rows from 768 rows
up, 64 from 192, else 32) and a row computed in a short trailing block (1-3 rows) rounds
differently. In bfloat16 that last bit flips a greedy token some tens of tokens later, and this
project's exactness guarantee (``top_k`` >= the context gives dense's tokens) compares with
SGLang's own dense server. So :func:`prefix_extend_attention` keeps PyTorch's blocking: it
starts the query at a multiple of :data:`QUERY_BLOCK` at or before ``p``, early enough that it
has at least :data:`MIN_BLOCKED_QUERIES` rows (so the kernel splits it into the same 256-row
blocks as the whole sequence), attends those rows over ``[0, s)`` with an explicit causal mask,
and keeps the new rows. Every row then lies in the same block, of the same size, as in SGLang's
call, and comes out bit for bit the same (``tests/test_extend_attention.py`` checks it against
SGLang's own method on both dtypes). At most ``MIN_BLOCKED_QUERIES + QUERY_BLOCK - 1`` rows are
computed instead of ``s``: measured here for a one-token extend, 4k: 151 -> 79 ms a layer,
7.9k: 560 -> 139 ms (the masked call reads every block, the causal one skips half).
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention

#: Rows of a query block of PyTorch's CPU flash attention once the query has
#: :data:`MIN_BLOCKED_QUERIES` rows (``FlashAttentionKernel.cpp``; checked by the tests).
QUERY_BLOCK = 256
#: Query length from which PyTorch's CPU flash attention uses :data:`QUERY_BLOCK`-row blocks.
MIN_BLOCKED_QUERIES = 768


def aligned_query_start(prefix_len: int, seq_len: int) -> int:
    """The first query row :func:`prefix_extend_attention` computes for an extend of
    ``seq_len - prefix_len`` tokens after ``prefix_len`` cached ones: the largest multiple of
    :data:`QUERY_BLOCK` at or before ``prefix_len`` that leaves at least
    :data:`MIN_BLOCKED_QUERIES` rows; 0 (the whole sequence, as SGLang) for a sequence shorter
    than that.

    Raises:
        ValueError: ``prefix_len`` is not in ``[0, seq_len)``.
    """
    if not 0 <= prefix_len < seq_len:
        raise ValueError(f"prefix_len must be in [0, seq_len={seq_len}), got {prefix_len}")
    if seq_len < MIN_BLOCKED_QUERIES:
        return 0
    last_full = (seq_len - MIN_BLOCKED_QUERIES) // QUERY_BLOCK * QUERY_BLOCK
    return min(prefix_len // QUERY_BLOCK * QUERY_BLOCK, last_full)


def prefix_extend_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, prefix_len: int, scale: float
) -> torch.Tensor:
    """Causal attention of one request's ``e`` new tokens over its whole sequence, bit for bit as
    SGLang's ``torch_native`` extend computes it (module docstring), from
    :func:`aligned_query_start` on instead of from row 0.

    Args:
        q: ``shape: [e, Hq, D]``, the new tokens' queries (any float dtype).
        keys: ``shape: [s, Hkv, D]``, the sequence's keys in position order (``s = prefix_len + e``,
            e.g. ``k_cache[req_to_token[row, :s]]``); cast to ``q.dtype`` as SGLang does.
        values: ``shape: [s, Hkv, Dv]``, same order.
        prefix_len: ``p``, cached tokens before the new ones (0: a fresh prefill).
        scale: softmax scale.

    Returns:
        ``shape: [e, Hq, Dv]``, ``q.dtype``.

    Raises:
        ValueError: the shapes disagree, ``prefix_len + e`` is not ``s``, or ``Hq`` is not a
            multiple of ``Hkv``.
    """
    if q.dim() != 3 or keys.dim() != 3 or values.dim() != 3:
        raise ValueError(f"q must be [e, Hq, D] and keys/values [s, Hkv, D], got {tuple(q.shape)}, "
                         f"{tuple(keys.shape)}, {tuple(values.shape)}")  # fmt: skip
    e, hq, d = q.shape
    s, hkv, _ = keys.shape
    if keys.shape[2] != d or values.shape[:2] != keys.shape[:2] or hq % hkv:
        raise ValueError(f"keys {tuple(keys.shape)} / values {tuple(values.shape)} do not match q {tuple(q.shape)}")
    if e < 1 or prefix_len + e != s:
        raise ValueError(f"prefix_len {prefix_len} + {e} new tokens must equal the {s} keys")
    start = aligned_query_start(prefix_len, s)
    rows = torch.zeros((hq, s - start, d), dtype=q.dtype, device=q.device)  # [start, p): never read
    rows[:, prefix_len - start :] = q.movedim(0, 1)
    k = keys.movedim(0, 1).unsqueeze(0).to(q.dtype)
    v = values.movedim(0, 1).unsqueeze(0).to(q.dtype)
    gqa = hq != hkv
    if start == 0:  # SGLang's own call: the whole sequence, causal
        out = scaled_dot_product_attention(rows.unsqueeze(0), k, v, scale=scale, is_causal=True, enable_gqa=gqa)
    else:
        pos = torch.arange(s, device=q.device)
        mask = pos[None, :] <= pos[start:, None]  # [s - start, s]: row i attends [0, start + i]
        out = scaled_dot_product_attention(rows.unsqueeze(0), k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out[0, :, prefix_len - start :].movedim(0, 1)
