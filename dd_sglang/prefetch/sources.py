"""Sources: how a step's critical sets reach attention (the ``source`` stage, :mod:`~dd_sglang.prefetch.profile`).

* :class:`RingCopies` (``copy_ahead``, ``copy_inline``): every critical set is copied from the host
  tier into the layer ring. The fixed rows' sets (chosen before the step) go through the transfer
  schedule, ``depth`` layers ahead on its copy worker or on the forward thread when the layer waits
  (:mod:`dd_sglang.prefetch.schedule`); the sets chosen at attention time (sync rows, a verified
  set's misses) are copied right away.
* :class:`InPlaceReads` (``in_place``, the CPU profile): nothing is copied. The step keeps each layer's
  critical sets as host slots (``[layers, R, Hkv, k]``, -1 where a column is not read in place) and
  the fused C attention reads those rows from the host tier itself, as it reads the resident set
  from the device pool. On a CPU the two tiers are the same memory: a copy into the ring would
  read every row once to write it, then again to attend to it. A step under
  :data:`~dd_sglang.kernels.native.ATTEND_PARALLEL_TASKS` (row, KV head) pairs (unless
  ``experimental.transfer`` is ``in_place``), or with exact rows (their dense call reads the ring),
  is served by its :class:`RingCopies` instead.

The runner calls ``begin(plan)`` once per step, which returns the source serving that step; the
per-layer calls (``slot``, ``put``, ``put_verified``, ``layer_sets``, ``done``) go to it and test no mode.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dd_sglang.kernels import native as native_kernel
from dd_sglang.prefetch.gather import RingGather, flat_rows
from dd_sglang.prefetch.layer_rows import fixed_rows
from dd_sglang.prefetch.schedule import TransferSchedule
from dd_sglang.prefetch.verify import VerifiedSets


class RingCopies:
    """The ``copy_ahead`` / ``copy_inline`` source (module docstring).

    Args:
        host: the host tier (``k``/``v`` ``[layers, slots, Hkv, D]``, ``layer_num``).
        schedule: the :class:`TransferSchedule` (its ``inline`` says ahead or inline).
        gather: the :class:`RingGather`.
        tally: the step's :class:`~dd_sglang.prefetch.events.StepTally` (bytes copied).
    """

    def __init__(self, host, schedule: TransferSchedule, gather: RingGather, tally):
        self.host = host
        self.schedule = schedule
        self.gather = gather
        self.tally = tally
        #: The C row copies serve the fixed rows (a CPU ring with the C kernel, a contiguous host tier).
        self.c_rows = gather.native and host.k.is_contiguous()
        #: Bytes of one (token, KV head)'s K and V in the host tier.
        self.kv_row_bytes = 2 * host.k.shape[3] * host.k.element_size()
        self._slot: Callable[[int], tuple[torch.Tensor, torch.Tensor]] = self.ring.slot
        self._done: Callable[[int], None] = _nothing

    @property
    def ring(self):
        """The :class:`~dd_sglang.kvcache.layer_buffers.LayerRingBuffer`."""
        return self.schedule.ring

    def begin(self, plan) -> RingCopies:
        """Start the step's copies of the fixed rows' sets (every layer, through the schedule); bind
        :meth:`slot` and :meth:`done` for the step (the schedule's, or the bare ring's when nothing is copied ahead)."""
        if plan.n_fixed:
            self.schedule.begin_step(list(range(self.host.layer_num)), self._copy_fn(plan))
            self._slot, self._done = self.schedule.wait, self.schedule.done
        else:
            self.schedule.end_step()
            self._slot, self._done = self.ring.slot, _nothing
        return self

    def slot(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's ``[reserved rows, Hkv, reserved columns, D]`` K/V slot, once its copy is done
        (:meth:`TransferSchedule.wait`)."""
        return self._slot(layer)

    def _copy_fn(self, plan) -> Callable[[int, torch.Tensor, torch.Tensor], None]:
        """The copy of layer ``l``'s fixed rows (plan rows ``[0, n_fixed)``) into its ring slot."""
        if self.c_rows:
            return self._c_copy_fn(plan)
        rows, c0, k = slice(0, plan.n_fixed), plan.layout.n_res, plan.layout.k
        gather, tally, n_slots = self.gather, self.tally, self.ring.n_slots

        def copy(layer: int, k_slot: torch.Tensor, v_slot: torch.Tensor) -> None:
            tally.copied += gather.copy(layer, flat_rows(plan.fixed.slots[layer]), k_slot, v_slot, rows, c0, k,
                                        layer % n_slots)  # fmt: skip

        return copy

    def _c_copy_fn(self, plan) -> Callable[[int, torch.Tensor, torch.Tensor], None]:
        """:meth:`_copy_fn` with the C row copies: every layer's source rows built here, once; one C call a layer."""
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

    def put(self, plan, layer: int, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Copy a set chosen at attention time, host slots ``slots`` (``[n, Hkv, w]``), into columns
        ``[n_res, n_res + w)`` of plan rows ``rows`` of the layer's slot (synchronously)."""
        k_slot, v_slot = self.ring.slot(layer)
        self.tally.copied += self.gather.copy_sets(layer, slots, k_slot, v_slot, rows, plan.layout.n_res,
                                                   layer % self.ring.n_slots)  # fmt: skip

    def put_verified(self, plan, layer: int, rows: torch.Tensor, v: VerifiedSets, sampled: bool) -> torch.Tensor | None:
        """Copy the verified sets' fetched columns (``v.fetched``, the misses only) of plan rows ``rows``
        into the layer's slot. Returns, where ``sampled``, the ``[n_ahead, Hkv, k]`` host slots attention reads."""
        r, h, c = v.fetched.nonzero(as_tuple=True)
        if r.numel():  # two host-to-device copies: where the misses go, and their K and V
            slot_k, slot_v = self.ring.slot(layer)
            src = v.slots[r, h, c]
            kv = torch.stack([self.host.k[layer][src, h], self.host.v[layer][src, h]])  # [2, m, D]
            where = torch.stack([rows[r], h, plan.layout.n_res + c]).to(slot_k.device, non_blocking=True)
            kv = kv.to(slot_k.device, slot_k.dtype, non_blocking=True)
            slot_k[where[0], where[1], where[2]] = kv[0]
            slot_v[where[0], where[1], where[2]] = kv[1]
            self.tally.copied += int(src.numel()) * self.kv_row_bytes
        if not sampled:
            return None
        attended = plan.fixed.slots[layer][: plan.n_ahead].clone()
        attended[rows] = v.slots
        return attended

    def layer_sets(self, plan, layer: int) -> None:
        """No set is read in place."""
        return None

    def done(self, layer: int) -> None:
        """After ``layer``'s attention: its slot may take the next copy."""
        self._done(layer)

    def end_step(self) -> None:
        """No layer is left to wait for a copy."""
        self.schedule.end_step()


def _nothing(layer: int) -> None:
    return None


class InPlaceReads:
    """The ``in_place`` source (module docstring).

    Args:
        host: the host tier.
        copies: the :class:`RingCopies` that serves the steps not read in place.
        tally: the step's :class:`~dd_sglang.prefetch.events.StepTally` (bytes read in place count as copied).
        always: ``experimental.transfer`` is ``in_place`` (else from
            :data:`~dd_sglang.kernels.native.ATTEND_PARALLEL_TASKS` (row, KV head) pairs only).
    """

    def __init__(self, host, copies: RingCopies, tally, always: bool):
        self.host = host
        self.copies = copies
        self.tally = tally
        self.always = always
        #: ``[layers, R, Hkv, k]`` host slots, -1 where a column is not read in place; None when the
        #: step copies into the ring.
        self.table: torch.Tensor | None = None
        self.rows_read = 0  # host rows (K or V, per KV head) the step's fixed rows read in place, per layer
        self._row_bytes = copies.kv_row_bytes

    @property
    def ring(self):
        """The layer ring (the fused attention's slot: resident and speculated columns)."""
        return self.copies.ring

    def reads(self, plan) -> bool:
        """Whether a step of ``plan.num_rows`` rows reads its critical sets in place (at least
        :data:`~dd_sglang.kernels.native.ATTEND_PARALLEL_TASKS` (row, KV head) tasks, or ``always``):
        below that the attention runs on one thread, and scattered host rows read there cost more
        than a copy on every thread (``bench/results/archive/decode_speed_cpu.json``: in place over
        inline 0.97x at batch 1, 1.05x at 4k x 8)."""
        return self.always or plan.num_rows * self.host.k.shape[2] >= native_kernel.ATTEND_PARALLEL_TASKS

    def begin(self, plan) -> InPlaceReads | RingCopies:
        """The step's source: this one with its :attr:`table` of the fixed rows' sets (the columns each
        row's mask reads, the rest -1), or :attr:`copies` for a step that does not read in place or has
        exact rows (their dense call reads the ring)."""
        self.table = None
        if not self.reads(plan) or plan.exact.batch_rows:
            return self.copies.begin(plan)
        self.copies.end_step()
        n_layers, hkv = self.host.layer_num, self.host.k.shape[2]
        table = torch.full((n_layers, plan.num_rows, hkv, plan.layout.k), -1, dtype=torch.int64)
        self.rows_read = 0
        if plan.n_fixed:
            n_res, k = plan.layout.n_res, plan.layout.k
            reads = plan.layout.mask[: plan.n_fixed, 0, n_res : n_res + k].to("cpu")  # [n_fixed, k]
            table[:, : plan.n_fixed, :, :k] = torch.where(reads[None, :, None, :], plan.fixed.slots, -1)
            self.rows_read = int(reads.sum()) * hkv
        self.table = table
        return self

    def slot(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's ring slot (nothing to wait for)."""
        return self.ring.slot(layer)

    def put(self, plan, layer: int, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Record host slots ``slots`` (``[n, Hkv, w]``) as the critical columns of plan rows ``rows``."""
        self.table[layer, rows, :, : slots.shape[2]] = slots
        self.tally.copied += int(slots.numel()) * self._row_bytes

    def put_verified(self, plan, layer: int, rows: torch.Tensor, v: VerifiedSets, sampled: bool) -> torch.Tensor | None:
        """The verified sets of plan rows ``rows`` replace their columns in the table (masked columns stay -1).
        Returns, where ``sampled``, the ``[n_ahead, Hkv, k]`` host slots attention reads."""
        k = plan.layout.k
        table = self.table
        table[layer, rows, :, :k] = torch.where(table[layer, rows, :, :k] >= 0, v.slots, -1)
        self.tally.copied += int(v.fetched.sum()) * self._row_bytes
        return table[layer, : plan.n_ahead].clone() if sampled else None

    def layer_sets(self, plan, layer: int) -> tuple:
        """The layer's in-place sets for the fused attention: ``(host K, host V, [R, Hkv, k] slots, n_res)``."""
        self.tally.copied += self.rows_read * self._row_bytes
        return self.host.k[layer], self.host.v[layer], self.table[layer], plan.layout.n_res

    def done(self, layer: int) -> None:
        """Nothing was copied for the layer."""

    def end_step(self) -> None:
        """No layer is left to wait for a copy."""
        self.copies.end_step()
