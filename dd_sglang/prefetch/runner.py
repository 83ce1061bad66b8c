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
   real query's own (``experimental.miss_policy: verify``, :mod:`dd_sglang.prefetch.verify`):
   the tokens the prediction missed replace the ones it should not have
   fetched, copied synchronously, so each layer attends the set ``host_sync``
   would choose;
3. gathers the resident set from the device pool (one index per K and V) and
   writes each speculated position's own K/V into its column;
4. returns the folded queries and the slot's K/V (the step's mask, ``plan.mask``, says which
   columns each query reads).

With ``experimental.transfer`` ``in_place`` (``auto`` on a CPU device with the C
kernel, for a step of at least 6 (row, KV head) pairs) nothing is copied in step 1, nor for the sync rows and verified
sets in step 2: the step keeps each layer's critical sets as host slots (``[layers, R, Hkv,
k]``, -1 where a column is not read in place) and the fused C
attention reads those rows from the host tier itself, as it reads the
resident set from the device pool. On a CPU the two tiers are the same memory:
a copy into the ring would read every row once to write it, then again to
attend to it. A step with exact rows (their dense call reads the ring) or a
layer the fused attention does not take copies as before.

``exact_contexts`` then gives, per *exact* row (a full row: its set is its whole
context), that context's K/V in position order, laid out as SGLang's dense
decode reads them, for :func:`~dd_sglang.kernels.sparse_decode.dense_decode_attention`.

