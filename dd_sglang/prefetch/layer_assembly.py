"""The fused C attention's per-layer moves (the ``fused_c`` attender, :mod:`dd_sglang.prefetch.attenders`).

The fused attention reads the resident set from the device pool and the queries from the forward's
own tensor itself, so per layer only each speculated position's own K/V is copied into its column of
the ring slot: one C row copy over the rows of :mod:`~dd_sglang.prefetch.layer_rows`, built once per
step. A step with exact rows also copies the resident set into the slot (their dense call reads it
from there). :meth:`FastAssembly.attend` then runs the kernel over the slot.
"""

from __future__ import annotations

import torch

from dd_sglang.kernels import native as native_kernel
from dd_sglang.prefetch.layer_rows import LayerRows, build_layer_rows


class FastAssembly:
    """The fused attention's :class:`LayerRows` of the current step, and its per-layer copies and call.

    Args:
        hkv: KV heads of the host tier.
    """

    def __init__(self, hkv: int):
        self.hkv = hkv
        self.key: tuple | None = None  # (plan, query heads, slot shape) of :attr:`rows`
        self.rows: LayerRows | None = None

    def rows_of(self, plan) -> LayerRows | None:
        """The rows built for ``plan``, or None before a layer of it built them."""
        return self.rows if self.key is not None and self.key[0] is plan else None

    def layer_rows(self, plan, hq: int, slot_shape: torch.Size) -> LayerRows:
        """The step's :class:`LayerRows` (built at the first layer that asks, then reused)."""
        key = self.key
        if key is None or key[0] is not plan or key[1] != hq or key[2] != slot_shape:
            self.rows = build_layer_rows(plan, self.hkv, hq, slot_shape)
            self.key = (plan, hq, slot_shape)
        return self.rows

    def assemble(self, plan, q3, k3, v3, k_buf, v_buf, slot_k, slot_v, keys, values) -> None:
        """The layer's speculated K/V (and, with exact rows, resident set) into the slot (module docstring).

        ``q3``: ``[tokens, Hq, D]``; ``k3``/``v3``: ``[tokens, Hkv, D]`` the layer's new K/V; ``k_buf``/``v_buf``:
        the device pool's ``[slots, Hkv, D]``; ``slot_k``/``slot_v``: the whole ring slot; ``keys``/``values``:
        its ``[R, Hkv, columns, D]`` views."""
        d = k_buf.shape[2]
        rows = self.layer_rows(plan, q3.shape[1], slot_k.shape)
        row_bytes = d * k_buf.element_size()
        if plan.exact.batch_rows:  # the fused kernel reads the resident set from the pool itself
            native_kernel.gather_rows_unchecked(k_buf.data_ptr(), v_buf.data_ptr(), slot_k.data_ptr(),
                                                slot_v.data_ptr(), rows.res_src, rows.res_dst, row_bytes)  # fmt: skip
        spec_kv = rows.spec
        if spec_kv.dst.numel():
            for new, slot, dst in ((k3, slot_k, keys), (v3, slot_v, values)):
                st = new.stride()
                if new.dtype == slot.dtype and st[2] == 1 and st[1] == d and st[0] % d == 0:
                    native_kernel.copy_rows_unchecked(new.data_ptr(), slot.data_ptr(), spec_kv.src(st[0] // d),
                                                      spec_kv.dst, row_bytes)  # fmt: skip
                else:
                    spec = plan.spec
                    dst[spec.rows, :, spec.cols] = new[spec.tokens].to(dst.dtype)

    def attend(self, q3: torch.Tensor, out: torch.Tensor, scale: float, x) -> None:
        """The fused C attention of every sparse row over the layer's ring slot, into ``out``
        (``[tokens, Hq, Dv]``); ``x``: the layer's :class:`~dd_sglang.prefetch.attenders.LayerInputs`
        (the slot, the device pool's K/V, the sets read in place or None)."""
        f = self.rows.fused
        native_kernel.sparse_attend(q3, f.q_tok, x.slot_k, x.slot_v, f.mask, out, f.out_tok, scale,
                                    (x.pool_k, x.pool_v, f.res_slots), x.sets)  # fmt: skip
