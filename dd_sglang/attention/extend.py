"""The ``dualdecoder`` backend's extend after a cached prefix (``torch_native`` delegate only).

SGLang's ``torch_native`` extend recomputes every cached prefix token's query (it attends the whole
sequence and keeps the new rows); the kernel :func:`dd_sglang.kernels.extend.prefix_extend_attention`
gives the same output bits from an aligned row on. The backend routes an extend here when
:func:`skips_prefix_queries` says a request of it saves rows; everything else (fresh prefills,
sliding windows, cross-attention, encoders, mixed or speculative modes, other delegates such as
FlashInfer on CUDA) stays with the delegate. Skipped rows are counted in
``dd_extend_query_rows_skipped_total`` (per request and layer).

A later chunk of a prompt longer than the device pool (prefilled through the host tier) is always
routed here: its earlier positions have no device slot, so their K/V come from the host tier
(:func:`host_prefixes`), an exact copy of what the pool held; the attention itself is the same.
"""

from __future__ import annotations

import torch
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from dd_sglang.kernels.extend import aligned_query_start, prefix_extend_attention
from dd_sglang.kvcache.dualpath import PathState


def skips_prefix_queries(layer, fb) -> bool:
    """Whether ``fb`` (SGLang's ``ForwardBatch``) is a plain extend (``ForwardMode.EXTEND``) of a
    causal decoder self-attention ``layer`` (no sliding window, no encoder) in which some request's
    cached prefix lets :func:`~dd_sglang.kernels.extend.aligned_query_start` skip query rows."""
    if getattr(fb.forward_mode, "name", None) != "EXTEND" or layer.is_cross_attention:
        return False
    if getattr(layer, "attn_type", AttentionType.DECODER) != AttentionType.DECODER:
        return False
    window = getattr(layer, "sliding_window_size", None)
    if (window is not None and window > -1) or getattr(fb, "encoder_lens", None) is not None:
        return False
    prefix, ext = fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu
    return bool(prefix and ext) and any(aligned_query_start(p, p + e) for p, e in zip(prefix, ext, strict=True))


def host_prefixes(backend, fb) -> dict[int, object] | None:
    """The requests of extend batch ``fb`` whose earlier chunks live in the host tier only (a prompt
    longer than the device pool, prefilled through it: :meth:`Offloader.offload_chunk
    <dd_sglang.kvcache.offload.Offloader.offload_chunk>`), by ``req_to_token`` row: their
    :class:`~dd_sglang.kvcache.sparse_request.SparseRequest` (positions ``[n_sink, host_len)`` have
    no device slot). None when there is none (the common case: one dict lookup per request)."""
    rt = backend.runtime
    if rt is None or not rt.by_pool or getattr(fb.forward_mode, "name", None) != "EXTEND":
        return None
    found = {}
    for row in fb.req_pool_indices.tolist():
        st = rt.by_pool.get(row)
        if st is not None and st.released and st.path.state is PathState.PREFILL_FULL and st.host_len:
            found[row] = st
    return found or None


def _sequence_kv(backend, layer, k_cache, v_cache, row: int, s: int, st) -> tuple:
    """K and V of positions ``[0, s)`` of request row ``row``, ``[s, Hkv, D]`` each: from the device
    pool, except ``[n_sink, host_len)`` of a request prefilled through the host tier (``st``), read
    from the host tier (the same bits: :meth:`HostSparseKVPool.gather`)."""
    tokens = backend.req_to_token[row, :s].long()
    if st is None:
        return k_cache[tokens], v_cache[tokens]
    lo, hi = int(st.keep_pos.numel()), st.host_len
    hk, hv = backend.runtime.host.gather(layer.layer_id, st.host_slots[lo:hi])
    dev = k_cache.device
    keys = torch.cat([k_cache[tokens[:lo]], hk.to(dev), k_cache[tokens[hi:]]])
    values = torch.cat([v_cache[tokens[:lo]], hv.to(dev), v_cache[tokens[hi:]]])
    return keys, values


def extend_after_prefix(backend, q, k, v, layer, fb, save_kv_cache: bool, hosted: dict | None = None):
    """One layer of an extend batch, as ``torch_native``'s ``forward_extend`` computes it (same
    KV write, same output bits), each request's queries from its aligned row on.

    Args:
        backend: the ``dualdecoder`` backend (``token_to_kv_pool``, ``req_to_token``, ``dense``,
            ``events``).
        q: ``shape: [tokens, Hq x D]``; k, v: ``[tokens, Hkv x D]`` (or ``[tokens, Hkv, D]``), the
            batch's new tokens in request order, or None (nothing to write).
        layer: SGLang's ``RadixAttention``; fb: the ``ForwardBatch``.
        save_kv_cache: write ``k``/``v`` to the pool at ``fb.out_cache_loc`` first.
        hosted: :func:`host_prefixes` of ``fb`` (requests whose prefix is read from the host tier).

    Returns:
        ``shape: [tokens, Hq x Dv]``, ``q.dtype``.
    """
    hq, d, dv = layer.tp_q_head_num, layer.qk_head_dim, layer.v_head_dim
    pool = backend.token_to_kv_pool
    if save_kv_cache and k is not None and v is not None:
        loc = KVWriteLoc(fb.out_cache_loc, getattr(backend.dense, "swa_out_cache_loc", None))
        pool.set_kv_buffer(layer, loc, k, v)
    k_cache, v_cache = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
    q3 = q.reshape(-1, hq, d)
    out = q3.new_empty((q3.shape[0], hq, dv))
    start = skipped = 0
    for row, p, e in zip(fb.req_pool_indices.tolist(), fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu, strict=True):
        keys, values = _sequence_kv(backend, layer, k_cache, v_cache, row, p + e, (hosted or {}).get(row))
        out[start : start + e] = prefix_extend_attention(q3[start : start + e], keys, values, p, layer.scaling)
        skipped += aligned_query_start(p, p + e)
        start += e
    backend.events.extend_rows_skipped(skipped)
    return out.view(-1, hq * dv)
