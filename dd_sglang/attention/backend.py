"""The ``dualdecoder`` attention backend (``--attention-backend dualdecoder``).

* Prefill / extend, and decode rows of requests that are not ``DECODE_SPARSE``:
  the platform's dense backend (``torch_native`` on CPU; the CUDA platform's
  default, e.g. FlashInfer, on GPU).
* Decode rows of ``DECODE_SPARSE`` requests (their KV lives in the host tier,
  their device slots are released down to the resident set,
  :mod:`dd_sglang.kvcache.sparse_runtime`): the plan/run split of
  :mod:`dd_sglang.prefetch`:

  - ``init_forward_metadata`` (once per step): the prefetch layer builds the
    step's immutable :class:`~dd_sglang.prefetch.plan.StepPlan` (sparse rows,
    resident slots, speculated positions appended to the batch, each row's
    critical-set source, the gather indices) and starts the layer copies; the
    plan rides on the batch inside ``forward_batch.dd_step`` (:class:`~dd_sglang.attention.step.DecodeStep`).
  - ``forward_decode`` (per layer): write the new K/V, run the dense rows, get
    the layer's inputs from the runner (its device profile's chooser, source and
    attender, :mod:`dd_sglang.prefetch.profile`), one sparse attention call for
    every sparse row (the fused C kernel on a CPU; FlashInfer on CUDA), hand the
    layer back (next-step selection is queued there).

With ``top_k`` at least the context, a sparse row attends to its whole context
(gathered from the host tier like any critical set) through dense's own attention
call, and its greedy tokens equal the dense path's.

Mixed batches: every real row's new K/V is written to the device pool once;
the dense backend is planned and run on the dense rows alone, as a sub-batch
(:func:`~dd_sglang.attention.step.dense_sub_batch`; under SGLang's KV index
translator the sub-batch gets its own ``KVLocPlan``, built by
``KVIndexTranslator.own_plan`` from its fields), so it never attends a sparse
row's context; a step whose rows are all sparse does not plan it at all.

Not supported with sparse rows: CUDA graphs and overlap scheduling (the
launcher turns both off with this backend), mixed chunked prefill (rejected at
start), cross-attention layers (encoder-decoder models: the dense backend is
planned on the dense rows' sub-batch, not on the batch such a layer reads). This backend has not been run on a GPU.
"""

from __future__ import annotations

import time

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from dd_sglang.attention.extend import extend_after_prefix, host_prefixes, skips_prefix_queries
from dd_sglang.attention.step import BackendEvents, DecodeStep, dense_sub_batch, finish_step
from dd_sglang.kernels.sparse_decode import dense_decode_attention
from dd_sglang.kvcache.dualpath import PathState
from dd_sglang.kvcache.params import SparseParams
from dd_sglang.kvcache.sparse_runtime import SparseRuntime
from dd_sglang.prefetch.params import PrefetchParams
from dd_sglang.prefetch.runner import SparseStepRunner

__all__ = ["BackendEvents", "DualDecoderAttnBackend", "PrefetchParams", "SparseParams", "dualdecoder_backends",
           "finish_step"]


def dualdecoder_backends(model_runner) -> list[DualDecoderAttnBackend]:
    """The :class:`DualDecoderAttnBackend` instances SGLang's ``ModelRunner`` ``model_runner`` built.

    Looks at ``attn_backend`` and ``decode_attn_backend`` and, one level down, at the halves of a
    ``HybridAttnBackend`` (``prefill_backend``/``decode_backend``) and a ``TboAttnBackend``
    (``primary``/``children``); SGLang file ``model_executor/model_runner_components/attention_backend_setup.py``.
    """
    found: list[DualDecoderAttnBackend] = []
    for top in (getattr(model_runner, "attn_backend", None), getattr(model_runner, "decode_attn_backend", None)):
        parts = [top, getattr(top, "prefill_backend", None), getattr(top, "decode_backend", None),
                 getattr(top, "primary", None), *(getattr(top, "children", None) or ())]  # fmt: skip
        for b in parts:
            if isinstance(b, DualDecoderAttnBackend) and all(b is not f for f in found):
                found.append(b)
    return found


