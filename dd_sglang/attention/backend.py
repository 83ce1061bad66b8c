"""The ``dualdecoder`` attention backend (``--attention-backend dualdecoder``).

* Prefill / extend, and decode rows of requests that are not ``DECODE_SPARSE``:
  the platform's dense backend (``torch_native`` on CPU; the CUDA platform's
  default, e.g. FlashInfer, on GPU).
* Decode rows of ``DECODE_SPARSE`` requests (the KV-cache runtime,
  :mod:`dd_sglang.kvcache.sparse_runtime`, has moved their KV to the host tier
  and released their device slots down to the resident set): per layer and KV
  head, attention over the resident set (device slots) plus the critical set,
  ``top_k`` host-tier tokens, computed by
  :func:`dd_sglang.kernels.sparse_decode.sparse_decode_attention`. Tokens are
  attended in position order, so with ``top_k`` at least the context length the
  output is bit-identical to the dense path's.

One decode step (``init_forward_metadata`` plans it once; each layer only gathers and attends):

1. **Speculation** (:mod:`dd_sglang.prefetch.speculators`): each sparse row
   whose selector reads a speculated query (``spec_host``) asks its speculator
   for ``x̂_{t+1}``. The proposal is appended to the batch
   as a second query position of that request (``forward_batch.input_ids`` /
   ``positions`` grow by one entry per proposal; ``batch_size`` does not). Its
   K/V is never written to the KV cache; at each layer it attends over its
   request's resident and critical sets, the current token, and itself. The
   logits hook (``patches/layers_logits_processor.py``) records its argmax and
   cuts its logits before sampling (:func:`cut_speculated_logits`).
2. **Critical set per row and layer**, by the request's selector
   (:mod:`dd_sglang.prefetch.selectors`): every candidate when there are at
   most ``k``; ``oracle``: exact top-k of the current query (synchronous);
   ``quest_device``: pages by device-resident min/max summaries (synchronous);
   ``spec_host`` / ``recency`` (lookahead): the set fixed during the previous
   step, whose K/V the transfer schedule (:mod:`dd_sglang.prefetch.schedule`)
   copied into the layer ring (:mod:`dd_sglang.kvcache.layer_buffers`) while
   earlier layers computed; the layer waits only for its own copy. Each
   lookahead layer then queues the selection of the next step's set on the
   select worker: ``recency`` scores the current query; ``spec_host`` the
   speculated position's query, or, when that token is not confident and
   ``prefetch.blend`` is on, the max of the speculated and the current query's
   scores (same budget k).
3. **Misses** (lookahead rows whose speculated token was rejected):
   ``use_prefetched`` attends over what arrived; ``repair`` adds, per layer and
   KV head, the ``repair_budget`` best candidates of the real query that were
   not prefetched, gathered synchronously. Both are counted.
4. **Hit rate** on a sampled fraction of (request, step)s: the exact top-k of
   the real query, recall (``hits / k``) and attention-mass coverage of the
   prefetched set.

Mixed batches: the new token's K/V of every row is written to the device pool
once; with the ``torch_native`` delegate the dense rows run as a sub-batch, with
any other delegate the dense backend runs on the real rows of the whole batch
(it planned them in ``init_forward_metadata``) and the sparse rows' outputs are
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
from dd_sglang.kvcache.layer_buffers import LayerRingBuffer
from dd_sglang.kvcache.params import SparseParams
from dd_sglang.kvcache.sparse_runtime import SparseRuntime
from dd_sglang.prefetch.params import PrefetchParams
from dd_sglang.prefetch.schedule import LayerTiming, TransferSchedule
from dd_sglang.prefetch.selectors import (
    SELECTORS,
    OracleSelector,
    QuestDeviceSelector,
    gqa_token_scores,
    quest_page_summaries,
    quest_select,
)
from dd_sglang.prefetch.speculators import SPECULATORS, SpecState, verify

__all__ = [
    "BackendEvents",
    "DualDecoderAttnBackend",
    "PrefetchParams",
    "SparseParams",
    "SparseRowPlan",
    "cut_speculated_logits",
    "plan_sparse_row",
]


@dataclass
class SparseRowPlan:
    """One sparse decode row of a step.

    Attributes:
        row: the row's index in the batch.
        dev_pos: ``[R]`` int64 resident positions (sorted); ``dev_slots``: their device slots.
        cand_pos: ``[C]`` int64 host-tier positions outside the resident set (sorted);
            ``cand_slots``: their host-tier slots.
        st: the request's :class:`~dd_sglang.kvcache.sparse_runtime.SparseRequest`.
        spec_index: index of the request's speculated (second) position in the step's
            token list, or None.
        rejected: the token speculated last step was not the real one.
        sampled: this (request, step) measures the prefetch hit rate.
        ring_row: the request's row in the layer ring, or None (nothing prefetched).
        spec_confident: the speculated token is the argmax after a verified context
            (``dual_token`` after an accepted speculation).
    """

    row: int
    dev_pos: torch.Tensor
    dev_slots: torch.Tensor
    cand_pos: torch.Tensor
    cand_slots: torch.Tensor
    st: object = None
    spec_index: int | None = None
    rejected: bool = False
    sampled: bool = False
    ring_row: int | None = None
    spec_confident: bool = False


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


class BackendEvents:
    """What the backend reports (the plugin turns it into Prometheus metrics); no-ops here."""

    def sparse_rows(self, n: int) -> None:
        """``n`` (request, layer) rows were decoded sparsely."""

    def cold(self, selector: str) -> None:
        """A lookahead (request, layer) had no set fixed in advance and selected synchronously."""

    def prefetch(self, selector: str, speculator: str, layer: int, hits: int, lookups: int,
                 mass_prefetched: float, mass_top_k: float) -> None:  # fmt: skip
        """A sampled lookahead (request, layer): ``hits`` of ``lookups`` (= k x KV heads) exact
        top-k tokens were prefetched; softmax mass on the prefetched set and on the exact top-k."""

    def speculation(self, speculator: str, accepted: bool) -> None:
        """A request's speculated token was checked against the real one."""

    def miss(self, policy: str, repaired_tokens: int) -> None:
        """A lookahead (request, layer) ran after a rejected speculation under ``policy``."""

    def transfer(self, timings: list[LayerTiming]) -> None:
        """The transfer schedule finished a step (per-layer timestamps)."""


