"""Flat row indices of a sparse step's per-layer copies on the fused C path, built once per step and read by every layer.

Every per-layer move of the fused path (:mod:`dd_sglang.prefetch.layer_assembly`) is a list of rows of
``head_dim`` elements: a query head, a KV head's key or value. :func:`build_layer_rows` turns a
:class:`~dd_sglang.prefetch.plan.StepPlan` into those lists once per step, so that each layer makes one
indexed copy per move instead of a chain of indexing, permuting and reshaping operations (each of
which costs the forward thread a PyTorch dispatch per layer):

* **Resident set** (a step with exact rows only: their dense call reads the ring). ``res_src`` / ``res_dst``: device-pool rows (``[slots x
  Hkv, D]``) and ring-slot rows of columns ``[0, n_res)``.
* **Speculated K/V.** ``spec.dst``: the ring-slot row of each speculated
  token's own column per KV head; its source row depends on the stride of
  the layer's new K/V (:meth:`SpecKVRows.src`; both in ``LayerRows.spec``).
* **Fixed sets.** ``fixed_src`` ``[layers, m]``: host-tier rows (``[slots x
  Hkv, D]`` per layer) of the fixed rows' critical sets; ``fixed_dst``:
  their ring-slot rows (columns ``[n_res, n_res + k)``).
* **Fused attention** (:func:`~dd_sglang.kernels.native.sparse_attend`): ``q_tok`` /
  ``out_tok`` ``[R, P]``, each query position's input token and output token (-1: no token
  rides there), the step's mask, contiguous, and ``res_slots`` ``[R, n_res]``, the device-pool
  slots of the resident columns (the kernel reads them from the pool, not the ring); together
  ``LayerRows.fused``.
* **Selection queries.** ``sel_rows``: per ahead group, rows of the layer's
  queries in the order :func:`~dd_sglang.prefetch.ahead_selection.selection_queries`
  returns them (``[n, Hkv x Q x G, D]``).

A ring slot is ``[R_reserved, Hkv, N_reserved, D]``; ring rows are
``(r x Hkv + h) x N_reserved + column`` (:func:`~dd_sglang.prefetch.gather.ring_rows`).
Every index is int64 on the CPU (the only place these rows are used: the CPU
path with the C copies).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dd_sglang.prefetch.gather import flat_rows, ring_rows
from dd_sglang.prefetch.plan import StepPlan


@dataclass
class SpecKVRows:
    """Where the speculated tokens' own K/V go (module docstring, "Speculated K/V"); ``[n]`` int64:
    ``dst`` the ring-slot row per token and KV head, ``token`` / ``head`` its token and KV head."""

    dst: torch.Tensor
    token: torch.Tensor
    head: torch.Tensor
    _src: dict[int, torch.Tensor] = field(default_factory=dict)

    def src(self, token_stride: int) -> torch.Tensor:
        """Source rows of the speculated K (or V) for new K/V whose token stride is ``token_stride``
        rows of ``head_dim`` (``k3.stride(0) // head_dim``; heads ``head_dim`` apart)."""
        src = self._src.get(token_stride)
        if src is None:
            src = self._src[token_stride] = self.token * token_stride + self.head
        return src


@dataclass(frozen=True)
class FusedAttendRows:
    """The fused attention's inputs (module docstring, "Fused attention"), contiguous CPU tensors:
    ``q_tok`` / ``out_tok`` ``[R, P]`` int64, ``mask`` ``[R, P, N]`` bool, ``res_slots`` ``[R, n_res]`` int64."""

    q_tok: torch.Tensor
    out_tok: torch.Tensor
    mask: torch.Tensor
    res_slots: torch.Tensor


@dataclass(frozen=True)
class LayerRows:
    """One step's flat row indices (module docstring); ``[n]`` int64 CPU tensors."""

    res_src: torch.Tensor
    res_dst: torch.Tensor
    spec: SpecKVRows
    sel_rows: tuple[torch.Tensor, ...]
    fused: FusedAttendRows


def build_layer_rows(plan: StepPlan, hkv: int, hq: int, slot_shape: torch.Size) -> LayerRows:
    """The step's :class:`LayerRows` for ``hkv`` KV heads, ``hq`` query heads and ring slots of
    ``slot_shape`` (``[R_reserved, Hkv, N_reserved, D]``).

    Raises:
        ValueError: ``hq`` is not a multiple of ``hkv``, or the slot is smaller than the plan.
    """
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    r, p, g, c = plan.num_rows, plan.layout.positions, hq // hkv, plan.layout.columns
    if slot_shape[0] < r or slot_shape[1] != hkv or slot_shape[2] < c:
        raise ValueError(f"ring slot {tuple(slot_shape)} is smaller than the plan ({r} rows, {c} columns)")
    heads = torch.arange(hkv).view(1, hkv, 1, 1) * g + torch.arange(g).view(1, 1, 1, g)  # [1, Hkv, 1, G]
    qidx = plan.layout.qidx.to("cpu", torch.int64)
    # Each row's real query (position 0), then each speculated token at its position.
    tok = torch.cat([plan.rows.to("cpu", torch.int64), plan.spec.tokens.to("cpu", torch.int64)])
    row = torch.cat([torch.arange(r), plan.spec.rows.to("cpu", torch.int64)])
    pos = torch.cat([torch.zeros(r, dtype=torch.int64), plan.spec.query_pos.to("cpu", torch.int64)])
    columns = slot_shape[2]
    res = plan.layout.res_slots.to("cpu", torch.int64)  # [R, n_res], the same slots for every KV head
    res_src = flat_rows(res.unsqueeze(1).expand(-1, hkv, -1))
    res_dst = ring_rows(torch.arange(r), hkv, columns, 0, res.shape[1])
    spec_rows = plan.spec.rows.to("cpu", torch.int64).view(-1, 1)
    spec_cols = plan.spec.cols.to("cpu", torch.int64).view(-1, 1)
    hv = torch.arange(hkv).view(1, hkv)
    spec_dst = ((spec_rows * hkv + hv) * columns + spec_cols).flatten()
    spec_token = plan.spec.tokens.to("cpu", torch.int64).view(-1, 1).expand(-1, hkv).flatten()
    spec_head = hv.expand(spec_rows.shape[0], hkv).flatten()
    sel = []
    for grp in plan.selection.ahead:
        query = grp.query.to("cpu", torch.int64)  # [n, Q]
        n, nq = query.shape
        sel.append((query.view(n, 1, nq, 1) * hq + heads).flatten())  # [n, Hkv, Q, G]
    out_tok = torch.full((r, p), -1, dtype=torch.int64)
    out_tok[row, pos] = tok
    fused = FusedAttendRows(qidx.contiguous(), out_tok, plan.layout.mask.to("cpu").contiguous(), res.contiguous())
    return LayerRows(res_src, res_dst, SpecKVRows(spec_dst, spec_token, spec_head),
                     tuple(sel), fused)  # fmt: skip


def fixed_rows(plan: StepPlan, hkv: int, slot_shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
    """Host-tier source rows of every layer's fixed sets, ``[layers, n_fixed x Hkv x k]`` int64, and
    their ring-slot rows ``[n_fixed x Hkv x k]`` (columns ``[n_res, n_res + k)`` of plan rows
    ``[0, n_fixed)``), in the order :func:`~dd_sglang.prefetch.gather.flat_rows` lists them."""
    src = flat_rows(plan.fixed.slots)  # [L, n_fixed, Hkv, k] -> [L, n_fixed x Hkv x k]
    dst = ring_rows(torch.arange(plan.n_fixed), hkv, slot_shape[2], plan.layout.n_res, plan.layout.k)
    return src, dst
