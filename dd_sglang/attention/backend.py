"""The ``dualdecoder`` attention backend (``--attention-backend dualdecoder``).

What it does today (the host tier is not built yet, so every request's full
KV stays in SGLang's device pool):

* ``init_forward_metadata``, prefill / extend, and decode of short requests:
  delegated to the platform's dense backend (``torch_native`` on CPU; the
  CUDA platform's default, e.g. FlashInfer, on GPU).
* Decode of a request whose context length ``n`` satisfies
  ``n >= min_sparse_len`` and ``n > n_sink + n_recent + top_k``: per layer and
  KV head, attention runs over the resident set (the first ``n_sink`` and last
  ``n_recent`` tokens) plus the critical set (``top_k`` tokens of the middle
  chosen by the configured selector from the current query), with
  :func:`dd_sglang.kernels.sparse_decode.sparse_decode_attention`.
* A request whose resident + critical sets would cover its whole context is
  decoded densely, so its tokens equal the dense path's exactly (DESIGN.md:
  "the sparse path is exact where it can be").

Per decode layer the dense backend first writes the new token's K/V and
computes dense outputs for the whole batch; the rows of sparse requests are
then replaced by their sparse outputs. (The dense pass over sparse rows goes
away with the host tier, when their device KV no longer exists.)

CUDA graphs are not supported by the sparse rows (index lists change every
step); this backend has not been run on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from dd_sglang.kernels.sparse_decode import sparse_decode_attention
from dd_sglang.prefetch.selectors import Selector, make_selector


@dataclass(frozen=True)
class SparseParams:
    """Sparse-path settings, all counts in tokens. Built from the preset's validated
    ``sparse`` section (``dd_sglang.config.SparseSection``), which holds the defaults."""

    min_sparse_len: int
    top_k: int
    n_sink: int
    n_recent: int
    selector: str


def sparse_plan(seq_len: int, p: SparseParams) -> bool:
    """True when a decode step at context ``seq_len`` runs on the sparse path."""
    return seq_len >= p.min_sparse_len and seq_len > p.n_sink + p.n_recent + p.top_k


def critical_slots(
    query: torch.Tensor,
    slots: torch.Tensor,
    k_buffer: torch.Tensor,
    p: SparseParams,
    selector: Selector,
    scale: float,
) -> torch.Tensor:
    """Device slots to attend for one request: resident set then critical set, per KV head.

    Args:
        query: ``[num_q_heads, head_dim]``, the current token's query.
        slots: ``[seq_len]`` int64, the request's KV slots in position order.
        k_buffer: the layer's key buffer ``[num_slots, num_kv_heads, head_dim]``.

    Returns:
        ``[num_kv_heads, n_sink + n_recent + top_k]`` int64 slot indices, distinct per row.
    """
    n = slots.shape[0]
    hkv = k_buffer.shape[1]
    lo, hi = p.n_sink, n - p.n_recent
    middle_keys = k_buffer[slots[lo:hi]]
    cs = selector.select(query.unsqueeze(0), [middle_keys], p.top_k, scale)
    chosen = slots[lo:hi][cs.positions[0].to(slots.device)]  # [hkv, top_k]
    resident = torch.cat([slots[:lo], slots[hi:]]).unsqueeze(0).expand(hkv, -1)
    return torch.cat([resident, chosen], dim=1)


class DualDecoderAttnBackend(AttentionBackend):
    """SGLang attention backend: dense delegate plus sparse decode rows.

    Args:
        dense: the platform's dense backend instance (an SGLang ``AttentionBackend``).
        token_to_kv_pool: SGLang's device KV pool (``get_key_buffer(layer_id)``).
        req_to_token: ``[max_reqs, max_context_len]`` int32 map from request slot and
            position to KV slot (``ReqToTokenPool.req_to_token``).
        params: :class:`SparseParams`.
        on_sparse_rows: called with the number of (request, layer) rows each decode
            layer served sparsely (the plugin counts them in
            ``dd_sparse_decode_rows_total``).

    Attributes not defined here (CUDA-graph hooks and the like) are served by
    the dense backend.
    """

    def __init__(
        self,
        dense,
        token_to_kv_pool,
        req_to_token: torch.Tensor,
        params: SparseParams,
        on_sparse_rows: Callable[[int], None] | None = None,
    ):
        super().__init__()
        self.on_sparse_rows = on_sparse_rows
        self.dense = dense
        self.token_to_kv_pool = token_to_kv_pool
        self.req_to_token = req_to_token
        self.params = params
        self.selector = make_selector(params.selector)
        # Per-step plan (init_forward_metadata): sparse row numbers and each one's KV slots.
        self._rows: list[int] = []
        self._row_slots: list[torch.Tensor] = []

    def __getattr__(self, name):
        return getattr(self.__dict__["dense"], name)

    def init_forward_metadata(self, forward_batch) -> None:
        """Plan once per step (host syncs happen here, not per layer): which decode rows are sparse."""
        self.dense.init_forward_metadata(forward_batch)
        self._rows, self._row_slots = [], []
        if forward_batch.forward_mode.is_decode():
            seq_lens = forward_batch.seq_lens.tolist()
            pool_idx = forward_batch.req_pool_indices.tolist()
            self._rows = [i for i, n in enumerate(seq_lens) if sparse_plan(int(n), self.params)]
            self._row_slots = [self.req_to_token[pool_idx[r], : int(seq_lens[r])].long() for r in self._rows]

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
        out = self.dense.forward_decode(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
        rows = self._rows
        if not rows or layer.is_cross_attention:
            return out
        hq, d, dv = layer.tp_q_head_num, layer.qk_head_dim, layer.v_head_dim
        q_ = q.reshape(-1, hq, d)
        k_buf = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_buf = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        idx = torch.stack(
            [
                critical_slots(q_[r], slots, k_buf, self.params, self.selector, layer.scaling)
                for r, slots in zip(rows, self._row_slots, strict=True)
            ]
        )
        lengths = torch.full(idx.shape[:2], idx.shape[2], dtype=torch.int64, device=idx.device)
        sparse_out = sparse_decode_attention(q_[rows], k_buf, v_buf, idx, lengths, layer.scaling)
        out.view(-1, hq, dv)[rows] = sparse_out.to(out.dtype)
        if self.on_sparse_rows is not None:
            self.on_sparse_rows(len(rows))
        return out
