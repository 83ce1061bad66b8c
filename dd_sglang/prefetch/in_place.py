"""Critical sets read in place from the host tier (``experimental.transfer`` ``in_place``).

With ``in_place`` (``auto`` on a CPU device with the C kernel, for a step of at least
:data:`~dd_sglang.kernels.native.ATTEND_PARALLEL_TASKS` (row, KV head) pairs) nothing is copied
into the layer ring for the fixed rows, the sync rows or the verified sets: the step keeps each
layer's critical sets as host slots (``[layers, R, Hkv, k]``, -1 where a column is not read in
place) and the fused C attention reads those rows from the host tier itself, as it reads the
resident set from the device pool. On a CPU the two tiers are the same memory: a copy into the
ring would read every row once to write it, then again to attend to it. A step with exact rows
(their dense call reads the ring) or a layer the fused attention does not take copies as before.

Whether a step reads in place is decided once, when its plan is built (:meth:`InPlaceSets.begin`).
"""

from __future__ import annotations

import torch

from dd_sglang.kernels import native as native_kernel
from dd_sglang.prefetch.gather import flat_rows


class InPlaceSets:
    """The step's in-place critical-set table (module docstring).

    Args:
        host: the host tier (``k``/``v`` ``[layers, slots, Hkv, D]``, ``layer_num``).
        ring: the :class:`~dd_sglang.kvcache.layer_buffers.LayerRingBuffer`.
        gather: the :class:`~dd_sglang.prefetch.gather.RingGather` (for a layer that falls back to the ring).
        tally: the step's :class:`~dd_sglang.prefetch.events.StepTally` (bytes read in place count as copied).
        enabled: whether steps may read in place at all (the CPU fast path, ``in_place`` or ``auto`` on a CPU).
        always: ``experimental.transfer`` is ``in_place`` (else ``auto``: only from
            :data:`~dd_sglang.kernels.native.ATTEND_PARALLEL_TASKS` (row, KV head) pairs).
    """

    def __init__(self, host, ring, gather, tally, enabled: bool, always: bool):
        self.host = host
        self.ring = ring
        self.gather = gather
        self.tally = tally
        self.enabled = enabled
        self.always = always
        #: ``[layers, R, Hkv, k]`` host slots, -1 where a column is not read in place; None when the
        #: step copies into the ring.
        self.table: torch.Tensor | None = None
        self.rows_read = 0  # host rows (K or V, per KV head) the step's fixed rows read in place, per layer
        self.layer_sets: tuple | None = None  # the current layer's in-place sets, for the fused attention

    def reads(self, plan) -> bool:
        """Whether the step's attention reads its critical sets in place.

        With ``auto``, only a step with at least :data:`~dd_sglang.kernels.native.ATTEND_PARALLEL_TASKS`
        (row, KV head) tasks: below that the attention runs on one thread, and scattered host rows
        read there cost more than a copy on every thread (``bench/results/archive/decode_speed_cpu.json``:
        in place over inline 0.97x at batch 1, 1.05x at 4k x 8)."""
        if not self.enabled or self.ring.dtype != self.host.k.dtype:
            return False
        return self.always or plan.num_rows * self.host.k.shape[2] >= native_kernel.ATTEND_PARALLEL_TASKS

    def begin(self, plan) -> None:
        """Build the step's :attr:`table` with the fixed rows' sets (the columns each row's mask
        reads), the rest -1; None for a step that does not read in place or has exact rows (their
        dense call reads the ring)."""
        self.table = None
        if not self.reads(plan) or plan.exact.batch_rows:
            return
        n_layers, hkv = self.host.layer_num, self.host.k.shape[2]
        table = torch.full((n_layers, plan.num_rows, hkv, plan.layout.k), -1, dtype=torch.int64)
        if plan.n_fixed:
            n_res, k = plan.layout.n_res, plan.layout.k
            reads = plan.layout.mask[: plan.n_fixed, 0, n_res : n_res + k].to("cpu")  # [n_fixed, k]
            table[:, : plan.n_fixed, :, :k] = torch.where(reads[None, :, None, :], plan.fixed.slots, -1)
            self.rows_read = int(reads.sum()) * hkv
        else:
            self.rows_read = 0
        self.table = table

    def record(self, plan, layer: int, rows: torch.Tensor, slots: torch.Tensor, c0: int) -> None:
        """Record host slots ``slots`` (``[n, Hkv, w]``) as columns ``[c0, c0 + w)`` of plan rows ``rows``."""
        j = c0 - plan.layout.n_res
        self.table[layer, rows, :, j : j + slots.shape[2]] = slots
        self.tally.copied += 2 * int(slots.numel()) * self.host.k.shape[3] * self.host.k.element_size()

    def begin_layer(self, plan, layer: int, fused: bool, slot_k: torch.Tensor, slot_v: torch.Tensor) -> None:
        """Before ``layer``'s attention: its sets for the fused kernel (:attr:`layer_sets`), or, where
        the fused attention does not take the layer, copied into the ring slot's columns ``[n_res, ...)``
        (and no longer read in place this step)."""
        self.layer_sets = None
        if self.table is None:
            return
        if fused:
            self.layer_sets = (self.host.k[layer], self.host.v[layer], self.table[layer], plan.layout.n_res)
            self.tally.copied += 2 * self.rows_read * self.host.k.shape[3] * self.host.k.element_size()
            return
        crit = self.table[layer]  # a -1 column is masked (never read): any host row may fill it
        self.tally.copied += self.gather.copy(layer, flat_rows(crit.clamp(min=0)), slot_k, slot_v,
                                              slice(0, plan.num_rows), plan.layout.n_res, crit.shape[2],
                                              layer % self.ring.n_slots)  # fmt: skip
        crit.fill_(-1)