_NO_EVENTS = BackendEvents()


@dataclass
class _SpecLayout:
    batch_size: int
    states: list[SpecState]


#: The decode forward in flight whose batch carries speculated positions (one per process).
_pending_spec: _SpecLayout | None = None


def cut_speculated_logits(output) -> None:
    """Drop the speculated positions' rows from a ``LogitsProcessorOutput``, keeping their argmax.

    Called by the ``LogitsProcessor.forward`` hook after every logits computation; a no-op
    unless the forward in flight carried speculated positions (then ``next_token_logits`` is
    ``[batch_size + n_spec, vocab]`` and becomes ``[batch_size, vocab]``; each speculated
    position's argmax is stored in its request's :class:`SpecState` for ``dual_token``).
    """
    global _pending_spec
    layout, _pending_spec = _pending_spec, None
    logits = getattr(output, "next_token_logits", None)
    if layout is None or logits is None:
        return
    n, extra = layout.batch_size, len(layout.states)
    if logits.shape[0] != n + extra:
        return
    for state, tok in zip(layout.states, logits[n:].argmax(dim=-1).tolist(), strict=True):
        state.argmax = int(tok)
    output.next_token_logits = logits[:n]
    hs = getattr(output, "hidden_states", None)
    if isinstance(hs, torch.Tensor) and hs.shape[0] == n + extra:
        output.hidden_states = hs[:n]


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
        prefetch: :class:`PrefetchParams` (speculation, transfer depth, miss policy, sampling).
        events: :class:`BackendEvents` receiver (metrics).

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
        prefetch: PrefetchParams | None = None,
        events: BackendEvents | None = None,
    ):
        super().__init__()
        self.dense = dense
        self.token_to_kv_pool = token_to_kv_pool
        self.req_to_token = req_to_token
        self.params = params
        self.runtime = runtime
        self.prefetch = prefetch or PrefetchParams()
        self.events = events or _NO_EVENTS
        self._exact = OracleSelector()  # exact top-k, the scoring every lookahead selector starts from
        self._speculators = {name: cls() for name, cls in SPECULATORS.items()}
        try:
            from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

            self._sub_batch_ok = isinstance(dense, TorchNativeAttnBackend)
        except ImportError:  # pragma: no cover - the module ships with SGLang
            self._sub_batch_ok = False
        k0 = token_to_kv_pool.get_key_buffer(getattr(token_to_kv_pool, "start_layer", 0))
        self.ring = LayerRingBuffer(self.prefetch.depth, k0.device, k0.dtype)
        self.schedule = TransferSchedule(self.ring, on_step=self.events.transfer)
        # Per-step plan, made once in init_forward_metadata (host syncs happen there, not per layer).
        self._plans: list[SparseRowPlan] = []
        self._ring_plans: list[SparseRowPlan] = []
        self._ring_layers: set[int] = set()
        self._dense_rows: list[int] = []
        self._dense_batch = None
        self._rt: SparseRuntime | None = None
        self._bs = 0
        self._samples = 0  # (request, step)s seen, for the hit-rate sampling

    def __getattr__(self, name):
        return getattr(self.__dict__["dense"], name)

    # ------------------------------------------------------------------ per step
    def init_forward_metadata(self, forward_batch) -> None:
        """Plan the step: sparse rows, speculated positions, and the prefetch copies (module docstring)."""
        global _pending_spec
        _pending_spec = None
        self.dense.init_forward_metadata(forward_batch)
        self._plans, self._ring_plans, self._dense_rows, self._dense_batch = [], [], [], None
        self._ring_layers = set()
        rt = self._rt = self.runtime()
        if rt is None or not forward_batch.forward_mode.is_decode() or not rt.by_pool:
            self.schedule.end_step()
            return
        seq_lens = forward_batch.seq_lens.tolist()
        pool_idx = forward_batch.req_pool_indices.tolist()
        for i, (pidx, n) in enumerate(zip(pool_idx, seq_lens, strict=True)):
            st = rt.sparse_request(int(pidx))
            if st is None:
                self._dense_rows.append(i)
            else:
                self._plans.append(plan_sparse_row(i, int(n), st, self.req_to_token[int(pidx)]))
        if not self._plans:
            self.schedule.end_step()
            self.ring.release()
            rt.ring_buffer_bytes = 0
            return
        self._bs = forward_batch.batch_size
        if self._dense_rows and self._sub_batch_ok:
            self._dense_batch = self._sub_batch(forward_batch, self._dense_rows)
        self._speculate(forward_batch)
        self._plan_prefetch(rt)

    def _speculate(self, fb) -> None:
        """Verify last step's speculated tokens, propose this step's, append them to the batch."""
        global _pending_spec
        bs = self._bs
        ids = fb.input_ids[:bs].tolist()
        positions = fb.positions[:bs].tolist()
        tokens, pos, states = [], [], []
        for p in self._plans:
            st = p.st
            if not SELECTORS[st.selector].uses_speculator:
                continue  # only spec_host reads the speculated position: no extra token for the others
            if st.spec is None:
                st.spec = SpecState()
            x = int(ids[p.row])
            ok = verify(st.spec, x)
            if ok is not None:
                self.events.speculation(st.speculator, ok)
            p.rejected = ok is False
            p.spec_confident = ok is True and st.speculator == "dual_token"
            tok = self._speculators[st.speculator].propose(_history(st, x), st.spec)
            st.spec.riding, st.spec.argmax = tok, None
            if tok is not None:
                p.spec_index = bs + len(tokens)
                tokens.append(tok)
                pos.append(int(positions[p.row]) + 1)
                states.append(st.spec)
        if tokens:
            fb.input_ids = torch.cat(
                [
                    fb.input_ids[:bs],
                    torch.tensor(tokens, dtype=fb.input_ids.dtype, device=fb.input_ids.device),
                ]
            )
            fb.positions = torch.cat(
                [fb.positions[:bs], torch.tensor(pos, dtype=fb.positions.dtype, device=fb.positions.device)]
            )
            _pending_spec = _SpecLayout(bs, states)

    def _plan_prefetch(self, rt: SparseRuntime) -> None:
        """Take the sets fixed last step and queue their copies, ``depth`` layers ahead."""
        self.schedule.drain_select()  # last step's selections are the indices copied now
        f = self.prefetch.hit_rate_sample
        for p in self._plans:
            st = p.st
            st.prefetched, st.next_prefetched = st.next_prefetched, {}
            self._samples += 1
            p.sampled = int(self._samples * f) > int((self._samples - 1) * f)
            if SELECTORS[st.selector].lookahead and st.prefetched and p.cand_pos.numel() > st.top_k:
                p.ring_row = len(self._ring_plans)
                self._ring_plans.append(p)
                self._ring_layers.update(st.prefetched)
        if not self._ring_plans:
            self.schedule.end_step()
            self.ring.release()
            rt.ring_buffer_bytes = 0
            return
        hkv, d = rt.host.k.shape[2], rt.host.k.shape[3]
        self.ring.reserve(len(self._ring_plans), hkv, max(p.st.top_k for p in self._ring_plans), d)
        rt.ring_buffer_bytes = self.ring.nbytes
        host_k, host_v = rt.host.k, rt.host.v
        heads = torch.arange(hkv).unsqueeze(1)
        plans = list(self._ring_plans)
        non_blocking = self.ring.device.type == "cuda"

        def gather(layer: int, k_slot: torch.Tensor, v_slot: torch.Tensor) -> None:
            for p in plans:
                pos = p.st.prefetched.get(layer)
                if pos is None:
                    continue
                slots = p.st.host_slots[pos]  # [Hkv, k]
                n = pos.shape[1]
                k_slot[p.ring_row, :, :n].copy_(host_k[layer][slots, heads], non_blocking=non_blocking)
                v_slot[p.ring_row, :, :n].copy_(host_v[layer][slots, heads], non_blocking=non_blocking)

        self.schedule.begin_step(sorted(self._ring_layers), gather)

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

    # ------------------------------------------------------------------ per layer
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
        hkv = layer.tp_k_head_num
        bs = self._bs
        q2 = q.reshape(-1, hq * d)
        k3 = k.reshape(-1, hkv, d) if k is not None else None
        v3 = v.reshape(-1, hkv, dv) if v is not None else None
        if save_kv_cache and k3 is not None and v3 is not None:
            loc = KVWriteLoc(forward_batch.out_cache_loc, getattr(self.dense, "swa_out_cache_loc", None))
            self.token_to_kv_pool.set_kv_buffer(layer, loc, k3[:bs], v3[:bs])
        out = q2.new_empty((q2.shape[0], hq * dv))
        if self._dense_rows and self._dense_batch is not None:
            rows = torch.tensor(self._dense_rows, dtype=torch.int64, device=q2.device)
            out[rows] = self.dense.forward_decode(
                q2[rows], None, None, layer, self._dense_batch, save_kv_cache=False
            )
        elif self._dense_rows:
            out[:bs] = self.dense.forward_decode(
                q2[:bs], k3[:bs], v3[:bs], layer, forward_batch, save_kv_cache=False, **kwargs
            )
        q3 = q2.view(-1, hq, d)
        sparse_rows = [p.row for p in self._plans]
        keys, values = self._gather(q3, layer)
        out3 = out.view(-1, hq, dv)
        out3[sparse_rows] = sparse_decode_attention(q3[sparse_rows], keys, values, layer.scaling).to(
            out.dtype
        )
        spec = [(i, p.spec_index) for i, p in enumerate(self._plans) if p.spec_index is not None]
        if spec:
            # The speculated position attends over its request's tokens, then itself (position order).
            ks = [torch.cat([keys[i], k3[j].unsqueeze(1).to(keys[i].device)], dim=1) for i, j in spec]
            vs = [torch.cat([values[i], v3[j].unsqueeze(1).to(values[i].device)], dim=1) for i, j in spec]
            idx = [j for _, j in spec]
            out3[idx] = sparse_decode_attention(q3[idx], ks, vs, layer.scaling).to(out.dtype)
        self.events.sparse_rows(len(sparse_rows))
        return out

    def _gather(self, q3: torch.Tensor, layer) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per sparse row: ``[Hkv, n, D]`` K and V of resident ∪ critical set, in position order.

        ``q3``: ``[num_tokens, Hq, D]``, the real rows then the speculated positions.
        """
        rt = self._rt
        pool = self.token_to_kv_pool
        lid = layer.layer_id
        hl = lid - getattr(pool, "start_layer", 0)
        k_buf, v_buf = pool.get_key_buffer(lid), pool.get_value_buffer(lid)
        host_k, host_v = rt.host.k[hl], rt.host.v[hl]
        hkv = k_buf.shape[1]
        heads = torch.arange(hkv).unsqueeze(1)
        q_host = q3.detach().to("cpu")
        ring = None
        if hl in self._ring_layers:
            ring = self.schedule.wait(hl)
        keys, values, sync_bytes = [], [], 0
        for p in self._plans:
            st = p.st
            c, k = p.cand_pos.numel(), st.top_k
            lookahead = SELECTORS[st.selector].lookahead
            qi = q_host[p.row]
            kc = vc = None
            if c <= k:
                idx = torch.arange(c).unsqueeze(0).expand(hkv, c)
                pos = p.cand_pos[idx]
            elif lookahead and p.ring_row is not None and ring is not None and hl in st.prefetched:
                prev = st.prefetched[hl]
                kc = ring[0][p.ring_row, :, : prev.shape[1]]
                vc = ring[1][p.ring_row, :, : prev.shape[1]]
                pos, kc, vc = self._check_prefetched(p, qi, hl, prev, kc, vc, host_k, host_v, layer.scaling)
            elif st.selector == QuestDeviceSelector.name:
                pos = p.cand_pos[self._quest(p, q3, hl, host_k, k_buf.device)]
            else:  # oracle, or a lookahead selector with nothing fixed in advance (a cold start)
                if lookahead:
                    self.events.cold(st.selector)
                idx = self._exact.select(qi[None], [p.cand_slots], k, host_k, layer.scaling).positions[0]
                pos = p.cand_pos[idx]
            if lookahead and c > k:
                self._queue_next_selection(p, q_host, hl, host_k, layer.scaling)
            if kc is None:
                slots = st.host_slots[pos]  # [Hkv, k]
                kc, vc = host_k[slots, heads], host_v[slots, heads]  # a synchronous gather
                sync_bytes += kc.nbytes + vc.nbytes
            kd = k_buf[p.dev_slots].permute(1, 0, 2)
            vd = v_buf[p.dev_slots].permute(1, 0, 2)
            all_pos = torch.cat([p.dev_pos.unsqueeze(0).expand(hkv, -1), pos], dim=1)
            order = all_pos.argsort(dim=1).unsqueeze(-1).to(kd.device)
            kk = torch.cat([kd, kc.to(kd.device)], dim=1)
            vv = torch.cat([vd, vc.to(vd.device)], dim=1)
            keys.append(kk.gather(1, order.expand(-1, -1, kk.shape[2])))
            values.append(vv.gather(1, order.expand(-1, -1, vv.shape[2])))
        if ring is not None:
            self.schedule.done(hl)
        rt.critical_buffer_bytes = sync_bytes + self.ring.nbytes
        return keys, values

    def _check_prefetched(self, p, qi, hl, pos, kc, vc, host_k, host_v, scale):
        """Hit-rate sampling and miss handling for one prefetched (request, layer)."""
        st = p.st
        k = pos.shape[1]
        policy = st.miss_policy or self.prefetch.miss_policy
        repair = p.rejected and policy == "repair"
        hkv = pos.shape[0]
        if p.sampled or repair:
            scores = gqa_token_scores(qi, host_k.index_select(0, p.cand_slots), scale)  # [Hkv, C]
            have = torch.searchsorted(p.cand_pos, pos)  # prefetched positions are candidates
        if p.sampled:
            top = scores.topk(k, dim=-1)
            hits = sum(int(torch.isin(have[h], top.indices[h]).sum()) for h in range(hkv))
            spec = st.speculator if SELECTORS[st.selector].uses_speculator else "none"
            self.events.prefetch(
                st.selector, spec, hl, hits, hkv * k,
                float(scores.gather(1, have).sum()), float(top.values.sum()),
            )  # fmt: skip
        if not repair:
            if p.rejected:
                self.events.miss(policy, 0)
            return pos, kc, vc
        r = min(self.prefetch.repair_budget, p.cand_pos.numel() - k)
        missing = scores.scatter(1, have, float("-inf")).topk(r, dim=-1).indices  # [Hkv, r]
        extra = p.cand_pos[missing]
        slots = st.host_slots[extra]
        heads = torch.arange(hkv).unsqueeze(1)
        kx = host_k[slots, heads].to(kc.device)
        vx = host_v[slots, heads].to(vc.device)
        self.events.miss("repair", hkv * r)
        return torch.cat([pos, extra], dim=1), torch.cat([kc, kx], dim=1), torch.cat([vc, vx], dim=1)

    def _queue_next_selection(self, p, q_host, hl, host_k, scale) -> None:
        """Queue the choice of this (request, layer)'s next-step set on the select worker."""
        st = p.st
        use_spec = SELECTORS[st.selector].uses_speculator and p.spec_index is not None
        if use_spec and self.prefetch.blend and not p.spec_confident:
            q = q_host[[p.spec_index, p.row]].clone()  # unconfident: speculated and current query together
        else:
            q = q_host[[p.spec_index if use_spec else p.row]].clone()
        slots, cand, k = p.cand_slots, p.cand_pos, st.top_k

        def select() -> None:
            keys = host_k.index_select(0, slots)
            scores = torch.stack([gqa_token_scores(qi, keys, scale) for qi in q]).amax(dim=0)  # [Hkv, C]
            st.next_prefetched[hl] = cand[scores.topk(k, dim=-1).indices]

        self.schedule.submit_select(select)

    def _quest(self, p, q3, hl, host_k, device) -> torch.Tensor:
        """``quest_device``: ``[Hkv, k]`` candidate indices from page summaries kept on the device."""
        st = p.st
        page = QuestDeviceSelector.PAGE_SIZE
        c = p.cand_pos.numel()
        mins, maxs, covered = st.aux.get(hl, (None, None, 0))
        if covered < c:  # extend the summaries with the candidates flushed since (the last page is redone)
            first = covered // page
            lo, hi = quest_page_summaries(host_k.index_select(0, p.cand_slots[first * page :]), page)
            lo, hi = lo.to(device), hi.to(device)
            if mins is not None and first:
                lo, hi = torch.cat([mins[:first], lo]), torch.cat([maxs[:first], hi])
            mins, maxs = lo, hi
            st.aux[hl] = (mins, maxs, c)
        return quest_select(q3[p.row], mins, maxs, c, st.top_k, page).cpu()


def _history(st, token: int) -> list[int]:
    """The request's token ids up to and including the current ``token``."""
    req = st.req
    ids = [] if req is None else list(req.origin_input_ids) + list(req.output_ids)
    if not ids or ids[-1] != token:
        ids.append(token)
    return ids
