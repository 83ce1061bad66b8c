"""What a sparse decode step's plan holds: :class:`StepPlan` and its parts.

:func:`dd_sglang.prefetch.plan.build_step_plan` builds one immutable :class:`StepPlan` per step
(its module docstring says how); the per-layer path reads it. The plan's facts are grouped by
concept: the fixed rows' sets (:class:`FixedSets`), the selector calls (:class:`Selections`),
the attention columns (:class:`ColumnLayout`), the riding speculated tokens
(:class:`RidingTokens`), the checked ahead rows (:class:`CheckedRows`), the exact rows
(:class:`ExactRows`) and per-row request facts (:class:`RowRequests`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dd_sglang.prefetch.scoring import RowBlocks
from dd_sglang.prefetch.selectors import Selector
from dd_sglang.prefetch.speculators import SpecState

__all__ = [
    "CheckedRows",
    "ColumnLayout",
    "ExactRows",
    "FixedSets",
    "RidingTokens",
    "RowRequests",
    "SelectionGroup",
    "Selections",
    "StepPlan",
]


@dataclass(frozen=True)
class SelectionGroup:
    """Rows that one selector serves at once.

    ``rows``: ``[n]`` int64 plan rows; ``query``: ``[n, Q]`` int64 token indices of the queries
    that drive the selection (the speculated positions, or the real one), and ``query_dev``, the
    same on the batch's device (indexing the layer's queries there without a copy per layer);
    ``blocks``: their :class:`RowBlocks`; ``k``: the largest ``top_k`` among them (columns past a
    row's own ``top_k`` are masked); ``dest``: for next-step selections, the rows' indices in
    :attr:`NextSets.rids`.
    """

    selector: Selector
    rows: torch.Tensor
    query: torch.Tensor
    blocks: RowBlocks
    k: int
    dest: torch.Tensor | None = None
    query_dev: torch.Tensor | None = None


@dataclass(frozen=True)
class FixedSets:
    """The fixed rows' critical sets (plan rows ``[0, n_fixed)``), copied layer by layer before attention.

    ``pos``, ``slots``: ``[layers, n_fixed, Hkv, k]`` int64 positions / host slots (padding points at
    slot 0, masked; may be an expanded view).
    """

    pos: torch.Tensor
    slots: torch.Tensor


@dataclass(frozen=True)
class Selections:
    """The step's selector calls and what they read.

    ``sync``: selections at attention time (groups of rows ``[n_fixed, R)``); ``ahead``: selections
    of the next step's sets, made after each layer's attention; ``blocks``: every row's candidate
    blocks; ``top_k``: ``[R]`` int64 each row's critical-set budget.
    """

    sync: tuple[SelectionGroup, ...]
    ahead: tuple[SelectionGroup, ...]
    blocks: RowBlocks
    top_k: torch.Tensor


@dataclass(frozen=True)
class ColumnLayout:
    """Each row's attention columns (module docstring, step 4) and the queries that read them.

    ``n_res``: resident columns; ``k``: critical-set columns (the largest ``top_k``); ``positions``:
    query positions per row, ``1 + S`` (the real one, then ``S`` speculated ones: 0 or 1, the
    ``dual_token`` speculator rides at most one); ``res_slots``: ``[R, n_res]`` int64 device slots (device);
    ``qidx``: ``[R, positions]`` int64 token index of each row's queries (the real one again where
    fewer tokens ride), device; ``mask``: ``[R, positions, columns]`` bool (device): the columns
    each row's queries read.
    """

    n_res: int
    k: int
    positions: int
    res_slots: torch.Tensor
    qidx: torch.Tensor
    mask: torch.Tensor

    @property
    def columns(self) -> int:
        """Attention columns per row: resident, critical, one per speculated position."""
        return self.n_res + self.k + max(self.positions - 1, 1)


@dataclass(frozen=True)
class RidingTokens:
    """The speculated tokens riding in the batch after its real rows, ``T`` of them, in token order.

    ``rows``, ``query_pos``, ``tokens``, ``cols``: ``[T]`` int64 (device) per token: its plan row,
    its query position (1..S), its token index and its own K/V column; ``states``: per token,
    ``(SpecState, riding index)``.
    """

    rows: torch.Tensor
    query_pos: torch.Tensor
    tokens: torch.Tensor
    cols: torch.Tensor
    states: tuple[tuple[SpecState, int], ...]


@dataclass(frozen=True)
class CheckedRows:
    """The ahead rows whose prefetched sets this step checks against the real query's set.

    ``verify_rows``: ``[n]`` int64 rows verified (and repaired) at every layer: every ahead row
    (:mod:`dd_sglang.prefetch.verify`); ``sampled``: ``[n]`` int64 rows whose prefetch hit
    rate this step measures; ``verify_tokens`` / ``sampled_tokens``: the token index of each one's real
    query, on the batch's device (the layer's queries are indexed there, then copied to the host).
    """

    verify_rows: torch.Tensor
    sampled: torch.Tensor
    verify_tokens: torch.Tensor | None = None
    sampled_tokens: torch.Tensor | None = None


@dataclass(frozen=True)
class ExactRows:
    """The full rows whose columns cover positions ``[0, seq_len)`` (module docstring, step 5).

    ``batch_rows``: their batch rows; ``cols``: per exact row, ``[seq_len]`` int64 (device): its
    ring columns in position order.
    """

    batch_rows: tuple[int, ...] = ()
    cols: tuple[torch.Tensor, ...] = ()


@dataclass(frozen=True)
class RowRequests:
    """Per plan row, what its request contributes besides its tensors.

    ``rids``: request ids; ``labels``:
    ``(selector, speculator)`` names for the metrics; ``seeds``: its sampling seed
    (coupled sampling, :mod:`dd_sglang.attention.coupling`).
    """

    rids: tuple[str, ...]
    labels: tuple[tuple[str, str], ...]
    seeds: tuple[int, ...] = ()


@dataclass(frozen=True)
class StepPlan:
    """One sparse decode step (module docstring). Tensors on the CPU unless said otherwise.

    Attributes:
        rows: ``[R]`` int64 batch rows of the sparse requests, in plan order.
        batch_size: the batch's real rows (speculated positions follow them).
        n_ahead, n_fixed: plan rows ``[0, n_ahead)`` have sets chosen last step, ``[n_ahead,
            n_fixed)`` take every candidate, ``[n_fixed, R)`` select at attention time.
        started: ``time.perf_counter()`` when planning began.
        fixed: the fixed rows' critical sets (:class:`FixedSets`).
        selection: the step's selections (:class:`Selections`).
        layout: the attention columns and queries (:class:`ColumnLayout`).
        spec: the speculated tokens riding in the batch (:class:`RidingTokens`).
        checks: the ahead rows verified or sampled (:class:`CheckedRows`).
        exact: the rows attended exactly (:class:`ExactRows`).
        requests: per-row request facts (:class:`RowRequests`).
    """

    rows: torch.Tensor
    batch_size: int
    n_ahead: int
    n_fixed: int
    started: float
    fixed: FixedSets
    selection: Selections
    layout: ColumnLayout
    spec: RidingTokens
    checks: CheckedRows
    requests: RowRequests
    exact: ExactRows = ExactRows()

    @property
    def num_rows(self) -> int:
        return int(self.rows.numel())
