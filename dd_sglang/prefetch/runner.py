"""Runs a :class:`~dd_sglang.prefetch.plan.StepPlan` layer by layer, through the stages of its device profile.

The attention backend calls, per decode step and layer::

    plan = runner.plan(forward_batch, runtime)                   # once per step (init_forward_metadata)
    x = runner.layer_inputs(plan, layer, q3, k3, v3, ...)        # per layer, before attention
    runner.attend(plan, q3, x, out, scale)                       # the layer's sparse attention
    runner.layer_done(plan, layer, q3, scale)                    # per layer, after attention

Three stages, each picked once when the runner is built from a named device profile
(:mod:`dd_sglang.prefetch.profile`: ``cpu`` or ``gpu``, refined by the ``experimental`` switches):

* the **chooser** (:class:`~dd_sglang.prefetch.chooser.CriticalSetChooser`): before a layer's
  attention, the sync rows' sets from the real query and the verified rows' sets checked against
  theirs; after it, the next step's sets from the speculated queries;
* the **source** (:mod:`dd_sglang.prefetch.sources`): how the sets' K/V reach attention: copied into
  the layer ring ahead of the layer or when it waits, or read in place from the host tier;
* the **attender** (:mod:`dd_sglang.prefetch.attenders`): the fused C kernel, or the resident set
  gathered beside the sets and FlashInfer / the PyTorch reference.

``plan`` asks the source and the attender which of them serve the step (the in-place source hands a
small step, or one with exact rows, to its ring copies); the per-layer calls then go to those and
test no mode.

``exact_contexts`` gives, per *exact* row (a full row: its set is its whole context), that context's
K/V in position order, laid out as SGLang's dense decode reads them, for
:func:`~dd_sglang.kernels.sparse_decode.dense_decode_attention`.

The runner owns the prefetch layer's state: per-request prediction state
(:class:`~dd_sglang.prefetch.plan.PredictionStore`, released with the request), the key indexes,
the layer ring and the schedule.
"""

from __future__ import annotations

import logging
import time

import torch

from dd_sglang.kernels import native as native_kernel
from dd_sglang.kvcache.layer_buffers import LayerRingBuffer
from dd_sglang.prefetch.ahead_selection import SPLIT_MIN_ROWS, AheadSelection
from dd_sglang.prefetch.attenders import FusedAttender, GatheredAttender, LayerInputs
from dd_sglang.prefetch.chooser import CriticalSetChooser
from dd_sglang.prefetch.events import NO_EVENTS, PrefetchEvents, StepTally
from dd_sglang.prefetch.gather import RingGather
from dd_sglang.prefetch.hit_rate import HitRateProbe, StepBlocks
from dd_sglang.prefetch.key_indexes import KeyIndexes
from dd_sglang.prefetch.params import PrefetchParams
from dd_sglang.prefetch.plan import PlanInputs, StepPlan, build_step_plan
from dd_sglang.prefetch.profile import DeviceProfile, fused_attention_fits, resolve_profile
from dd_sglang.prefetch.schedule import TransferSchedule
from dd_sglang.prefetch.selectors import SELECTORS
from dd_sglang.prefetch.sources import InPlaceReads, RingCopies
from dd_sglang.prefetch.trace import AttentionTrace
from dd_sglang.prefetch.verify import LayerVerification