``layer_done`` hands the slot back (the next copy reuses it) and queues, on the
select worker, the choice of the next step's sets from this layer's queries
(speculated or current, per selector) and the sampled hit-rate measurement.
With the selection inline (a CPU's default below :data:`SPLIT_MIN_ROWS` rows, ``experimental.select``) it keeps the
layer's selection queries and, every few layers, chooses the sets of those
layers in one call per selector (:meth:`Selector.select_layers`): the same
sets, with each small operation dispatched once per chunk instead of once per
layer. A chunk holds as many layers as keep the selection's float32 scores
within :data:`SELECT_CHUNK_BYTES`: in ``bench.decode_speed`` on 2 cores (SmolLM2,
``bench/results/archive/decode_speed_per_layer_select_cpu.json`` against commit
be9441f's ``decode_speed_cpu.json``) chunks cut the selection from 38 to 18 ms
per step at 4k x 1 and left it at ~120 ms at 4k x 8, where scores of more
layers at once no longer fit the caches.

The runner owns the prefetch layer's state: per-request prediction state
(:class:`~dd_sglang.prefetch.plan.PredictionStore`, released with the request),
the key indexes, the layer ring and the schedule.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable

import torch

from dd_sglang.kernels import native as native_kernel
from dd_sglang.kernels.sparse_decode import fold_gqa, unfold_gqa
from dd_sglang.kvcache.layer_buffers import LayerRingBuffer
from dd_sglang.prefetch.gather import RingGather, flat_rows
from dd_sglang.prefetch.index import KeyBlockIndex, QuantKeyIndex
from dd_sglang.prefetch.layer_rows import LayerRows, build_layer_rows, fixed_rows
from dd_sglang.prefetch.params import PrefetchParams
from dd_sglang.prefetch.plan import PlanInputs, PredictionStore, StepPlan, build_step_plan
from dd_sglang.prefetch.schedule import TransferSchedule
from dd_sglang.prefetch.selectors import SELECTORS, make_selector
from dd_sglang.prefetch.speculators import SPECULATORS, make_speculator
from dd_sglang.prefetch.verify import verify_sets

logger = logging.getLogger(__name__)

#: Inline selection: largest float32 score tensor (layers x rows x candidates x query heads x 4 B)
#: one chunk of layers may make; at most :data:`SELECT_CHUNK_LAYERS` layers a chunk.
SELECT_CHUNK_BYTES = 3 << 20
SELECT_CHUNK_LAYERS = 10
#: ``experimental.select: auto`` on a CPU with 2+ intra-op threads: a sparse step with at least this many
#: rows selecting ahead runs as ``split`` (the selection on the select worker, the forward's own
#: operations on one thread), a smaller one inline. ``bench.decode_speed`` on 2 cores, 4k tokens, split
#: over inline tokens/s: 0.89x at 1 row (``bench/results/archive/decode_speed_split_cpu.json``), 0.86x at 4 and
#: 1.06x at 8 rows (``bench/results/archive/decode_speed_select_auto_cpu.json``, run with this at 4). The
#: worker's single-thread selection took 2.2-2.8x the inline two-thread time (memory and the GIL
#: shared with the forward), so only from 8 rows does moving it off the forward thread pay for the
#: forward's own operations on one thread.
SPLIT_MIN_ROWS = 8


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


class PrefetchEvents:
    """What the prefetch layer reports (the plugin turns it into Prometheus metrics); no-ops here."""

    def cold(self, selector: str, n: int) -> None:
        """``n`` lookahead (request, layer)s had no set fixed in advance and selected synchronously."""

    def prefetch(self, selector: str, speculator: str, layer: int, hits: int, lookups: int,
                 mass_prefetched: float, mass_top_k: float) -> None:  # fmt: skip
        """A sampled lookahead (request, layer): ``hits`` of ``lookups`` (= k x KV heads) exact
        top-k tokens of the real query were prefetched; softmax mass on the prefetched set and
        on the exact top-k."""

    def speculation(self, speculator: str, accepted: bool) -> None:
        """A request's speculated token was checked against the real one."""

    def miss(self, policy: str, n: int, repaired_tokens: int) -> None:
        """``n`` lookahead (request, layer)s' prefetched sets missed tokens of the real query's set:
        ``verify`` fetched ``repaired_tokens`` of them before attention; ``use_prefetched`` (counted
        after a rejected speculation) attended over what arrived."""

    def verified(self, selector: str, speculator: str, hits: int, lookups: int) -> None:
        """A step's verified lookahead (request, layer)s: ``hits`` of ``lookups`` (= top_k x KV heads,
        summed) tokens of the real query's set had been prefetched."""

    def recall(self, selector: str, speculator: str, held: int, lookups: int) -> None:
        """A sampled lookahead (request, layer): ``held`` of ``lookups`` tokens of ``host_sync``'s set for
        the real query (selected again, apart from the step) were in the set the layer attended."""

    def transfer(self, timings) -> None:
        """The transfer schedule finished a step (per-layer timestamps)."""

    def phase(self, name: str, seconds: float) -> None:
        """Time spent in a phase of a decode step: ``plan``, ``select`` (forward thread),
        ``select_ahead`` (select worker), ``assemble``, ``attention``."""

    def copied(self, nbytes: int) -> None:
        """``nbytes`` of critical-set K/V were gathered from the host tier into the layer ring."""


_NO_EVENTS = PrefetchEvents()


class StepTally:
    """A step's per-layer event counts, reported once per step (:meth:`flush`) instead of once per
    layer: each report is a Prometheus label lookup and lock on the forward thread."""

    def __init__(self):
        self.phases: dict[str, float] = {}
        self.copied = 0
        self.misses: dict[str, list[int]] = {}
        self.verified: dict[tuple[str, str], list[int]] = {}

    def phase(self, name: str, seconds: float) -> None:
        """Add ``seconds`` to phase ``name`` (:meth:`PrefetchEvents.phase`)."""
        self.phases[name] = self.phases.get(name, 0.0) + seconds

    def miss(self, policy: str, n: int, repaired_tokens: int) -> None:
        """Count ``n`` (request, layer) misses under ``policy`` and their fetched tokens (:meth:`PrefetchEvents.miss`)."""
        m = self.misses.setdefault(policy, [0, 0])
        m[0] += n
        m[1] += repaired_tokens

    def verify(self, label: tuple[str, str], hits: int, lookups: int) -> None:
        """Add a layer's verified hits and lookups under ``(selector, speculator)`` (:meth:`PrefetchEvents.verified`)."""
        v = self.verified.setdefault(label, [0, 0])
        v[0] += hits
        v[1] += lookups

    def flush(self, events: PrefetchEvents) -> None:
        """Report what was counted to ``events`` and start again from zero."""
        for name, seconds in self.phases.items():
            events.phase(name, seconds)
        if self.copied:
            events.copied(self.copied)
        for policy, (n, tokens) in self.misses.items():
            events.miss(policy, n, tokens)
        for (selector, speculator), (hits, lookups) in self.verified.items():
            events.verified(selector, speculator, hits, lookups)
        self.phases, self.copied, self.misses, self.verified = {}, 0, {}, {}


def _chunk_layers(g, q: torch.Tensor) -> int:
    """Layers per inline selection call for group ``g`` (``q``: one layer's ``[rows, heads, D]``)."""
    per_layer = q.shape[0] * q.shape[1] * g.blocks.cand.shape[1] * 4
    return max(1, min(SELECT_CHUNK_LAYERS, SELECT_CHUNK_BYTES // max(per_layer, 1)))


def _selection_queries(q3: torch.Tensor, query: torch.Tensor, hkv: int) -> torch.Tensor:
    """The queries that drive a selection, ``[n, Hkv x Q x group, D]``, grouped by KV head.

    ``query``: ``[n, Q]`` token indices (``Q`` riding positions, or the real one). Every query of
    a KV head joins that head's GQA group, so a selector's max over the group ranks by all ``Q``
    queries at once, at the same budget ``k``.
    """
    sel = fold_gqa(q3[query.to(q3.device)].detach(), hkv)  # [n, Hkv, Q x group, D]
    return sel.reshape(sel.shape[0], -1, sel.shape[3])


def _plan_inputs(params: PrefetchParams, req_to_token: torch.Tensor, store: PredictionStore, make_index,
                 native: bool, seed: int) -> PlanInputs:  # fmt: skip
    """The runner's :class:`PlanInputs`: one selector per name of :data:`SELECTORS` (the C kernel
    where ``native``), one speculator per name of :data:`SPECULATORS`, the preset's miss policy,
    sampling and hit-rate settings, and a hit-rate sampling RNG seeded with ``seed``."""
    return PlanInputs(
        req_to_token=req_to_token,
        selectors={name: make_selector(name, params.rerank, native) for name in SELECTORS},
        speculators={n: make_speculator(n, params.branches, params.confident) for n in SPECULATORS},
        store=store,
        make_index=make_index,
        miss_policy=params.miss_policy,
        hit_rate_sample=params.hit_rate_sample,
        rng=random.Random(seed),
        real_query=params.real_query,
        sampling=params.sampling,
    )


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
        self.host = host
        self.device = torch.device(device)
        self.params = params
        self.events = events or _NO_EVENTS
        self.ring = LayerRingBuffer(params.depth, self.device, dtype)
        cpu = self.device.type != "cuda"
        inline = params.transfer in ("inline", "in_place") or (params.transfer == "auto" and cpu)
        select_inline = params.select == "inline" or (params.select == "auto" and cpu)
        #: ``experimental.select`` ``split`` or ``auto`` on a CPU: the forward thread's intra-op thread
        #: count outside split steps (read here, on the forward thread) and inside them (1); None
        #: where no step splits (CUDA, ``worker``, ``inline``, or a single intra-op thread).
        threads = torch.get_num_threads()
        splits = cpu and params.select in ("split", "auto") and threads > 1
        self._split_threads = (threads, 1) if splits else None
        self._split_min_rows = 1 if params.select == "split" else SPLIT_MIN_ROWS
        self.schedule = TransferSchedule(self.ring, on_step=self.events.transfer, inline=inline,
                                         select_inline=select_inline)  # fmt: skip
        #: Inline selection: each ahead group's selection queries of the layers not yet selected.
        self._pending: list[dict[int, torch.Tensor]] = []
        self.native = use_native_kernel(params.kernel)
        self.gather = RingGather(host.k, host.v, self.device, params.gather, self.native)
        #: CPU with the C kernel: each layer's moves are single indexed copies over the rows of
        #: :mod:`~dd_sglang.prefetch.layer_rows`, built once per step.
        self.fast = self.gather.native and host.k.is_contiguous()  # gather.native: a CPU ring
        #: CPU fast path, ``experimental.transfer`` ``in_place`` (``auto`` on a CPU, per step: see
        #: :meth:`_reads_in_place`): the fused attention reads the critical sets from the host tier
        #: by slot (:attr:`_crit`); no ring copy.
        self.in_place = self.fast and host.v.is_contiguous() and (params.transfer == "in_place"
                                                                   or (params.transfer == "auto" and cpu))  # fmt: skip
        #: The step's in-place critical sets: ``[layers, R, Hkv, k]`` host slots, -1
        #: where a column is not read in place; None when the step copies into the ring.
        self._crit: torch.Tensor | None = None
        self._crit_rows = 0  # host rows (K or V, per KV head) the step's fixed rows read in place, per layer
        self._crit_layer: tuple | None = None  # the current layer's in-place sets, for attend()
        mode = "worker" if not inline else "in place" if self.in_place else "inline"
        if self.in_place and params.transfer == "auto":
            mode += " from 6 (row, KV head) pairs a step, else inline"
        logger.info("dd_sglang critical-set transfer: %s; selection kernel: %s", mode,
                    "C" if self.native else "PyTorch")  # fmt: skip
        self._rows_for: tuple | None = None  # (plan, query heads, slot shape) of self._rows
        self._rows: LayerRows | None = None
        self._sel_buf: list[torch.Tensor] = []  # fast inline selection: per ahead group [L, n, Q x Hq, D]
        self._sel_next: list[int] = []  # per ahead group, the first layer not yet selected
        self._sel_chunk: list[int | None] = []  # per ahead group, its layers per selection call
        self._use_misses = 0
        #: Sampled steps (``plan.sampled``): per layer, the ahead rows' attended critical sets
        #: (``[n_ahead, Hkv, k]`` host slots), for the recall measurement of :meth:`_measure`.
        self._attended: dict[int, torch.Tensor] = {}
        self.tally = StepTally()
        self._slot: tuple | None = None  # the layer's ring slot and device-pool K/V, for attend()
        self._taken_for: StepPlan | None = None  # :meth:`_blocks_of`'s plan and its taken blocks
        self._taken: dict = {}
        self.store = PredictionStore()
        self.indexes: dict[str, KeyBlockIndex | QuantKeyIndex] = {}
        self.inputs = _plan_inputs(params, req_to_token, self.store, self.index, self.native, seed)
        self._exact = SELECTORS["oracle"]()
        #: ``experimental.miss_policy: verify``: the real query's set, chosen as ``host_sync`` chooses it.
        self._verifier = self.inputs.selectors["host_sync"]

    # ------------------------------------------------------------------ state
    def index(self, location: str) -> KeyBlockIndex | QuantKeyIndex:
        """The index at ``location``, created on first use: ``"host"``, the int8 key index
        ``spec_host``, ``host_sync`` and verification read (host memory); ``"device"``, ``quest_device``'s block index."""
        idx = self.indexes.get(location)
        if idx is None:
            if location == "host":
                idx = QuantKeyIndex(self.host.k, "cpu", native=self.native)
            else:
                idx = KeyBlockIndex(self.host.k, self.device)
            self.indexes[location] = idx
        return idx

    def _index_of(self, selector) -> KeyBlockIndex | QuantKeyIndex | None:
        """The index ``selector`` reads (created on first use), or None for a selector that reads none."""
        return self.index(selector.index_location) if selector.index_location else None

    def aux_bytes(self) -> dict[str, int]:
        """Device bytes of selection state by selector (``quest_device``'s device index)."""
        dev = self.indexes.get("device")
        return {"quest_device": dev.nbytes} if dev is not None else {}

    def host_index_bytes(self) -> int:
        """Host bytes of the int8 key index ``spec_host``, ``host_sync`` and verification read."""
        idx = self.indexes.get("host")
        return idx.nbytes if idx is not None else 0

    def critical_bytes(self, plan: StepPlan | None) -> int:
        """Bytes of the ring's critical-set columns (every slot, reserved rows), K and V."""
        if plan is None or not self.ring.shape:
            return 0
        n_slots, rows, hkv, _, d = self.ring.shape
        return 2 * n_slots * rows * hkv * plan.k * d * self.ring.dtype.itemsize

    def release(self, rid: str) -> None:
        """Drop a request's prediction state (the KV-cache runtime's release callback)."""
        self.store.release(rid)

    # ------------------------------------------------------------------ per step
    def plan(self, fb, rt) -> StepPlan | None:
        """Plan the step and start its copies; None (and nothing queued) without sparse rows."""
        self.schedule.drain_select()  # last step's selections are read by this plan
        self.tally.flush(self.events)
        plan = build_step_plan(fb, rt, self.inputs, self.events.speculation)
        self._choose_split(plan)
        self._pending = [{} for _ in plan.ahead] if plan is not None else []
        self._sel_next = [0 for _ in plan.ahead] if plan is not None else []
        self._sel_chunk = [None for _ in plan.ahead] if plan is not None else []
        if plan is not None:  # rows whose rejected speculation is not verified: counted each layer
            verified = set(plan.verify_rows.tolist())
            self._use_misses = sum(plan.rejected[j] and j not in verified for j in range(plan.n_ahead))
            self._attended = {}
        if plan is None:
            self.schedule.end_step()
            self.ring.release()
            return None
        hkv, d = self.host.k.shape[2], self.host.k.shape[3]
        self.ring.reserve(plan.num_rows, hkv, plan.columns, d)
        self._crit = self._in_place_sets(plan) if self._reads_in_place(plan) else None
        if plan.n_fixed and self._crit is None:
            self.schedule.begin_step(list(range(self.host.layer_num)), self._gather_fn(plan))
        else:
            self.schedule.end_step()
        self.events.phase("plan", time.perf_counter() - plan.started)
        return plan

    def split_threads(self, split: bool) -> None:
        """Where steps may split (``experimental.select`` ``split`` or ``auto`` on a CPU), set the calling
        (forward) thread's intra-op threads for the coming forward: 1 for a split step (the select
        worker has the other core), else the count the runner was built with; elsewhere nothing."""
        if self._split_threads is not None:
            n = self._split_threads[1 if split else 0]
            if torch.get_num_threads() != n:
                torch.set_num_threads(n)

    def _choose_split(self, plan: StepPlan | None) -> None:
        """Whether this step splits (``auto``: at least :data:`SPLIT_MIN_ROWS` rows selecting ahead;
        ``split``: at least 1): its selection then runs on the select worker (queued by
        :meth:`layer_done`), else inline; and the forward thread's thread count. Called after the
        previous step's selections were drained, so none is in flight."""
        if self._split_threads is None:
            return
        rows = sum(int(g.query.shape[0]) for g in plan.ahead) if plan is not None else 0
        split = plan is not None and rows >= self._split_min_rows
        self.schedule.select_inline = not split
        self.split_threads(split)

    def _reads_in_place(self, plan: StepPlan) -> bool:
        """Whether the step's attention reads its critical sets in place (:attr:`in_place`).

        With ``experimental.transfer`` ``auto``, only a step with at least
        :data:`~dd_sglang.kernels.native.ATTEND_PARALLEL_TASKS` (row, KV head) tasks: below that the
        attention runs on one thread, and scattered host rows read there cost more than a copy on
        every thread (``bench/results/archive/decode_speed_cpu.json``: in place over inline
        0.97x at batch 1, 1.05x at 4k x 8)."""
        if not self.in_place or self.ring.dtype != self.host.k.dtype:
            return False
        return self.params.transfer == "in_place" or (
            plan.num_rows * self.host.k.shape[2] >= native_kernel.ATTEND_PARALLEL_TASKS)

    def _in_place_sets(self, plan: StepPlan) -> torch.Tensor | None:
        """The step's :attr:`_crit` table with the fixed rows' sets (the columns each row's mask
        reads), the rest -1; None for a step with exact rows (their dense call reads the ring)."""
        if plan.exact_rows:
            return None
        n_layers, hkv = self.host.layer_num, self.host.k.shape[2]
        crit = torch.full((n_layers, plan.num_rows, hkv, plan.k), -1, dtype=torch.int64)
        if plan.n_fixed:
            reads = plan.mask[: plan.n_fixed, 0, plan.n_res : plan.n_res + plan.k].to("cpu")  # [n_fixed, k]
            crit[:, : plan.n_fixed, :, : plan.k] = torch.where(reads[None, :, None, :], plan.fixed_slots, -1)
            self._crit_rows = int(reads.sum()) * hkv
        else:
            self._crit_rows = 0
        return crit

    def _gather_fn(self, plan: StepPlan) -> Callable[[int, torch.Tensor, torch.Tensor], None]:
        """The copy of layer ``l``'s fixed rows (plan rows ``[0, n_fixed)``) into its ring slot."""
        if self.fast:
            return self._fast_gather_fn(plan)
        rows, c0, k = slice(0, plan.n_fixed), plan.n_res, plan.k
        gather, copied, n_slots = self.gather, self.events.copied, self.ring.n_slots

        def copy(layer: int, k_slot: torch.Tensor, v_slot: torch.Tensor) -> None:
            src = flat_rows(plan.fixed_slots[layer])
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

    def layer_rows(self, plan: StepPlan, hq: int, slot_shape: torch.Size) -> LayerRows:
        """The step's :class:`LayerRows` (built at the first layer that asks, then reused)."""
        key = self._rows_for
        if key is None or key[0] is not plan or key[1] != hq or key[2] != slot_shape:
            self._rows = build_layer_rows(plan, self.host.k.shape[2], hq, slot_shape)
            self._rows_for = (plan, hq, slot_shape)
        return self._rows

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
            which reads the columns from ``plan.mask``): ``[R, Hkv, P x group, D]`` (``P =
            plan.positions``) and ``[R, Hkv, columns, D]`` views of the layer's ring slot.
        """
        hkv = k_buf.shape[1]
        if plan.n_fixed and self._crit is None:
            keys, values = self.schedule.wait(layer)
        else:
            keys, values = self.ring.slot(layer)
        r = plan.num_rows
        slot_k, slot_v = keys, values  # the whole slot: [reserved rows, Hkv, reserved columns, D]
        keys, values = keys[:r, :, : plan.columns], values[:r, :, : plan.columns]
        t0 = time.perf_counter()
        for g in plan.sync:
            self._sync_select(plan, g, layer, q3, scale)
        if plan.verify_rows.numel():
            self._verify(plan, layer, q3, scale, slot_k, slot_v)
        elif plan.sampled.numel():
            self._attended[layer] = plan.fixed_slots[layer][: plan.n_ahead]
        t1 = time.perf_counter()
        if plan.sync or plan.verify_rows.numel():
            self.tally.phase("select", t1 - t0)
        fast = self.fast and k_buf.dtype == slot_k.dtype and k_buf.is_contiguous() and v_buf.is_contiguous()
        fused = fast and self._fused(plan, q3, k_buf, v_buf)
        self._crit_layer = None
        if self._crit is not None:
            if fused:
                self._crit_layer = (self.host.k[layer], self.host.v[layer], self._crit[layer], plan.n_res)
                self.tally.copied += 2 * self._crit_rows * k_buf.shape[2] * k_buf.element_size()
            else:  # this layer cannot read in place after all: its sets go into the ring slot
                self._crit_to_ring(plan, layer, slot_k, slot_v)
        if fast:
            q = self._assemble_fast(plan, q3, k3, v3, k_buf, v_buf, slot_k, slot_v, keys, values, fused)
            self.tally.phase("assemble", time.perf_counter() - t1)
            return q, keys, values  # q None: attend() runs the fused kernel over the slot
        n_res = plan.n_res
        keys[:, :, :n_res] = k_buf[plan.res_slots].transpose(1, 2)
        values[:, :, :n_res] = v_buf[plan.res_slots].transpose(1, 2)
        if plan.spec_rows.numel():
            keys[plan.spec_rows, :, plan.spec_cols] = k3[plan.spec_tokens].to(keys.dtype)
            values[plan.spec_rows, :, plan.spec_cols] = v3[plan.spec_tokens].to(values.dtype)
        q = fold_gqa(q3[plan.qidx], hkv)
        self.tally.phase("assemble", time.perf_counter() - t1)
        return q, keys, values

    @staticmethod
    def _fused(plan: StepPlan, q3: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor) -> bool:
        """Whether the fast path's fused C attention takes this layer (dtypes, layouts, group size)."""
        d, st = k_buf.shape[2], q3.stride()
        return (q3.dtype in (torch.bfloat16, torch.float32) and st[2] == 1 and st[1] == d and v_buf.shape[2] == d
                and plan.positions * (q3.shape[1] // k_buf.shape[1]) <= native_kernel.MAX_QUERIES
                and d <= native_kernel.MAX_HEAD_DIM)  # fmt: skip

    def _crit_to_ring(self, plan: StepPlan, layer: int, slot_k: torch.Tensor, slot_v: torch.Tensor) -> None:
        """Copy ``layer``'s in-place sets (:attr:`_crit`) into the ring slot's columns ``[n_res, ...)``
        and stop reading them in place this step (a layer the fused attention does not take)."""
        crit = self._crit[layer]  # a -1 column is masked (never read): any host row may fill it
        self.tally.copied += self.gather.copy(layer, flat_rows(crit.clamp(min=0)), slot_k, slot_v,
                                              slice(0, plan.num_rows), plan.n_res, crit.shape[2],
                                              layer % self.ring.n_slots)  # fmt: skip
        crit.fill_(-1)

    def _assemble_fast(self, plan, q3, k3, v3, k_buf, v_buf, slot_k, slot_v, keys, values, fused) -> torch.Tensor:
        """:meth:`layer_inputs`' resident set, speculated K/V and folded queries on the fast path: two
        C row copies and one ``index_select`` (rows from :meth:`layer_rows`). Returns the queries, or
        None where ``fused`` (:meth:`_fused`): attend() then runs the fused kernel."""
        d = k_buf.shape[2]
        rows = self.layer_rows(plan, q3.shape[1], slot_k.shape)
        row_bytes = d * k_buf.element_size()
        hkv = k_buf.shape[1]
        if not fused or plan.exact_rows:  # the fused kernel reads the resident set from the pool itself
            native_kernel.gather_rows_unchecked(k_buf.data_ptr(), v_buf.data_ptr(), slot_k.data_ptr(),
                                                slot_v.data_ptr(), rows.res_src, rows.res_dst, row_bytes)  # fmt: skip
        if rows.spec_dst.numel():
            for new, slot, dst in ((k3, slot_k, keys), (v3, slot_v, values)):
                st = new.stride()
                if new.dtype == slot.dtype and st[2] == 1 and st[1] == d and st[0] % d == 0:
                    native_kernel.copy_rows_unchecked(new.data_ptr(), slot.data_ptr(), rows.spec_src(st[0] // d),
                                                      rows.spec_dst, row_bytes)  # fmt: skip
                else:
                    dst[plan.spec_rows, :, plan.spec_cols] = new[plan.spec_tokens].to(dst.dtype)
        if fused:
            self._slot = (slot_k, slot_v, k_buf, v_buf)
            return None
        q = q3.reshape(-1, q3.shape[2]).index_select(0, rows.q_rows)
        return q.view(plan.num_rows, hkv, -1, q3.shape[2])

    def attend(self, plan: StepPlan, attention, q3: torch.Tensor, q: torch.Tensor | None, keys: torch.Tensor,
               values: torch.Tensor, out: torch.Tensor, scale: float) -> None:  # fmt: skip
        """One layer's sparse attention of every sparse row, written into its rows of ``out``
        (``[tokens, Hq, Dv]``): the fused C kernel over the ring slot where :meth:`layer_inputs`
        returned no folded queries (``q`` None, the CPU fast path), else ``attention``
        (:class:`~dd_sglang.kernels.dispatch.SparseAttention`) then :meth:`scatter_output`."""
        if q is None:
            rows = self._rows
            slot_k, slot_v, pool_k, pool_v = self._slot
            native_kernel.sparse_attend(q3, rows.q_tok, slot_k, slot_v, rows.mask, out, rows.out_tok, scale,
                                        (pool_k, pool_v, rows.res_slots), self._crit_layer)  # fmt: skip
            return
        self.scatter_output(plan, attention.run(q, keys, values, scale), out)

    def scatter_output(self, plan: StepPlan, o: torch.Tensor, out: torch.Tensor) -> None:
        """Write the sparse attention's output ``o`` (``[R, Hkv, P x G, Dv]``) into the layer's output
        ``out`` (``[tokens, Hq, Dv]``, contiguous): each row's real query and each speculated position."""
        dv = out.shape[2]
        if self.fast and self._rows_for is not None and self._rows_for[0] is plan:
            rows = self._rows
            out.view(-1, dv).index_copy_(0, rows.out_dst, o.reshape(-1, dv).index_select(0, rows.out_src).to(out.dtype))
            return
        o = unfold_gqa(o, plan.positions).to(out.dtype)
        out[plan.rows.to(out.device)] = o[:, 0]
        if plan.spec_rows.numel():
            out[plan.spec_tokens] = o[plan.spec_rows, plan.spec_slots]

    @staticmethod
    def exact_contexts(plan: StepPlan, keys: torch.Tensor, values: torch.Tensor):
        """Per exact row (``plan.exact_rows``): ``(batch_row, K, V)``, its context's ``[seq_len, Hkv, D]``
        K/V in position order, contiguous (the layout of SGLang's ``k_cache[req_to_token[row]]``).

        ``keys`` / ``values``: the ``[R, Hkv, columns, D]`` views :meth:`layer_inputs` returned. The
        plan rows of exact rows are found from ``plan.rows`` once per call (few rows: exact rows
        exist only where ``top_k`` covers the context).
        """
        if not plan.exact_rows:
            return
        where = {b: j for j, b in enumerate(plan.rows.tolist())}
        for b, cols in zip(plan.exact_rows, plan.exact_cols, strict=True):
            j = where[b]
            yield b, keys[j][:, cols].transpose(0, 1).contiguous(), values[j][:, cols].transpose(0, 1).contiguous()

    def _put(self, plan: StepPlan, layer: int, rows: torch.Tensor, slots: torch.Tensor, c0: int) -> None:
        """Gather host-tier K/V at ``slots`` (``[n, Hkv, w]``) into columns ``[c0, c0 + w)`` of plan
        rows ``rows`` of the layer's ring slot (a synchronous copy: a selection at attention time);
        with in-place reads (:attr:`_crit`) only record the slots there."""
        if self._crit is not None:
            j = c0 - plan.n_res
            self._crit[layer, rows, :, j : j + slots.shape[2]] = slots
            self.tally.copied += 2 * int(slots.numel()) * self.host.k.shape[3] * self.host.k.element_size()
            return
        k_slot, v_slot = self.ring.slot(layer)
        n = self.gather.copy(layer, flat_rows(slots), k_slot, v_slot, rows, c0, slots.shape[2],
                             layer % self.ring.n_slots)  # fmt: skip
        self.tally.copied += n

    def _sync_select(self, plan, g, layer, q3, scale) -> None:
        index = self._index_of(g.selector)
        q = _selection_queries(q3, g.query, self.host.k.shape[2]).cpu()
        _, slots = g.selector.select(q, g.blocks, self.host.k[layer], g.k, scale, index, layer)
        self._put(plan, layer, g.rows, slots, plan.n_res)
        if g.selector.lookahead:
            self.events.cold(g.selector.name, int(g.rows.numel()))

    def _verify(self, plan, layer, q3, scale, slot_k, slot_v) -> None:
        """The verified rows' attended sets (module docstring, step 2): the real query's set, chosen as
        ``host_sync`` chooses it, with the prefetched tokens kept in place and the misses fetched now
        (into the in-place table, or copied into the ring slot's freed columns)."""
        rows = plan.verify_rows
        blocks = self._blocks_of(plan, "verify", rows)
        q = q3[plan.qidx[rows.to(plan.qidx.device), 0]].detach().cpu()
        want_pos, want_slots = self._verifier.select(q, blocks, self.host.k[layer], plan.k, scale, self.index("host"),
                                                     layer)  # fmt: skip
        top_k = plan.top_k[rows]
        v = verify_sets(plan.fixed_pos[layer][rows], plan.fixed_slots[layer][rows], want_pos, want_slots, top_k)
        fetched = int(v.fetched.sum())
        if self._crit is not None:
            self._crit[layer, rows, :, : plan.k] = torch.where(self._crit[layer, rows, :, : plan.k] >= 0, v.slots, -1)
            self.tally.copied += 2 * fetched * self.host.k.shape[3] * self.host.k.element_size()
        elif fetched:
            self._fetch_columns(plan, layer, rows, v, slot_k, slot_v)
        hkv = want_pos.shape[1]
        for i, j in enumerate(rows.tolist()):
            self.tally.verify(plan.labels[j], int(v.hits[i]), hkv * int(top_k[i]))
        self.tally.miss("verify", int(v.fetched.flatten(1).any(dim=1).sum()), fetched)  # rows (this layer) that fetched
        if plan.sampled.numel():  # what attention reads: the in-place table, else the ring's columns
            if self._crit is not None:
                attended = self._crit[layer, : plan.n_ahead].clone()
            else:
                attended = plan.fixed_slots[layer][: plan.n_ahead].clone()
                attended[rows] = v.slots
            self._attended[layer] = attended

    def _fetch_columns(self, plan, layer, rows, v, slot_k, slot_v) -> None:
        """Copy the host-tier K/V of the verified sets' fetched columns (``v.fetched``) into the ring
        slot's critical-set columns of plan rows ``rows`` (a synchronous gather of the misses only)."""
        r, h, c = v.fetched.nonzero(as_tuple=True)
        src = v.slots[r, h, c]
        dst_rows, dst_cols = rows[r].to(slot_k.device), (plan.n_res + c).to(slot_k.device)
        dst_heads = h.to(slot_k.device)
        for host, slot in ((self.host.k[layer], slot_k), (self.host.v[layer], slot_v)):
            slot[dst_rows, dst_heads, dst_cols] = host[src, h].to(slot.device, slot.dtype, non_blocking=True)
        self.tally.copied += 2 * int(src.numel()) * self.host.k.shape[3] * self.host.k.element_size()

    def layer_done(self, plan: StepPlan, layer: int, q3: torch.Tensor, scale: float) -> None:
        """After ``layer``'s attention: free its ring slot; queue next-step selection and sampling."""
        if plan.n_fixed:
            self.schedule.done(layer)
        nxt = self.store.next_sets
        last = layer == self.host.layer_num - 1
        fast = self.fast and self.schedule.select_inline and self._rows_for is not None and self._rows_for[0] is plan
        for gi, g in enumerate(plan.ahead):
            if fast:
                self._select_fast(plan, gi, g, layer, q3, scale, last)
                continue
            q = _selection_queries(q3, g.query, self.host.k.shape[2]).to("cpu", copy=True)
            if self.schedule.select_inline:
                pending = self._pending[gi]
                pending[layer] = q
                if len(pending) == _chunk_layers(g, q) or layer == self.host.layer_num - 1:
                    self._select_layers(g, pending, scale)
                    pending.clear()
                continue
            index = self._index_of(g.selector)
            host_k = self.host.k[layer]

            def select(g=g, q=q, index=index, host_k=host_k) -> None:
                t0 = time.perf_counter()
                pos, slots = g.selector.select(q, g.blocks, host_k, g.k, scale, index, layer)
                nxt.put(layer, g.dest, pos, slots)
                self.events.phase("select_ahead", time.perf_counter() - t0)

            self.schedule.submit_select(select)
        if plan.sampled.numel():
            q = q3[plan.qidx[plan.sampled.to(plan.qidx.device), 0]].detach().to("cpu", copy=True)
            attended = self._attended.get(layer)
            self.schedule.submit_select(lambda: self._measure(plan, layer, q, scale, attended))
        if self._use_misses > 0:
            self.tally.miss("use_prefetched", self._use_misses, 0)
        if last:
            self.tally.flush(self.events)

    def _select_fast(self, plan: StepPlan, gi: int, g, layer: int, q3: torch.Tensor, scale: float, last: bool) -> None:
        """Inline selection on the fast path: the layer's selection queries go into the step's
        ``[layers, n, Q x Hq, D]`` buffer (one ``index_select``); a full chunk is selected from a
        view of it (no stacking)."""
        d = q3.shape[2]
        sel = self._rows.sel_rows[gi]
        if self._sel_chunk[gi] is None:  # the step's first layer: the buffer and the chunk size
            n = int(g.query.shape[0])
            shape = (self.host.layer_num, n, sel.numel() // n, d)
            if gi >= len(self._sel_buf):
                self._sel_buf.append(q3.new_empty(0))
            if tuple(self._sel_buf[gi].shape) != shape or self._sel_buf[gi].dtype != q3.dtype:
                self._sel_buf[gi] = q3.new_empty(shape)
            self._sel_chunk[gi] = _chunk_layers(g, self._sel_buf[gi][0])
        buf = self._sel_buf[gi]
        torch.index_select(q3.reshape(-1, d), 0, sel, out=buf[layer].view(-1, d))
        l0 = self._sel_next[gi]
        if layer + 1 - l0 == self._sel_chunk[gi] or last:
            self._select_layers_view(g, buf[l0 : layer + 1], l0, scale)
            self._sel_next[gi] = layer + 1

    def _blocks_of(self, plan: StepPlan, name: str, rows: torch.Tensor):
        """``plan.blocks.take(rows)`` for the plan's ``name`` rows (``verify``, ``sampled``), taken once
        per step: every layer reads the same rows, and the taken blocks keep their ``tokens``."""
        if self._taken_for is not plan:
            self._taken_for, self._taken = plan, {}
        blocks = self._taken.get(name)
        if blocks is None:
            blocks = self._taken[name] = plan.blocks.take(rows)
        return blocks

    def _select_layers(self, g, queries: dict[int, torch.Tensor], scale: float) -> None:
        """One group's next-step sets for a chunk of consecutive layers in one call (inline selection)."""
        l0, l1 = min(queries), max(queries) + 1
        self._select_layers_view(g, torch.stack([queries[layer] for layer in range(l0, l1)]), l0, scale)

    def _select_layers_view(self, g, q: torch.Tensor, l0: int, scale: float) -> None:
        """One group's next-step sets of layers ``[l0, l0 + len(q))`` from their selection queries
        ``q`` (``[L, rows, Q x Hq, D]``)."""
        t0 = time.perf_counter()
        l1 = l0 + q.shape[0]
        index = self._index_of(g.selector)
        nxt = self.store.next_sets
        out = nxt.direct(l0, l1, g.dest, g.k, self.host.k.shape[2])  # written in place when it can be
        pos, slots = g.selector.select_layers(q, g.blocks, self.host.k[l0:l1], g.k, scale, index, slice(l0, l1),
                                              out=out)  # fmt: skip
        if out is None:
            nxt.put_layers(l0, g.dest, pos, slots)
        self.tally.phase("select_ahead", time.perf_counter() - t0)

    def _measure(self, plan: StepPlan, layer: int, q: torch.Tensor, scale: float,
                 attended: torch.Tensor | None = None) -> None:  # fmt: skip
        """Hit rate of the sampled rows' prefetched sets against the exact top-k of the real query;
        with ``attended`` (``[n_ahead, Hkv, k]`` host slots the layer attended), the recall of that
        set against ``host_sync``'s set for the same real query, selected here again."""
        rows = plan.sampled
        if attended is not None:
            self._measure_recall(plan, layer, q, scale, attended[rows])
        blocks = self._blocks_of(plan, "sampled", rows)
        host_k = self.host.k[layer]
        kr = plan.top_k[rows].view(-1, 1, 1)
        have = plan.fixed_pos[layer][rows]
        hkv = have.shape[1]
        if self.native:
            slots, ok = blocks.tokens
            h, mh, mt = native_kernel.measure_hits(q, slots, ok, host_k, have, kr.flatten(), scale)
            hits, mass_have, mass_top = h.sum(dim=1), mh.sum(dim=1), mt.sum(dim=1)
        else:
            hits, mass_have, mass_top = self._measure_torch(plan, blocks, host_k, q, kr, have, scale)
        for i, j in enumerate(rows.tolist()):
            sel, spec = plan.labels[j]
            self.events.prefetch(sel, spec, layer, int(hits[i]), hkv * int(kr[i]),
                                 float(mass_have[i]), float(mass_top[i]))  # fmt: skip

    def _measure_recall(self, plan: StepPlan, layer: int, q: torch.Tensor, scale: float, attended: torch.Tensor):
        """Tokens of ``host_sync``'s set for the sampled rows' real queries ``q`` that their attended sets
        (``[n, Hkv, k]`` host slots) hold, per row (:meth:`PrefetchEvents.recall`)."""
        rows = plan.sampled
        blocks = self._blocks_of(plan, "sampled", rows)
        _, want = self._verifier.select(q, blocks, self.host.k[layer], plan.k, scale, self.index("host"), layer)
        kr = plan.top_k[rows].view(-1, 1, 1)
        cols = torch.arange(plan.k)
        big = torch.iinfo(torch.int64).max  # padding past a row's top_k: matches no slot
        held = torch.where(cols < kr, attended, big).sort(dim=2).values
        at = torch.searchsorted(held, want).clamp(max=plan.k - 1)
        found = (held.gather(2, at) == want) & (cols < kr)
        hkv = want.shape[1]
        for i, j in enumerate(rows.tolist()):
            sel, spec = plan.labels[j]
            self.events.recall(sel, spec, int(found[i].sum()), hkv * int(kr[i]))

    def _measure_torch(self, plan, blocks, host_k, q, kr, have, scale):
        """:meth:`_measure`'s counts with PyTorch operations: ``(hits, mass_have, mass_top)`` per row."""
        _, _, score = self._exact.score(q, blocks, host_k, plan.k, scale, None, 0)
        prob = score.exp()  # [n, Hkv, P]: position p at index p
        top = prob.topk(plan.k, dim=-1)
        valid = torch.arange(plan.k) < kr  # [n, 1, k]
        hit = (have.unsqueeze(-1) == top.indices.unsqueeze(-2)) & valid.unsqueeze(-1) & valid.unsqueeze(-2)
        hits = hit.any(dim=-1).sum(dim=(1, 2))
        mass_have = (prob.gather(-1, have) * valid).sum(dim=(1, 2))
        mass_top = (top.values * valid).sum(dim=(1, 2))
        return hits, mass_have, mass_top

    def end_step(self) -> None:
        """Finish the step's copies (no layer left to wait for them) and report its counts."""
        self.schedule.end_step()
        self.tally.flush(self.events)
