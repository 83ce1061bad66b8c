"""Runs a :class:`~dd_sglang.prefetch.plan.StepPlan` layer by layer.

The attention backend calls, per decode step and layer::

    plan = runner.plan(forward_batch, runtime)        # once per step (init_forward_metadata)
    q, K, V = runner.layer_inputs(plan, ...)          # per layer, before attention
    ...one sparse attention call over every sparse row...
    runner.layer_done(plan, layer, q3)                # per layer, after attention

``layer_inputs`` (forward thread, no Python loop over rows or heads):

1. waits for the layer's copy (the transfer schedule gathered the fixed rows'
   critical-set K/V from the host tier into the layer's ring slot, ``depth``
   layers ahead, :mod:`dd_sglang.prefetch.schedule`);
2. selects and gathers the *sync* rows' sets (one selector call per selector
   in the batch), and verifies the *ahead* rows' prefetched sets against the
   real query's own (:mod:`dd_sglang.prefetch.verify`):
   the tokens the prediction missed replace the ones it should not have
   fetched, copied synchronously, so each layer attends the set ``host_sync``
   would choose;
3. gathers the resident set from the device pool (one index per K and V) and
   writes each speculated position's own K/V into its column;
4. returns the folded queries and the slot's K/V (the step's mask, ``plan.layout.mask``, says which
   columns each query reads).

With ``experimental.transfer`` ``in_place`` nothing is copied in step 1, nor for the sync rows
and verified sets in step 2: the fused C attention reads the critical sets from the host tier
by slot (:mod:`dd_sglang.prefetch.in_place`). On the CPU fast path steps 3 and 4 are single
indexed copies (:mod:`dd_sglang.prefetch.layer_assembly`).

``exact_contexts`` then gives, per *exact* row (a full row: its set is its whole
context), that context's K/V in position order, laid out as SGLang's dense
decode reads them, for :func:`~dd_sglang.kernels.sparse_decode.dense_decode_attention`.

``layer_done`` hands the slot back (the next copy reuses it) and hands this layer's queries
to the next step's selection (:mod:`dd_sglang.prefetch.ahead_selection`: inline in chunks of
layers, or on the select worker) and to the sampled hit-rate measurement
(:mod:`dd_sglang.prefetch.hit_rate`).

Every per-step choice (in place or copied, inline or worker selection, the C kernel or
PyTorch, the fast path) is made when the runner is built or when the step's plan is, and is
held by the collaborator that carries it out; per layer only what may differ between layers
is tested (whether the fused C attention takes the layer's dtypes and layouts).

The runner owns the prefetch layer's state: per-request prediction state
(:class:`~dd_sglang.prefetch.plan.PredictionStore`, released with the request),
the key indexes, the layer ring and the schedule.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from dd_sglang.kernels import native as native_kernel
from dd_sglang.kernels.sparse_decode import fold_gqa
from dd_sglang.kvcache.layer_buffers import LayerRingBuffer
from dd_sglang.prefetch.ahead_selection import SPLIT_MIN_ROWS, AheadSelection, selection_queries
from dd_sglang.prefetch.events import NO_EVENTS, PrefetchEvents, StepTally
from dd_sglang.prefetch.gather import RingGather, flat_rows
from dd_sglang.prefetch.hit_rate import HitRateProbe, StepBlocks
from dd_sglang.prefetch.in_place import InPlaceSets
from dd_sglang.prefetch.key_indexes import KeyIndexes
from dd_sglang.prefetch.layer_assembly import FastAssembly, fused_takes
from dd_sglang.prefetch.layer_rows import fixed_rows
from dd_sglang.prefetch.params import PrefetchParams
from dd_sglang.prefetch.plan import PlanInputs, StepPlan, build_step_plan
from dd_sglang.prefetch.schedule import TransferSchedule
from dd_sglang.prefetch.selectors import SELECTORS
from dd_sglang.prefetch.trace import AttentionTrace
from dd_sglang.prefetch.verify import LayerVerification

__all__ = ["PrefetchEvents", "SparseStepRunner", "use_native_kernel"]

logger = logging.getLogger(__name__)


def use_native_kernel(kernel: str) -> bool:
    """Whether ``spec_host``, ``host_sync`` and verification use the C kernel, for ``experimental.kernel`` = ``kernel``.

    Raises:
        RuntimeError: ``kernel`` is ``native`` and the kernel cannot be built here (the reason).
    """
    if kernel == "torch":
        return False
    if native_kernel.available():
        return True
    if kernel == "native":
        raise RuntimeError(f"experimental.kernel: native, but the CPU selection kernel is unavailable "
                           f"({native_kernel.unavailable_reason()}); use auto or torch")  # fmt: skip
    return False


def _split_threads(params: PrefetchParams, cpu: bool) -> tuple[int, int] | None:
    """``experimental.select`` ``split`` or ``auto`` on a CPU: the forward thread's intra-op thread
    count outside split steps (read here, on the forward thread) and inside them (1); None where
    no step splits (CUDA, ``worker``, ``inline``, or a single intra-op thread)."""
    threads = torch.get_num_threads()
    return (threads, 1) if cpu and params.select in ("split", "auto") and threads > 1 else None


class SparseStepRunner:
    """Plans and runs the sparse rows of every decode step (module docstring).

    Args:
        host: the host tier (``HostSparseKVPool``: ``k``/``v`` ``[layers, slots, Hkv, D]``).
        device: the device tier's device; ``dtype``: its KV dtype.
        req_to_token: ``[max_reqs, max_context_len]`` int32 (SGLang's ``ReqToTokenPool``).
        params: :class:`PrefetchParams`.
        events: :class:`PrefetchEvents` receiver.
        seed: hit-rate sampling seed.
    """

    def __init__(
        self,
        host,
        device: torch.device,
        dtype: torch.dtype,
        req_to_token: torch.Tensor,
        params: PrefetchParams,
        events: PrefetchEvents | None = None,
        seed: int = 0,
    ):
        device = torch.device(device)
        cpu = device.type != "cuda"
        self.host = host
        self.events = events or NO_EVENTS
        self.tally = StepTally()
        inline = params.transfer in ("inline", "in_place") or (params.transfer == "auto" and cpu)
        select_inline = params.select == "inline" or (params.select == "auto" and cpu)
        self.schedule = TransferSchedule(LayerRingBuffer(params.depth, device, dtype), on_step=self.events.transfer,
                                         inline=inline, select_inline=select_inline)  # fmt: skip
        native = use_native_kernel(params.kernel)
        self.gather = RingGather(host.k, host.v, device, params.gather, native)
        fast = self.gather.native and host.k.is_contiguous()  # gather.native: a CPU ring
        #: The CPU fast path (:mod:`~dd_sglang.prefetch.layer_assembly`), None elsewhere.
        self.assembly = FastAssembly(host.k.shape[2]) if fast else None
        self.in_place = InPlaceSets(host, self.ring, self.gather, self.tally,
                                    enabled=fast and host.v.is_contiguous()
                                    and (params.transfer == "in_place" or (params.transfer == "auto" and cpu)),
                                    always=params.transfer == "in_place")  # fmt: skip
        self._log_choices(inline, native, params.transfer)
        self.indexes = KeyIndexes(host.k, device, native, block_means=params.first_level_tokens is not None)
        self.inputs = PlanInputs.from_params(params, req_to_token, self.indexes.index, native, seed)
        self.ahead = AheadSelection(host, self.schedule, self.inputs.store, self.indexes, self.tally, self.events,
                                    _split_threads(params, cpu), 1 if params.select == "split" else SPLIT_MIN_ROWS)  # fmt: skip
        blocks = StepBlocks()
        host_sync = self.inputs.selectors["host_sync"]
        self.probe = HitRateProbe(host, self.indexes, host_sync, SELECTORS["oracle"](), native, self.events, blocks)
        #: Verification: the real query's set, chosen as ``host_sync`` chooses it, for every ahead row.
        self.verification = LayerVerification(host, host_sync, self.indexes, self.in_place, self.tally, blocks,
                                              self.probe.attended)  # fmt: skip
        #: Requests that asked for an attention trace (``dd_trace``; :mod:`dd_sglang.prefetch.trace`).
        self.trace = AttentionTrace(host)

    def _log_choices(self, inline: bool, native: bool, transfer: str) -> None:
        mode = "worker" if not inline else "in place" if self.in_place.enabled else "inline"
        if self.in_place.enabled and transfer == "auto":
            mode += " from 6 (row, KV head) pairs a step, else inline"
        logger.info("dd_sglang critical-set transfer: %s; selection kernel: %s", mode,
                    "C" if native else "PyTorch")  # fmt: skip

    # ------------------------------------------------------------------ state
    @property
    def fast(self) -> bool:
        """CPU with the C kernel: each layer's moves are single indexed copies over the rows of
        :mod:`~dd_sglang.prefetch.layer_rows`, built once per step."""
        return self.assembly is not None

    @property
    def ring(self) -> LayerRingBuffer:
        """The layer ring the step's critical sets are copied into (``[slots, rows, Hkv, columns, D]``)."""
        return self.schedule.ring

    @property
    def store(self):
        """The per-request :class:`~dd_sglang.prefetch.plan.PredictionStore`."""
        return self.inputs.store

    def index(self, location: str):
        """The key index at ``location`` (:meth:`KeyIndexes.index`)."""
        return self.indexes.index(location)

    def aux_bytes(self) -> dict[str, int]:
        """Device bytes of selection state by selector (``quest_device``'s device index)."""
        return self.indexes.aux_bytes()

    def host_index_bytes(self) -> int:
        """Host bytes of the int8 key index ``spec_host``, ``host_sync`` and verification read."""
        return self.indexes.host_index_bytes()

    def critical_bytes(self, plan: StepPlan | None) -> int:
        """Bytes of the ring's critical-set columns (every slot, reserved rows), K and V."""
        if plan is None or not self.ring.shape:
            return 0
        n_slots, rows, hkv, _, d = self.ring.shape
        return 2 * n_slots * rows * hkv * plan.layout.k * d * self.ring.dtype.itemsize

    def release(self, rid: str) -> None:
        """Drop a request's prediction state (the KV-cache runtime's release callback)."""
        self.store.release(rid)
        self.trace.release(rid)

    # ------------------------------------------------------------------ per step
    def plan(self, fb, rt) -> StepPlan | None:
        """Plan the step, make its choices and start its copies; None (and nothing queued) without sparse rows."""
        self.schedule.drain_select()  # last step's selections are read by this plan
        self.tally.flush(self.events)
        plan = build_step_plan(fb, rt, self.inputs, self.events.speculation)
        self.ahead.begin(plan)
        self.trace.begin(plan, rt, fb)
        if plan is None:
            self.schedule.end_step()
            self.ring.release()
            return None
        self.probe.attended.clear()
        self.ring.reserve(plan.num_rows, self.host.k.shape[2], plan.layout.columns, self.host.k.shape[3])
        self.in_place.begin(plan)
        if plan.n_fixed and self.in_place.table is None:
            self.schedule.begin_step(list(range(self.host.layer_num)), self._gather_fn(plan))
        else:
            self.schedule.end_step()
        self.events.phase("plan", time.perf_counter() - plan.started)
        return plan

    def split_threads(self, split: bool) -> None:
        """The forward thread's intra-op threads for the coming forward (:meth:`AheadSelection.split_threads`)."""
        self.ahead.split_threads(split)

    def _gather_fn(self, plan: StepPlan) -> Callable[[int, torch.Tensor, torch.Tensor], None]:
        """The copy of layer ``l``'s fixed rows (plan rows ``[0, n_fixed)``) into its ring slot."""
        if self.fast:
            return self._fast_gather_fn(plan)
        rows, c0, k = slice(0, plan.n_fixed), plan.layout.n_res, plan.layout.k
        gather, copied, n_slots = self.gather, self.events.copied, self.ring.n_slots

        def copy(layer: int, k_slot: torch.Tensor, v_slot: torch.Tensor) -> None:
            src = flat_rows(plan.fixed.slots[layer])
            copied(gather.copy(layer, src, k_slot, v_slot, rows, c0, k, layer % n_slots))

        return copy

    def _fast_gather_fn(self, plan: StepPlan) -> Callable[[int, torch.Tensor, torch.Tensor], None]:
        """:meth:`_gather_fn` on the fast path: every layer's source rows built here, once; one C
        call a layer."""
        hk, hv = self.host.k, self.host.v
        src, dst = fixed_rows(plan, hk.shape[2], self.ring.shape[1:])
        row_bytes = hk.shape[3] * hk.element_size()
        layer_bytes = hk.stride(0) * hk.element_size()
        kp, vp, nbytes = hk.data_ptr(), hv.data_ptr(), 2 * src.shape[1] * row_bytes
        tally = self.tally

        def copy(layer: int, k_slot: torch.Tensor, v_slot: torch.Tensor) -> None:
            native_kernel.gather_rows_unchecked(kp + layer * layer_bytes, vp + layer * layer_bytes, k_slot.data_ptr(),
                                                v_slot.data_ptr(), src[layer], dst, row_bytes)  # fmt: skip
            tally.copied += nbytes

        return copy

    # ------------------------------------------------------------------ per layer
    def layer_inputs(self, plan: StepPlan, layer: int, q3: torch.Tensor, k3: torch.Tensor,
                     v3: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, scale: float):  # fmt: skip
        """Attention inputs of host layer ``layer`` for every sparse row (module docstring).

        Args:
            q3: ``[tokens, Hq, D]`` this layer's queries (real rows, then speculated positions).
            k3, v3: ``[tokens, Hkv, D]`` this layer's new K/V (the speculated positions' are
                never written to the KV cache; they fill their own column here).
            k_buf, v_buf: the device pool's ``[slots, Hkv, D]`` buffers of this layer.

        Returns:
            ``(q, keys, values)`` for the sparse attention (:class:`dd_sglang.kernels.dispatch.SparseAttention`,
            which reads the columns from ``plan.layout.mask``): ``[R, Hkv, P x group, D]`` (``P =
            plan.layout.positions``) and ``[R, Hkv, columns, D]`` views of the layer's ring slot; ``q`` None
            on the fast path where the fused C attention takes the layer (:meth:`attend` runs it).
        """
        if plan.n_fixed and self.in_place.table is None:
            slot_k, slot_v = self.schedule.wait(layer)
        else:
            slot_k, slot_v = self.ring.slot(layer)  # the whole slot: [reserved rows, Hkv, reserved columns, D]
        r, c = plan.num_rows, plan.layout.columns
        sync, verify = plan.selection.sync, plan.checks.verify_rows.numel()
        keys, values = slot_k[:r, :, :c], slot_v[:r, :, :c]
        t0 = time.perf_counter()
        for g in sync:
            self._sync_select(plan, g, layer, q3, scale)
        if verify:
            self.verification.run(plan, layer, q3, scale, slot_k, slot_v)
        elif plan.checks.sampled.numel():
            self.probe.attended[layer] = plan.fixed.slots[layer][: plan.n_ahead]
        t1 = time.perf_counter()
        if sync or verify:
            self.tally.phase("select", t1 - t0)
        fast = self.fast and k_buf.dtype == slot_k.dtype and k_buf.is_contiguous() and v_buf.is_contiguous()
        fused = fast and fused_takes(plan, q3, k_buf, v_buf)
        self.in_place.begin_layer(plan, layer, fused, slot_k, slot_v)
        if fast:
            q = self.assembly.assemble(plan, q3, k3, v3, k_buf, v_buf, slot_k, slot_v, keys, values, fused)
        else:
            q = self._assemble(plan, q3, k3, v3, k_buf, v_buf, keys, values)
        self.tally.phase("assemble", time.perf_counter() - t1)
        if self.trace.rows:
            self.trace.layer(plan, layer, q3, scale, slot_k, k_buf, fused, self.in_place.layer_sets)
        return q, keys, values

    @staticmethod
    def _assemble(plan: StepPlan, q3, k3, v3, k_buf, v_buf, keys, values) -> torch.Tensor:
        """:meth:`layer_inputs`' resident set, speculated K/V and folded queries with PyTorch indexing."""
        layout, spec = plan.layout, plan.spec
        n_res = layout.n_res
        keys[:, :, :n_res] = k_buf[layout.res_slots].transpose(1, 2)
        values[:, :, :n_res] = v_buf[layout.res_slots].transpose(1, 2)
        if spec.rows.numel():
            keys[spec.rows, :, spec.cols] = k3[spec.tokens].to(keys.dtype)
            values[spec.rows, :, spec.cols] = v3[spec.tokens].to(values.dtype)
        return fold_gqa(q3[layout.qidx], k_buf.shape[1])

    def attend(self, plan: StepPlan, attention, q3: torch.Tensor, q: torch.Tensor | None, keys: torch.Tensor,
               values: torch.Tensor, out: torch.Tensor, scale: float) -> None:  # fmt: skip
        """One layer's sparse attention of every sparse row, written into its rows of ``out``
        (``[tokens, Hq, Dv]``): the fused C kernel over the ring slot where :meth:`layer_inputs`
        returned no folded queries (``q`` None, the CPU fast path), else ``attention``
        (:class:`~dd_sglang.kernels.dispatch.SparseAttention`) then :meth:`scatter_output`."""
        if q is None:
            self.assembly.attend(q3, out, scale, self.in_place.layer_sets)
            return
        self.scatter_output(plan, attention.run(q, keys, values, scale), out)

    def scatter_output(self, plan: StepPlan, o: torch.Tensor, out: torch.Tensor) -> None:
        """Write the sparse attention's output ``o`` (``[R, Hkv, P x G, Dv]``) into the layer's output
        ``out`` (``[tokens, Hq, Dv]``, contiguous): each row's real query and each speculated position."""
        FastAssembly.scatter(plan, self.assembly.rows_of(plan) if self.assembly else None, o, out)

    @staticmethod
    def exact_contexts(plan: StepPlan, keys: torch.Tensor, values: torch.Tensor):
        """Per exact row (``plan.exact.batch_rows``): ``(batch_row, K, V)``, its context's ``[seq_len, Hkv, D]``
        K/V in position order, contiguous (the layout of SGLang's ``k_cache[req_to_token[row]]``).

        ``keys`` / ``values``: the ``[R, Hkv, columns, D]`` views :meth:`layer_inputs` returned. The
        plan rows of exact rows are found from ``plan.rows`` once per call (few rows: exact rows
        exist only where ``top_k`` covers the context).
        """
        if not plan.exact.batch_rows:
            return
        where = {b: j for j, b in enumerate(plan.rows.tolist())}
        for b, cols in zip(plan.exact.batch_rows, plan.exact.cols, strict=True):
            j = where[b]
            yield b, keys[j][:, cols].transpose(0, 1).contiguous(), values[j][:, cols].transpose(0, 1).contiguous()

    def _sync_select(self, plan: StepPlan, g, layer: int, q3: torch.Tensor, scale: float) -> None:
        """Select sync group ``g``'s sets from this layer's queries and gather them into columns
        ``[n_res, ...)`` of its rows (a synchronous copy; with in-place reads only recorded)."""
        q = selection_queries(q3, g.query, self.host.k.shape[2]).cpu()
        _, slots = g.selector.select(q, g.blocks, self.host.k[layer], g.k, scale, self.indexes.of(g.selector), layer)
        n_res = plan.layout.n_res
        if self.in_place.table is not None:
            self.in_place.record(plan, layer, g.rows, slots, n_res)
        else:
            k_slot, v_slot = self.ring.slot(layer)
            self.tally.copied += self.gather.copy(layer, flat_rows(slots), k_slot, v_slot, g.rows, n_res,
                                                  slots.shape[2], layer % self.ring.n_slots)  # fmt: skip
        if g.selector.lookahead:
            self.events.cold(g.selector.name, int(g.rows.numel()))

    def layer_done(self, plan: StepPlan, layer: int, q3: torch.Tensor, scale: float) -> None:
        """After ``layer``'s attention: free its ring slot; queue next-step selection and sampling."""
        if plan.n_fixed:
            self.schedule.done(layer)
        self.ahead.after_layer(plan, layer, q3, scale, self.assembly.rows_of(plan) if self.assembly else None)
        sampled = plan.checks.sampled
        if sampled.numel():
            qidx = plan.layout.qidx
            q = q3[qidx[sampled.to(qidx.device), 0]].detach().to("cpu", copy=True)
            attended = self.probe.attended.get(layer)
            self.schedule.submit_select(lambda: self.probe.measure(plan, layer, q, scale, attended))
        if layer == self.host.layer_num - 1:
            self.tally.flush(self.events)
            if self.trace.rows:
                self.trace.end()

    def end_step(self) -> None:
        """Finish the step's copies (no layer left to wait for them) and report its counts."""
        self.schedule.end_step()
        self.tally.flush(self.events)
