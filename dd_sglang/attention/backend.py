"""The ``dualdecoder`` attention backend (``--attention-backend dualdecoder``).

* Prefill / extend, and decode rows of requests that are not ``DECODE_SPARSE``:
  the platform's dense backend (``torch_native`` on CPU; the CUDA platform's
  default, e.g. FlashInfer, on GPU).
* Decode rows of ``DECODE_SPARSE`` requests (the KV-cache runtime,
  :mod:`dd_sglang.kvcache.sparse_runtime`, has moved their KV to the host tier
  and released their device slots down to the resident set): per layer and KV
  head, attention over the resident set (device slots) plus the critical set,
  ``top_k`` host-tier tokens chosen by the configured selector from the
  current query and gathered from the host tier, computed by
  :func:`dd_sglang.kernels.sparse_decode.sparse_decode_attention`. Tokens are
  attended in position order, so with ``top_k`` at least the context length the
  output is bit-identical to the dense path's.

Mixed batches: the new token's K/V of every row is written to the device pool
once; with the ``torch_native`` delegate the dense rows run as a sub-batch, with
any other delegate the dense backend runs on the whole batch (it planned the
whole batch in ``init_forward_metadata``) and the sparse rows' outputs are
replaced; their released positions read SGLang's padding slot, never another
request's KV.

Not supported with sparse rows: CUDA graphs and overlap scheduling (the
launcher turns both off with this backend), mixed chunked prefill (rejected at
start). This backend has not been run on a GPU.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from dd_sglang.kernels.sparse_decode import sparse_decode_attention
from dd_sglang.kvcache.params import SparseParams
from dd_sglang.kvcache.sparse_runtime import SparseRuntime
from dd_sglang.prefetch.selectors import SELECTORS, OracleSelector

__all__ = ["DualDecoderAttnBackend", "SparseParams", "SparseRowPlan", "plan_sparse_row"]


@dataclass(frozen=True)
class SparseRowPlan:
    """One sparse decode row of a step.

    Attributes:
        row: the row's index in the batch.
        dev_pos: ``[R]`` int64 resident positions (sorted); ``dev_slots``: their device slots.
        cand_pos: ``[C]`` int64 host-tier positions outside the resident set (sorted);
            ``cand_slots``: their host-tier slots.
        st: the request's :class:`~dd_sglang.kvcache.sparse_runtime.SparseRequest`.
    """

    row: int
    dev_pos: torch.Tensor
    dev_slots: torch.Tensor
    cand_pos: torch.Tensor
    cand_slots: torch.Tensor
    st: object = None


def plan_sparse_row(row: int, seq_len: int, st, req_to_token_row: torch.Tensor) -> SparseRowPlan:
    """Plan one row: the resident positions of a request whose context is ``seq_len`` tokens.

    ``st`` is the request's :class:`~dd_sglang.kvcache.sparse_runtime.SparseRequest`;
    ``req_to_token_row`` its ``[max_context_len]`` int32 ``req_to_token`` row.
    """
    dev_pos = st.device_positions(seq_len)
    cand_pos = st.host_candidates()
    return SparseRowPlan(
        row,
        dev_pos,
        req_to_token_row[dev_pos.to(req_to_token_row.device)].long(),
        cand_pos,
        st.host_slots[cand_pos],
        st,
    )


class DualDecoderAttnBackend(AttentionBackend):
    """SGLang attention backend: dense delegate plus sparse decode rows over the host tier.

    Args:
        dense: the platform's dense backend instance (an SGLang ``AttentionBackend``).
        token_to_kv_pool: SGLang's device KV pool (``get_key_buffer(layer_id)``, ``set_kv_buffer``).
        req_to_token: ``[max_reqs, max_context_len]`` int32 map from request row and
            position to device KV slot (``ReqToTokenPool.req_to_token``).
        params: :class:`SparseParams`.
        runtime: returns this process's :class:`SparseRuntime` or None (looked up each
            step: SGLang builds the attention backend before the radix cache).
        on_sparse_rows: called with the number of (request, layer) rows each decode
            layer served sparsely (the plugin counts them in ``dd_sparse_decode_rows_total``).
        on_prefetch: for lookahead selectors, called per (request, layer) as
            ``(selector, layer, hits, lookups)``: ``hits`` = tokens of the current exact
            top-k (summed over KV heads) that the set fixed one step earlier held,
            ``lookups`` = ``k x num_kv_heads``; both None for a cold start.

    Attributes not defined here (CUDA-graph hooks and the like) are served by
    the dense backend.
    """

    def __init__(
        self,
        dense,
        token_to_kv_pool,
        req_to_token: torch.Tensor,
        params: SparseParams,
        runtime: Callable[[], SparseRuntime | None],
        on_sparse_rows: Callable[[int], None] | None = None,
        on_prefetch: Callable[[str, int, int | None, int | None], None] | None = None,
    ):
        super().__init__()
        self.dense = dense
        self.token_to_kv_pool = token_to_kv_pool
        self.req_to_token = req_to_token
        self.params = params
        self.runtime = runtime
        self.on_sparse_rows = on_sparse_rows
        self.on_prefetch = on_prefetch
        self._exact = OracleSelector()  # exact top-k, the scoring every selector here starts from
        try:
            from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

            self._sub_batch_ok = isinstance(dense, TorchNativeAttnBackend)
        except ImportError:  # pragma: no cover - the module ships with SGLang
            self._sub_batch_ok = False
        # Per-step plan, made once in init_forward_metadata (host syncs happen there, not per layer).
        self._plans: list[SparseRowPlan] = []
        self._dense_rows: list[int] = []
        self._dense_batch = None
        self._rt: SparseRuntime | None = None

    def __getattr__(self, name):
        return getattr(self.__dict__["dense"], name)

    def init_forward_metadata(self, forward_batch) -> None:
        """Plan the step: which decode rows are sparse, their resident and candidate positions."""
        self.dense.init_forward_metadata(forward_batch)
        self._plans, self._dense_rows, self._dense_batch = [], [], None
        rt = self._rt = self.runtime()
        if rt is None or not forward_batch.forward_mode.is_decode() or not rt.by_pool:
            return
        seq_lens = forward_batch.seq_lens.tolist()
        pool_idx = forward_batch.req_pool_indices.tolist()
        for i, (pidx, n) in enumerate(zip(pool_idx, seq_lens, strict=True)):
            st = rt.sparse_request(int(pidx))
            if st is None:
                self._dense_rows.append(i)
            else:
                self._plans.append(plan_sparse_row(i, int(n), st, self.req_to_token[int(pidx)]))
        if self._plans and self._dense_rows and self._sub_batch_ok:
            self._dense_batch = self._sub_batch(forward_batch, self._dense_rows)

    @staticmethod
    def _sub_batch(fb, rows: list[int]):
        """A shallow copy of ``fb`` restricted to ``rows`` (the fields ``torch_native`` decode reads)."""
        sub = copy.copy(fb)
        idx = torch.tensor(rows, dtype=torch.int64, device=fb.seq_lens.device)
        sub.batch_size = len(rows)
        sub.req_pool_indices = fb.req_pool_indices[idx]
        sub.seq_lens = fb.seq_lens[idx]
        sub.out_cache_loc = fb.out_cache_loc[idx]
        if getattr(fb, "seq_lens_cpu", None) is not None:
            sub.seq_lens_cpu = fb.seq_lens_cpu[idx.cpu()]
        if getattr(fb, "encoder_lens", None) is not None:
            sub.encoder_lens = fb.encoder_lens[idx]
        return sub

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        return self.dense.init_cuda_graph_state(max_bs, max_num_tokens)

    def get_cuda_graph_seq_len_fill_value(self):
        return self.dense.get_cuda_graph_seq_len_fill_value()

    def support_triton(self):
        return self.dense.support_triton()

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        if forward_batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
        return self.dense.forward(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        return self.dense.forward_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        if not self._plans or layer.is_cross_attention:
            return self.dense.forward_decode(
                q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs
            )
        hq, d, dv = layer.tp_q_head_num, layer.qk_head_dim, layer.v_head_dim
        q2 = q.reshape(-1, hq * d)
        if save_kv_cache and k is not None and v is not None:
            loc = KVWriteLoc(forward_batch.out_cache_loc, getattr(self.dense, "swa_out_cache_loc", None))
            self.token_to_kv_pool.set_kv_buffer(layer, loc, k, v)
        if not self._dense_rows:
            out = q2.new_empty((q2.shape[0], hq * dv))
        elif self._dense_batch is not None:
            out = q2.new_empty((q2.shape[0], hq * dv))
            rows = torch.tensor(self._dense_rows, dtype=torch.int64, device=q2.device)
            out[rows] = self.dense.forward_decode(
                q2[rows], None, None, layer, self._dense_batch, save_kv_cache=False
            )
        else:
            out = self.dense.forward_decode(q2, k, v, layer, forward_batch, save_kv_cache=False, **kwargs)
        sparse_rows = [p.row for p in self._plans]
        q_sparse = q2.view(-1, hq, d)[sparse_rows]
        keys, values = self._gather(q_sparse, layer)
        sparse_out = sparse_decode_attention(q_sparse, keys, values, layer.scaling)
        out.view(-1, hq, dv)[sparse_rows] = sparse_out.to(out.dtype)
        if self.on_sparse_rows is not None:
            self.on_sparse_rows(len(sparse_rows))
        return out

    def _gather(self, q_sparse: torch.Tensor, layer) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per sparse row: ``[Hkv, n, D]`` K and V of resident ∪ critical set, in position order.

        Critical set per row (``k`` = the request's ``top_k``): every candidate when
        there are at most ``k``; else ``oracle`` takes the exact top-k of the current
        query; a ``lookahead`` selector (``recency``) takes the set fixed during the
        previous step, records how much of the current exact top-k it holds (the
        prefetch hit rate), and fixes the set of the next step.
        """
        rt = self._rt
        pool = self.token_to_kv_pool
        lid = layer.layer_id
        host_layer = lid - getattr(pool, "start_layer", 0)
        k_buf, v_buf = pool.get_key_buffer(lid), pool.get_value_buffer(lid)
        host_k, host_v = rt.host.k[host_layer], rt.host.v[host_layer]
        hkv = k_buf.shape[1]
        heads = torch.arange(hkv).unsqueeze(1)
        q_host = q_sparse.cpu()
        keys, values, buf_bytes = [], [], 0
        for i, p in enumerate(self._plans):
            st = p.st
            c, k = p.cand_pos.numel(), st.top_k
            if c <= k:
                sel = torch.arange(c).unsqueeze(0).expand(hkv, c)
            else:
                cs = self._exact.select(q_host[i : i + 1], [p.cand_slots], k, host_k, layer.scaling)
                exact = cs.positions[0]  # [Hkv, k] indices into the candidates
                sel = exact
                if SELECTORS[st.selector].lookahead:
                    prev = st.prefetched.get(host_layer)
                    if prev is None:
                        if self.on_prefetch is not None:
                            self.on_prefetch(st.selector, host_layer, None, None)
                    else:
                        sel = torch.searchsorted(p.cand_pos, prev)
                        if self.on_prefetch is not None:
                            hits = sum(
                                int(torch.isin(prev[h], p.cand_pos[exact[h]]).sum()) for h in range(hkv)
                            )
                            self.on_prefetch(st.selector, host_layer, hits, hkv * k)
                    st.prefetched[host_layer] = p.cand_pos[exact]  # fixed now for the next step
            sel_slots = p.cand_slots[sel]  # [Hkv, k]
            kc, vc = (
                host_k[sel_slots, heads],
                host_v[sel_slots, heads],
            )  # [Hkv, k, D]: the critical-set buffer
            buf_bytes += kc.nbytes + vc.nbytes
            kd = k_buf[p.dev_slots].permute(1, 0, 2).to(kc.device)
            vd = v_buf[p.dev_slots].permute(1, 0, 2).to(kc.device)
            pos = torch.cat([p.dev_pos.unsqueeze(0).expand(hkv, -1), p.cand_pos[sel]], dim=1)
            order = pos.argsort(dim=1).unsqueeze(-1)
            kk = torch.cat([kd, kc], dim=1)
            vv = torch.cat([vd, vc], dim=1)
            keys.append(kk.gather(1, order.expand(-1, -1, kk.shape[2])).to(q_sparse.device))
            values.append(vv.gather(1, order.expand(-1, -1, vv.shape[2])).to(q_sparse.device))
        rt.critical_buffer_bytes = buf_bytes
        return keys, values
