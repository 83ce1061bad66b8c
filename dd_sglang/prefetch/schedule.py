"""Layer-aware transfer schedule: layer l's critical-set K/V is copied while earlier layers compute.

The critical set of decode step t+1 is fixed during step t (lookahead
selectors, :mod:`dd_sglang.prefetch.selectors`). Step t+1 then runs:

1. :meth:`TransferSchedule.begin_step` (the attention backend's
   ``init_forward_metadata``): waits until step t's selection jobs are done
   (they run on the *select worker*, off the forward thread), then queues the
   copies of layers ``0 .. w`` (``w`` = prefetch depth) on the *copy worker*.
2. Layer l's attention calls :meth:`TransferSchedule.wait` ``(l)``: it blocks
   only until layer l's copy is done (one event per layer), and records how long
   it blocked (the *exposed* wait, exported as ``dd_transfer_wait_seconds``).
3. When layer l's attention has consumed its slot it calls
   :meth:`TransferSchedule.done` ``(l)``, which queues layer ``l + w + 1``'s copy
   into the slot just freed. So layer l's copy is queued after layer
   ``l - w - 1``'s attention and runs while layers ``l - w .. l - 1`` compute;
   the slots in use never exceed ``w + 1`` (the
   :class:`~dd_sglang.kvcache.layer_buffers.LayerRingBuffer`).
4. During step t+1, each lookahead layer queues the selection of step t+2's
   set for that layer (:meth:`TransferSchedule.submit_select`); with
   ``select_inline=True`` the selection runs right there on the forward
   thread instead of the select worker, where it would compete with the
   forward's parallel regions for the same cores. On a CPU the runner sets it
   per step (``experimental.select: auto``): inline for a small step, and for a
   larger one the worker while the forward thread runs on one intra-op thread
   (``split``, :data:`dd_sglang.prefetch.runner.SPLIT_MIN_ROWS`).

Workers: two daemon threads (copy, select) fed by FIFO queues. With
``inline=True`` the copy runs on the forward thread instead, when
:meth:`TransferSchedule.wait` asks for it (no overlap, no thread hand-off: the
choice for a CPU "device", where the copy is a memory gather competing for the
same cores; ``bench.decode_speed`` measures both). PyTorch releases the GIL inside its ops, so on a CPU the gathers and
the forward's layers really run at once (2 cores here). On CUDA the copy
worker additionally issues the host-to-device copy on its own stream and
records a CUDA event per layer; :meth:`wait` makes the compute stream wait on
it (SGLang's ``LayerDoneCounter`` pattern in HiCache), and :meth:`done`
records an event on the compute stream that the copy reusing the slot waits
for. The CUDA branch is tested by ``tests/test_transfer_schedule_cuda.py``
where a GPU exists.

Every layer's timestamps (``time.perf_counter`` seconds) are kept for the last
step (:attr:`TransferSchedule.last_step`): copy start/end and wait start/end,
so the overlap (copy time that did not appear as wait) is computed from
recorded times, not inferred from throughput.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dd_sglang.kvcache.layer_buffers import LayerRingBuffer


@dataclass
class LayerTiming:
    """One layer's transfer in one step (``time.perf_counter`` seconds).

    ``hidden_s`` is the part of the copy that ran before attention started waiting for it:
    copy time that did not appear as wait.
    """

    layer: int
    queued: float = 0.0
    copy_start: float = 0.0
    copy_end: float = 0.0
    wait_start: float = 0.0
    wait_end: float = 0.0

    @property
    def copy_s(self) -> float:
        return self.copy_end - self.copy_start

    @property
    def wait_s(self) -> float:
        return self.wait_end - self.wait_start

    @property
    def hidden_s(self) -> float:
        return max(0.0, min(self.copy_end, self.wait_start) - self.copy_start)


class _Worker:
    """A daemon thread running callables from a FIFO queue; errors are kept for the caller."""

    def __init__(self, name: str, threads: int | None = None):
        self.threads = threads
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.pending = 0
        self.cv = threading.Condition()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        if self.threads is not None:  # PyTorch's intra-op thread count is per calling thread
            torch.set_num_threads(self.threads)
        while True:
            fn = self.q.get()
            try:
                fn()
            except BaseException as e:  # reported to the forward thread at its next wait
                self.error = e
            with self.cv:
                self.pending -= 1
                self.cv.notify_all()

    def submit(self, fn: Callable[[], None]) -> None:
        with self.cv:
            self.pending += 1
        self.q.put(fn)

    def drain(self) -> None:
        with self.cv:
            self.cv.wait_for(lambda: self.pending == 0)
        self.raise_error()

    def raise_error(self) -> None:
        if self.error is not None:
            e, self.error = self.error, None
            raise RuntimeError("dualdecoder transfer worker failed") from e


@dataclass
class _StepCopies:
    """One step's copies, replaced by a fresh one when the step ends.

    ``layers``: the step's layers in execution order; ``gather``: the step's copy function;
    ``next``: index into ``layers`` of the next copy to queue; ``done``: layer -> event set when its
    copy has finished (on the copy worker); ``cuda_done``: layer -> CUDA event recorded on the copy
    stream after its copy (CUDA only); ``timing``: layer -> its :class:`LayerTiming`.
    """

    layers: list[int] = field(default_factory=list)
    gather: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None
    next: int = 0
    done: dict[int, threading.Event] = field(default_factory=dict)
    cuda_done: dict[int, object] = field(default_factory=dict)
    timing: dict[int, LayerTiming] = field(default_factory=dict)


class TransferSchedule:
    """Per-layer copies of the critical set, ``depth`` layers ahead of attention (see module docstring).

    Args:
        ring: the :class:`LayerRingBuffer` whose slots the copies fill (its depth is the
            prefetch depth ``w``).
        on_step: called with a finished step's :class:`LayerTiming` list (the plugin exports
            ``dd_transfer_wait_seconds``, ``dd_transfer_copy_seconds`` and the hidden copy time).
    """

    def __init__(
        self,
        ring: LayerRingBuffer,
        on_step: Callable[[list[LayerTiming]], None] | None = None,
        inline: bool = False,
        select_inline: bool = False,
    ):
        self.ring = ring
        self.inline = inline
        self.select_inline = select_inline
        self.depth = ring.depth
        self.on_step = on_step
        self._cuda = ring.device.type == "cuda"
        self._copy = _Worker("dd-copy")
        # On a CPU the select worker shares the forward pass's cores: one intra-op thread, so its
        # ops do not also fan out over the cores the forward is using.
        self._select = _Worker("dd-select", threads=None if self._cuda else 1)
        self._stream = torch.cuda.Stream(device=ring.device) if self._cuda else None
        self._slot_free_evt: dict[int, object] = {}  # CUDA: slot -> compute-stream event after its last read
        self._step = _StepCopies()
        #: Timings of the last finished step, in layer order.
        self.last_step: list[LayerTiming] = []

    # ------------------------------------------------------------------ step
    def begin_step(
        self, layers: list[int], gather: Callable[[int, torch.Tensor, torch.Tensor], None]
    ) -> None:
        """Start a step whose ``layers`` (in execution order) read prefetched K/V.

        ``gather(layer, k_slot, v_slot)`` fills the ring slot of ``layer`` (called on the copy
        worker). Waits for the previous step's selection jobs first: they fix the indices
        these copies read.
        """
        self.end_step()
        self._select.drain()
        self._step = _StepCopies(layers=list(layers), gather=gather)
        if self.inline:  # each copy runs in wait(): nothing to queue
            return
        for _ in range(min(self.depth + 1, len(layers))):
            self._queue_next()

    def _queue_next(self) -> None:
        step = self._step
        if step.next >= len(step.layers):
            return
        layer = step.layers[step.next]
        step.next += 1
        evt = threading.Event()
        t = LayerTiming(layer, queued=time.perf_counter())
        step.done[layer] = evt
        step.timing[layer] = t
        k_slot, v_slot = self.ring.slot(layer)
        gather = step.gather
        slot_free = self._slot_free_evt.pop(layer % self.ring.n_slots, None)

        def job() -> None:
            t.copy_start = time.perf_counter()
            try:
                if self._cuda:
                    with torch.cuda.stream(self._stream):
                        if slot_free is not None:  # the layer that used this slot last has read it
                            self._stream.wait_event(slot_free)
                        gather(layer, k_slot, v_slot)
                        ev = torch.cuda.Event()
                        ev.record(self._stream)
                        step.cuda_done[layer] = ev
                else:
                    gather(layer, k_slot, v_slot)
            finally:
                t.copy_end = time.perf_counter()
                evt.set()

        self._copy.submit(job)

    def _copy_inline(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inline mode: ``layer``'s copy, now, on the calling thread (all of it is exposed wait)."""
        step = self._step
        if layer in step.timing or layer not in step.layers:
            raise KeyError(f"layer {layer} is not waiting for a copy in this step")
        k_slot, v_slot = self.ring.slot(layer)
        t = LayerTiming(layer)
        step.timing[layer] = t
        t.queued = t.copy_start = t.wait_start = time.perf_counter()
        step.gather(layer, k_slot, v_slot)
        t.copy_end = t.wait_end = time.perf_counter()
        return k_slot, v_slot

    def wait(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block until ``layer``'s copy is done; returns its ring slot ``(k, v)`` views.

        Raises:
            KeyError: ``layer`` was not queued in this step.
            RuntimeError: the copy failed (the worker's exception is chained).
        """
        if self.inline:
            return self._copy_inline(layer)
        step = self._step
        t = step.timing[layer]
        t.wait_start = time.perf_counter()
        step.done[layer].wait()
        self._copy.raise_error()
        ev = step.cuda_done.pop(layer, None)
        if ev is not None:
            torch.cuda.current_stream().wait_event(ev)
        t.wait_end = time.perf_counter()
        return self.ring.slot(layer)

    def done(self, layer: int) -> None:
        """``layer``'s slot has been consumed: queue the copy that reuses it; after the step's last
        layer, finish the step (its timings are reported then). On CUDA the reuse first waits for
        the compute stream's reads of the slot (an event recorded here)."""
        last = self._step.layers[-1] if self._step.layers else None
        if self.inline:
            if layer == last:
                self.end_step()
            return
        if self._cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.ring.device))
            self._slot_free_evt[layer % self.ring.n_slots] = ev
        self._queue_next()
        if layer == last:
            self.end_step()

    def end_step(self) -> None:
        """Wait for queued copies (also those no layer waited for) and keep the step's timings."""
        step = self._step
        if self.inline:  # copies no layer asked for still run: nothing is skipped
            for layer in step.layers:
                if layer not in step.timing:
                    self._copy_inline(layer)
        if not step.timing:
            return
        for evt in step.done.values():
            evt.wait()
        self._copy.raise_error()
        self.last_step = sorted(step.timing.values(), key=lambda t: t.layer)
        self._step = _StepCopies()
        if self.on_step is not None:
            self.on_step(self.last_step)

    # ------------------------------------------------------------------ selection
    def submit_select(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` (a next-step selection) on the select worker, or now with ``select_inline``."""
        if self.select_inline:
            fn()
        else:
            self._select.submit(fn)

    def drain_select(self) -> None:
        """Wait for every queued selection job (re-raises a failure)."""
        self._select.drain()