class DualDecoderAttnBackend(AttentionBackend):
    """SGLang attention backend: dense delegate plus the sparse rows of the prefetch layer's plan.

    Args:
        dense: the platform's dense backend instance (an SGLang ``AttentionBackend``).
        token_to_kv_pool: SGLang's device KV pool (``get_key_buffer(layer_id)``, ``set_kv_buffer``).
        req_to_token: ``[max_reqs, max_context_len]`` int32 map from request row and
            position to device KV slot (``ReqToTokenPool.req_to_token``).
        params: :class:`SparseParams`.
        runtime: this process's :class:`SparseRuntime`, or None until the radix-cache factory
            hands it over (:meth:`attach_runtime`; SGLang builds the attention backend before the
            radix cache). Without one every step is dense.
        prefetch: :class:`PrefetchParams`.
        events: :class:`BackendEvents` receiver (metrics).
        q_heads: query heads per layer on this rank (``ModelConfig.get_max_num_attention_heads() //
            attn_tp_size``, as SGLang's FlashInfer backend plans); None: unknown (the fused C attention is
            then not used).
        kv_index_translator: SGLang's ``ModelRunner.kv_index_translator`` (the dense sub-batch's own
            ``KVLocPlan``), or None.

    Attributes not defined here (CUDA-graph hooks and the like) are served by the dense backend.
    """

    def __init__(
        self,
        dense,
        token_to_kv_pool,
        req_to_token: torch.Tensor,
        params: SparseParams,
        runtime: SparseRuntime | None = None,
        prefetch: PrefetchParams | None = None,
        events: BackendEvents | None = None,
        q_heads: int | None = None,
        kv_index_translator=None,
    ):
        super().__init__()
        self.dense = dense
        self.token_to_kv_pool = token_to_kv_pool
        self.req_to_token = req_to_token
        self.params = params
        self.runtime = runtime
        self.prefetch = prefetch or PrefetchParams()
        self.events = events or BackendEvents()
        self.runner: SparseStepRunner | None = None
        self.q_heads = q_heads
        self.kv_index_translator = kv_index_translator
        try:
            from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

            self._torch_native = isinstance(dense, TorchNativeAttnBackend)
        except ImportError:  # pragma: no cover - the module ships with SGLang
            self._torch_native = False

    def __getattr__(self, name):
        return getattr(self.__dict__["dense"], name)

    def attach_runtime(self, runtime: SparseRuntime) -> None:
        """Hand over the process's :class:`SparseRuntime` (called once, by the radix-cache factory,
        ``patches/mem_cache_registry.py``, as SGLang's own factory hands HiCache's layer counter to
        the model worker)."""
        self.runtime = runtime

    def _runner_for(self, rt: SparseRuntime) -> SparseStepRunner:
        """The runner over ``rt``'s host tier, built once (wired to the runtime's release callback)."""
        if self.runner is None or self.runner.host is not rt.host:
            layer0 = getattr(self.token_to_kv_pool, "start_layer", 0)
            k0, v0 = self.token_to_kv_pool.get_key_buffer(layer0), self.token_to_kv_pool.get_value_buffer(layer0)
            self.runner = SparseStepRunner(rt.host, k0.device, k0.dtype, self.req_to_token, self.prefetch,
                                           self.events, q_heads=self.q_heads,
                                           pool_contiguous=k0.is_contiguous() and v0.is_contiguous())  # fmt: skip
            rt.add_release_listener(self.runner.release)
        return self.runner

    # ------------------------------------------------------------------ per step
    def init_forward_metadata(self, forward_batch) -> None:
        """Plan the step (module docstring): the sparse rows' plan, then the dense backend over the
        dense rows only (the whole batch on a step without sparse rows, nothing when every row is sparse)."""
        if self.runner is not None:  # prefill or dense decode: the forward's own thread count
            self.runner.split_threads(False)
        forward_batch.dd_step = None
        if not forward_batch.forward_mode.is_decode():
            self.dense.init_forward_metadata(forward_batch)
            self._release_ring_when_no_sparse_request()
            return
        started = time.perf_counter()
        plan = self._plan_sparse_rows(forward_batch)
        step = DecodeStep(plan, None, None, self.events, started)
        if plan is None:
            self.dense.init_forward_metadata(forward_batch)
        elif plan.num_rows < forward_batch.batch_size:
            step.dense_rows, step.dense_batch = dense_sub_batch(forward_batch, plan.rows.tolist(),
                                                                self.kv_index_translator)  # fmt: skip
            self.dense.init_forward_metadata(step.dense_batch)
        forward_batch.dd_step = step

    def _plan_sparse_rows(self, forward_batch):
        """The runner's plan of the step's sparse rows (None: none), and the bytes it holds published."""
        rt = self.runtime
        if rt is None or not rt.by_pool:
            if self.runner is not None:
                self.runner.end_step()
                self.runner.ring.release()
                if rt is not None:
                    rt.buffers.clear_ring()
            return None
        runner = self._runner_for(rt)
        plan = runner.plan(forward_batch, rt)
        rt.buffers.ring_buffer_bytes = runner.ring.nbytes
        rt.buffers.critical_buffer_bytes = runner.critical_bytes(plan)
        rt.buffers.selector_aux = runner.aux_bytes()
        rt.buffers.host_index_bytes = runner.host_index_bytes()
        return plan

    def _release_ring_when_no_sparse_request(self) -> None:
        """A prefill with no request decoding sparsely: give the layer ring back (it is sized to
        the largest batch since the last release, so an idle server holds none of it)."""
        rt = self.runtime
        if self.runner is None or rt is None or self.runner.ring.k is None:
            return
        if any(st.path.state is PathState.DECODE_SPARSE for st in rt.by_pool.values()):
            return
        self.runner.end_step()
        self.runner.ring.release()
        rt.buffers.clear_ring()

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
        own, hosted = self._own_extend(layer, forward_batch)
        if own:
            return extend_after_prefix(self, q, k, v, layer, forward_batch, save_kv_cache, hosted)
        return self.dense.forward(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        own, hosted = self._own_extend(layer, forward_batch)
        if own:
            return extend_after_prefix(self, q, k, v, layer, forward_batch, save_kv_cache, hosted)
        return self.dense.forward_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)

    def _own_extend(self, layer, fb) -> tuple[bool, dict | None]:
        """Whether this backend runs extend batch ``fb`` itself (:func:`extend_after_prefix`): a request
        of it reads its prefix from the host tier (:func:`host_prefixes`, returned too), or the
        ``torch_native`` delegate would recompute cached query rows (:func:`skips_prefix_queries`)."""
        hosted = host_prefixes(self, fb)
        return hosted is not None or (self._torch_native and skips_prefix_queries(layer, fb)), hosted

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        step = getattr(forward_batch, "dd_step", None)
        t0 = time.perf_counter()
        if step is None or step.plan is None or layer.is_cross_attention:
            out = self.dense.forward_decode(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
            if step is not None:
                step.attention_s += time.perf_counter() - t0
            return out
        plan = step.plan
        hq, d, dv, hkv = layer.tp_q_head_num, layer.qk_head_dim, layer.v_head_dim, layer.tp_k_head_num
        bs = plan.batch_size
        q3 = q.reshape(-1, hq, d)
        k3 = k.reshape(-1, hkv, d) if k is not None else None
        v3 = v.reshape(-1, hkv, dv) if v is not None else None
        if save_kv_cache and k3 is not None and v3 is not None:
            loc = KVWriteLoc(forward_batch.out_cache_loc, getattr(self.dense, "swa_out_cache_loc", None))
            self.token_to_kv_pool.set_kv_buffer(layer, loc, k3[:bs], v3[:bs])
        out = q3.new_empty((q3.shape[0], hq, dv))
        if step.dense_rows is not None:
            self._dense_rows(step, q3, k3, v3, out, layer, forward_batch, **kwargs)
        lid = layer.layer_id
        hl = lid - getattr(self.token_to_kv_pool, "start_layer", 0)
        runner = self.runner
        x = runner.layer_inputs(
            plan, hl, q3, k3, v3,
            self.token_to_kv_pool.get_key_buffer(lid), self.token_to_kv_pool.get_value_buffer(lid),
            layer.scaling,
        )  # fmt: skip
        t1 = time.perf_counter()
        runner.attend(plan, q3, x, out, layer.scaling)
        for b, kb, vb in runner.exact_contexts(plan, x):  # set = whole context: dense's own call
            out[b] = dense_decode_attention(q3[b], kb, vb, layer.scaling).to(out.dtype)
        step.attention_s += time.perf_counter() - t1
        step.sparse_layers += 1
        runner.layer_done(plan, hl, q3, layer.scaling)
        return out.view(-1, hq * dv)

    def _dense_rows(self, step: DecodeStep, q3, k3, v3, out, layer, fb, **kwargs) -> None:
        """The dense rows' attention, by the dense backend over their sub-batch (their K/V already written)."""
        t0 = time.perf_counter()
        rows = step.dense_rows
        o = self.dense.forward_decode(q3[rows].reshape(rows.numel(), -1), None, None, layer, step.dense_batch,
                                      save_kv_cache=False)  # fmt: skip
        out[rows] = o.view(rows.numel(), q3.shape[1], -1)
        step.attention_s += time.perf_counter() - t0
