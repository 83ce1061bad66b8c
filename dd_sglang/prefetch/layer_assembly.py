"""The CPU fast path's per-layer moves: resident set, speculated K/V, queries, fused attention.

On a CPU with the C kernel (:attr:`SparseStepRunner.fast`) every layer's moves are single indexed
copies over the rows of :mod:`~dd_sglang.prefetch.layer_rows`, built once per step: two C row copies
(the resident set from the device pool, each speculated position's own K/V) and one
``index_select`` (the folded queries). Where the fused C attention takes the layer (:func:`fused_takes`)
it reads the resident set from the pool and the queries from the forward's own tensor itself, so
only the speculated K/V are copied, and :meth:`FastAssembly.attend` runs it over the ring slot.
"""

from __future__ import annotations

import torch

from dd_sglang.kernels import native as native_kernel
from dd_sglang.kernels.sparse_decode import unfold_gqa
from dd_sglang.prefetch.layer_rows import LayerRows, build_layer_rows


def fused_takes(plan, q3: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor) -> bool:
    """Whether the fused C attention takes this layer (dtypes, layouts, group size): ``q3``
    ``[tokens, Hq, D]`` queries, ``k_buf``/``v_buf`` the device pool's ``[slots, Hkv, D]`` buffers."""
    d, st = k_buf.shape[2], q3.stride()
    return (q3.dtype in (torch.bfloat16, torch.float32) and st[2] == 1 and st[1] == d and v_buf.shape[2] == d
            and plan.layout.positions * (q3.shape[1] // k_buf.shape[1]) <= native_kernel.MAX_QUERIES
            and d <= native_kernel.MAX_HEAD_DIM)  # fmt: skip


class FastAssembly:
    """The fast path's :class:`LayerRows` of the current step and the layer's fused-attention inputs.

    Args:
        hkv: KV heads of the host tier.
    """

    def __init__(self, hkv: int):
        self.hkv = hkv
        self.key: tuple | None = None  # (plan, query heads, slot shape) of :attr:`rows`
        self.rows: LayerRows | None = None
        self.slot: tuple | None = None  # the layer's ring slot and device-pool K/V, for attend()

    def rows_of(self, plan) -> LayerRows | None:
        """The rows built for ``plan``, or None where this step built none (not on the fast path)."""
        return self.rows if self.key is not None and self.key[0] is plan else None

    def layer_rows(self, plan, hq: int, slot_shape: torch.Size) -> LayerRows:
        """The step's :class:`LayerRows` (built at the first layer that asks, then reused)."""
        key = self.key
        if key is None or key[0] is not plan or key[1] != hq or key[2] != slot_shape:
            self.rows = build_layer_rows(plan, self.hkv, hq, slot_shape)
            self.key = (plan, hq, slot_shape)
        return self.rows

    def assemble(self, plan, q3, k3, v3, k_buf, v_buf, slot_k, slot_v, keys, values, fused: bool):
        """The layer's resident set, speculated K/V and folded queries (module docstring). Returns the
        ``[R, Hkv, P x group, D]`` queries, or None where ``fused``: :meth:`attend` then runs the fused kernel."""
        d = k_buf.shape[2]
        rows = self.layer_rows(plan, q3.shape[1], slot_k.shape)
        row_bytes = d * k_buf.element_size()
        if not fused or plan.exact.batch_rows:  # the fused kernel reads the resident set from the pool itself
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
        if fused:
            self.slot = (slot_k, slot_v, k_buf, v_buf)
            return None
        q = q3.reshape(-1, q3.shape[2]).index_select(0, rows.q_rows)
        return q.view(plan.num_rows, k_buf.shape[1], -1, q3.shape[2])

    def attend(self, q3: torch.Tensor, out: torch.Tensor, scale: float, in_place_sets: tuple | None) -> None:
        """The fused C attention of every sparse row over the layer's ring slot, into ``out``
        (``[tokens, Hq, Dv]``); ``in_place_sets``: the layer's in-place critical sets, or None."""
        f = self.rows.fused
        slot_k, slot_v, pool_k, pool_v = self.slot
        native_kernel.sparse_attend(q3, f.q_tok, slot_k, slot_v, f.mask, out, f.out_tok, scale,
                                    (pool_k, pool_v, f.res_slots), in_place_sets)  # fmt: skip

    @staticmethod
    def scatter(plan, rows: LayerRows | None, o: torch.Tensor, out: torch.Tensor) -> None:
        """Write the sparse attention's output ``o`` (``[R, Hkv, P x G, Dv]``) into the layer's output
        ``out`` (``[tokens, Hq, Dv]``, contiguous): each row's real query and each speculated position;
        one ``index_copy_`` through ``rows`` where the step has them."""
        dv = out.shape[2]
        if rows is not None:
            out.view(-1, dv).index_copy_(0, rows.out_dst, o.reshape(-1, dv).index_select(0, rows.out_src).to(out.dtype))
            return
        o = unfold_gqa(o, plan.layout.positions).to(out.dtype)
        out[plan.rows.to(out.device)] = o[:, 0]
        spec = plan.spec
        if spec.rows.numel():
            out[spec.tokens] = o[spec.rows, spec.query_pos]