__all__ = ["LayerInputs", "PrefetchEvents", "SparseStepRunner", "use_native_kernel"]

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
        q_heads: query heads per layer on this rank (the GQA group decides whether the fused C
            attention takes the model, :func:`~dd_sglang.prefetch.profile.fused_attention_fits`); None: unknown.
        pool_contiguous: the device pool's K/V buffers are contiguous (the fused attention reads them).
        profile: the stages to use instead of the device's (:func:`~dd_sglang.prefetch.profile.resolve_profile`);
            a test drives the GPU profile's stages on CPU tensors with it.
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
        q_heads: int | None = None,
        pool_contiguous: bool = True,
        profile: DeviceProfile | None = None,
    ):
        device = torch.device(device)
        cpu = device.type != "cuda"
        self.host = host
        self.events = events or NO_EVENTS
        self.tally = StepTally()
        native = use_native_kernel(params.kernel)
        hkv, head_dim = host.k.shape[2], host.k.shape[3]
        fits = pool_contiguous and host.k.dtype == dtype and fused_attention_fits(dtype, head_dim, q_heads, hkv)
        #: The stages every step takes (:mod:`dd_sglang.prefetch.profile`).
        self.profile = profile or resolve_profile(device, params.transfer, native, fits,
                                                  host.k.is_contiguous() and host.v.is_contiguous())  # fmt: skip
        select_inline = params.select == "inline" or (params.select == "auto" and cpu)
        self.schedule = TransferSchedule(LayerRingBuffer(params.depth, device, dtype), on_step=self.events.transfer,
                                         inline=self.profile.source != "copy_ahead", select_inline=select_inline)  # fmt: skip
        copies = RingCopies(host, self.schedule, RingGather(host.k, host.v, device, params.gather, native), self.tally)
        #: The source (:mod:`dd_sglang.prefetch.sources`).
        self.source = (InPlaceReads(host, copies, self.tally, always=params.transfer == "in_place")
                       if self.profile.source == "in_place" else copies)  # fmt: skip
        #: The attender (:mod:`dd_sglang.prefetch.attenders`).
        self.attender = (FusedAttender(hkv) if self.profile.attender == "fused_c"
                         else GatheredAttender(device, "torch" if self.profile.attender == "torch" else None))  # fmt: skip
        logger.info("dd_sglang device profile: %s; selection kernel: %s", self.profile.describe(),
                    "C" if native else "PyTorch")  # fmt: skip
        self.indexes = KeyIndexes(host.k, device, native, block_means=params.first_level_tokens is not None)
        self.inputs = PlanInputs.from_params(params, req_to_token, self.indexes.index, native, seed)
        blocks = StepBlocks()
        host_sync = self.inputs.selectors["host_sync"]
        probe = HitRateProbe(host, self.indexes, host_sync, SELECTORS["oracle"](), native, self.events, blocks)
        ahead = AheadSelection(host, self.schedule, self.inputs.store, self.indexes, self.tally, self.events,
                               _split_threads(params, cpu), 1 if params.select == "split" else SPLIT_MIN_ROWS)  # fmt: skip
        #: The chooser: sync, verified (the real query's set, chosen as ``host_sync`` chooses it) and ahead rows.
        self.chooser = CriticalSetChooser(
            host, self.indexes, ahead, LayerVerification(host, host_sync, self.indexes, self.tally, blocks,
                                                         probe.attended),
            probe, self.schedule, self.tally, self.events,
        )  # fmt: skip
        #: Requests that asked for an attention trace (``dd_trace``; :mod:`dd_sglang.prefetch.trace`).
        self.trace = AttentionTrace(host)
        self._source, self._attender = self.source, self.attender  # the step's (``plan``)

    # ------------------------------------------------------------------ state
    @property
    def ring(self) -> LayerRingBuffer:
        """The layer ring the step's critical sets are copied into (``[slots, rows, Hkv, columns, D]``)."""
        return self.schedule.ring

    @property
    def step_source(self):
        """The source serving the current step (:attr:`source`, or the ring copies it handed the step to)."""
        return self._source

    @property
    def store(self):
        """The per-request :class:`~dd_sglang.prefetch.plan.PredictionStore`."""
        return self.inputs.store

    def key_index(self, location: str):
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
        """Plan the step, pick the source and attender that serve it and start its copies; None (and
        nothing queued) without sparse rows."""
        self.schedule.drain_select()  # last step's selections are read by this plan
        self.tally.flush(self.events)
        plan = build_step_plan(fb, rt, self.inputs, self.events.speculation)
        self.chooser.begin(plan)
        self.trace.begin(plan, rt, fb)
        if plan is None:
            self.end_step()
            self.ring.release()
            return None
        self.ring.reserve(plan.num_rows, self.host.k.shape[2], plan.layout.columns, self.host.k.shape[3])
        self._attender = self.attender.begin(plan, self.ring)
        self._source = self.source.begin(plan)
        self.events.phase("plan", time.perf_counter() - plan.started)
        return plan

    def split_threads(self, split: bool) -> None:
        """The forward thread's intra-op threads for the coming forward (:meth:`AheadSelection.split_threads`)."""
        self.chooser.ahead.split_threads(split)

    # ------------------------------------------------------------------ per layer
    def layer_inputs(self, plan: StepPlan, layer: int, q3: torch.Tensor, k3: torch.Tensor, v3: torch.Tensor,
                     k_buf: torch.Tensor, v_buf: torch.Tensor, scale: float) -> LayerInputs:  # fmt: skip
        """Attention inputs of host layer ``layer`` for every sparse row: the layer's slot (its copy
        waited for), the sets the chooser picks now put into it by the source, the attender's inputs.

        Args:
            q3: ``[tokens, Hq, D]`` this layer's queries (real rows, then speculated positions).
            k3, v3: ``[tokens, Hkv, D]`` this layer's new K/V (the speculated positions' are
                never written to the KV cache; they fill their own column here).
            k_buf, v_buf: the device pool's ``[slots, Hkv, D]`` buffers of this layer.

        Returns:
            :class:`~dd_sglang.prefetch.attenders.LayerInputs` for :meth:`attend`.
        """
        source = self._source
        slot_k, slot_v = source.slot(layer)
        self.chooser.before_attention(plan, layer, q3, scale, source)
        t0 = time.perf_counter()
        x = self._attender.inputs(plan, q3, k3, v3, k_buf, v_buf, slot_k, slot_v, source.layer_sets(plan, layer))
        self.tally.phase("assemble", time.perf_counter() - t0)
        if self.trace.rows:
            self.trace.layer(plan, layer, q3, scale, slot_k, k_buf, self._attender.reads_pool, x.sets)
        return x

    def attend(self, plan: StepPlan, q3: torch.Tensor, x: LayerInputs, out: torch.Tensor, scale: float) -> None:
        """One layer's sparse attention of every sparse row, written into its rows of ``out``
        (``[tokens, Hq, Dv]``), by the step's attender."""
        self._attender.attend(plan, q3, x, out, scale)

    @staticmethod
    def exact_contexts(plan: StepPlan, x: LayerInputs):
        """Per exact row (``plan.exact.batch_rows``): ``(batch_row, K, V)``, its context's ``[seq_len, Hkv, D]``
        K/V in position order, contiguous (the layout of SGLang's ``k_cache[req_to_token[row]]``).

        ``x``: the layer's :class:`LayerInputs` (its ``[R, Hkv, columns, D]`` slot views). The
        plan rows of exact rows are found from ``plan.rows`` once per call (few rows: exact rows
        exist only where ``top_k`` covers the context).
        """
        if not plan.exact.batch_rows:
            return
        where = {b: j for j, b in enumerate(plan.rows.tolist())}
        for b, cols in zip(plan.exact.batch_rows, plan.exact.cols, strict=True):
            j = where[b]
            yield b, x.keys[j][:, cols].transpose(0, 1).contiguous(), x.values[j][:, cols].transpose(0, 1).contiguous()

    def layer_done(self, plan: StepPlan, layer: int, q3: torch.Tensor, scale: float) -> None:
        """After ``layer``'s attention: free its ring slot; the next step's selection and sampling."""
        self._source.done(layer)
        self.chooser.after_attention(plan, layer, q3, scale, self._attender.rows(plan))
        if layer == self.host.layer_num - 1:
            self.tally.flush(self.events)
            if self.trace.rows:
                self.trace.end()

    def end_step(self) -> None:
        """Finish the step's copies (no layer left to wait for them) and report its counts."""
        self._source.end_step()
        self.tally.flush(self.events)
