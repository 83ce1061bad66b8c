"""Attenders: one layer's sparse attention of every sparse row (the ``attend`` stage, :mod:`~dd_sglang.prefetch.profile`).

* :class:`FusedAttender` (``fused_c``, the CPU profile): the C kernel attends every sparse row in one
  call, reading the resident set from the device pool, the queries from the forward's own tensor and
  the critical set from the ring slot or, read in place, the host tier
  (:func:`dd_sglang.kernels.native_attend.sparse_attend`); only the speculated positions' own K/V are
  copied into the slot (:mod:`dd_sglang.prefetch.layer_assembly`).
* :class:`GatheredAttender` (``flashinfer``, ``torch``): the resident set and the speculated K/V are
  gathered into the ring slot beside the critical set with PyTorch indexing, the queries folded by
  GQA group, and :class:`~dd_sglang.kernels.dispatch.SparseAttention` (planned once per step) attends:
  FlashInfer on CUDA, the PyTorch reference elsewhere; the output is scattered back to the batch rows.

Both take ``begin(plan)`` once per step, then per layer ``inputs`` (returning :class:`LayerInputs`)
and ``attend``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dd_sglang.kernels.dispatch import SparseAttention
from dd_sglang.kernels.sparse_decode import fold_gqa, unfold_gqa
from dd_sglang.prefetch.layer_assembly import FastAssembly
from dd_sglang.prefetch.layer_rows import LayerRows


@dataclass(frozen=True)
class LayerInputs:
    """One layer's attention inputs for every sparse row.

    Attributes:
        keys, values: ``[R, Hkv, columns, D]`` views of the layer's ring slot (the columns the step's mask,
            ``plan.layout.mask``, says each query reads; exact rows' contexts are read from here).
        q: ``[R, Hkv, P x group, D]`` folded queries (:class:`GatheredAttender`), or None (the fused C
            attention reads the forward's queries itself).
        slot_k, slot_v: the whole slot (``[reserved rows, Hkv, reserved columns, D]``).
        pool_k, pool_v: the device pool's ``[slots, Hkv, D]`` buffers of the layer.
        sets: the layer's critical sets read in place (:meth:`~dd_sglang.prefetch.sources.InPlaceReads.layer_sets`)
            or None.
    """

    keys: torch.Tensor
    values: torch.Tensor
    q: torch.Tensor | None
    slot_k: torch.Tensor
    slot_v: torch.Tensor
    pool_k: torch.Tensor
    pool_v: torch.Tensor
    sets: tuple | None


class FusedAttender:
    """The ``fused_c`` attender (module docstring).

    Args:
        hkv: KV heads of the host tier.
    """

    #: The fused kernel reads the resident columns from the device pool (the ring slot's are not filled).
    reads_pool = True

    def __init__(self, hkv: int):
        self.assembly = FastAssembly(hkv)

    def begin(self, plan, ring) -> FusedAttender:
        """Nothing to plan: the kernel takes the step's mask and rows (built at the first layer)."""
        return self

    def rows(self, plan) -> LayerRows | None:
        """The step's :class:`~dd_sglang.prefetch.layer_rows.LayerRows` (the inline ahead selection reads
        its query rows), or None before the first layer built them."""
        return self.assembly.rows_of(plan)

    def inputs(self, plan, q3, k3, v3, pool_k, pool_v, slot_k, slot_v, sets) -> LayerInputs:
        """The layer's inputs: each speculated position's own K/V copied into its column (and, where
        the step has exact rows, the resident set too: their dense call reads the slot)."""
        r, c = plan.num_rows, plan.layout.columns
        keys, values = slot_k[:r, :, :c], slot_v[:r, :, :c]
        self.assembly.assemble(plan, q3, k3, v3, pool_k, pool_v, slot_k, slot_v, keys, values)
        return LayerInputs(keys, values, None, slot_k, slot_v, pool_k, pool_v, sets)

    def attend(self, plan, q3: torch.Tensor, x: LayerInputs, out: torch.Tensor, scale: float) -> None:
        """The fused C attention of every sparse row into ``out`` (``[tokens, Hq, Dv]``)."""
        self.assembly.attend(q3, out, scale, x)


class GatheredAttender:
    """The ``flashinfer`` / ``torch`` attender (module docstring).

    Args:
        device: the device pool's device.
        impl: ``torch`` (:class:`SparseAttention`'s ``impl``), or None for ``DD_SPARSE_ATTENTION``, else ``auto``
            (FlashInfer on CUDA where it imports, the PyTorch reference elsewhere).
    """

    reads_pool = False

    def __init__(self, device: torch.device, impl: str | None = None):
        self.attention = SparseAttention(device, impl)
        self._batch_rows: torch.Tensor | None = None

    def begin(self, plan, ring) -> GatheredAttender:
        """Plan the step's attention over the ring's layout (``[slots, rows, Hkv, columns, D]``) and put
        the plan rows' batch rows on the device (once a step, not once a layer)."""
        _, _, hkv, columns, head_dim = ring.shape
        self.attention.plan(plan.layout.mask, hkv, None, columns, ring.dtype, ring.device, head_dim)
        self._batch_rows = plan.rows.to(ring.device)
        return self

    def rows(self, plan) -> None:
        """No per-step row tables."""
        return None

    def inputs(self, plan, q3, k3, v3, pool_k, pool_v, slot_k, slot_v, sets) -> LayerInputs:
        """Resident set and speculated K/V into the slot beside the critical set; folded queries."""
        layout, spec = plan.layout, plan.spec
        r, c, n_res = plan.num_rows, layout.columns, layout.n_res
        keys, values = slot_k[:r, :, :c], slot_v[:r, :, :c]
        keys[:, :, :n_res] = pool_k[layout.res_slots].transpose(1, 2)
        values[:, :, :n_res] = pool_v[layout.res_slots].transpose(1, 2)
        if spec.rows.numel():
            keys[spec.rows, :, spec.cols] = k3[spec.tokens].to(keys.dtype)
            values[spec.rows, :, spec.cols] = v3[spec.tokens].to(values.dtype)
        q = fold_gqa(q3[layout.qidx], pool_k.shape[1])
        return LayerInputs(keys, values, q, slot_k, slot_v, pool_k, pool_v, sets)

    def attend(self, plan, q3: torch.Tensor, x: LayerInputs, out: torch.Tensor, scale: float) -> None:
        """:class:`SparseAttention` over the slot, written into ``out`` (``[tokens, Hq, Dv]``): each row's
        real query and each speculated position."""
        o = unfold_gqa(self.attention.run(x.q, x.keys, x.values, scale), plan.layout.positions).to(out.dtype)
        out[self._batch_rows] = o[:, 0]
        spec = plan.spec
        if spec.rows.numel():
            out[spec.tokens] = o[spec.rows, spec.query_pos]
