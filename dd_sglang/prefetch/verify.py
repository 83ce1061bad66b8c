"""Guaranteed recall: the prefetched critical set, checked against the real query's before attention.

A lookahead selector (``spec_host``) fixes step t+1's critical set during step t from the
*speculated* token's queries, and the transfer schedule copies it layer by layer ahead of
attention. At step t+1, once layer l's real query exists, the runner selects that query's own
top-k exactly as ``host_sync`` does (the int8 host-tier index, the best ``rerank x k`` re-ranked
with the exact keys, :class:`~dd_sglang.prefetch.selectors.HostSyncSelector`) and hands both sets
to :func:`verify_sets`. The result is the set the layer attends:

1. every prefetched column whose token is in the real query's set stays (a *hit*, nothing moves);
2. every other prefetched column is *freed*;
3. the real query's tokens that were not prefetched (the *misses*) fill the freed columns, in
   column order, and only they are fetched from the host tier, synchronously, before attention.

Both sets hold ``top_k`` distinct positions per (row, KV head), so the freed columns and the
misses are equally many, and the attended set *is* the real query's set, whatever the
speculated token was: the step answers as ``host_sync`` does (ECHO, OSDI'26, and FreeKV
guarantee recall of speculative retrieval the same way). The prediction's worth is the hit
rate: on a GPU the hits arrived during earlier layers' compute and only the misses wait.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class VerifiedSets:
    """:func:`verify_sets`' result for ``n`` rows, ``H`` KV heads and ``k`` columns.

    Attributes:
        slots: ``[n, H, k]`` int64 host slots the layer attends, column by column (columns at or past a
            row's ``top_k`` keep the prefetched value; they are masked).
        fetched: ``[n, H, k]`` bool: the columns whose token was not prefetched (to fetch now).
        hits: ``[n]`` int64 per row, tokens of the real query's set that were prefetched (over heads).
    """

    slots: torch.Tensor
    fetched: torch.Tensor
    hits: torch.Tensor


def _member(sets: torch.Tensor, valid: torch.Tensor, probe: torch.Tensor, width: int) -> torch.Tensor:
    """``[n, H, k]`` bool: whether each ``probe`` position is one of the valid ``sets`` positions of
    its (row, KV head). A position bitmap per (row, head); invalid entries land in a spare column."""
    n, h, _ = sets.shape
    bitmap = torch.zeros(n, h, width + 1, dtype=torch.bool)
    bitmap.scatter_(2, torch.where(valid, sets, width), True)
    bitmap[..., width] = False
    return bitmap.gather(2, probe)


def verify_sets(have_pos: torch.Tensor, have_slots: torch.Tensor, want_pos: torch.Tensor,
                want_slots: torch.Tensor, top_k: torch.Tensor) -> VerifiedSets:  # fmt: skip
    """The attended set of a layer: the prefetched set with its misses swapped for the real query's
    tokens (module docstring).

    Args:
        have_pos, have_slots: ``[n, H, k]`` int64 positions and host slots of the prefetched set, column
            by column (the ring's column order).
        want_pos, want_slots: ``[n, H, k]`` int64 positions and host slots of the real query's set
            (``host_sync``'s top-k, best first).
        top_k: ``[n]`` int64 each row's set size (``<= k``): only the first ``top_k[row]`` entries of
            either set count.

    Returns:
        :class:`VerifiedSets`.

    Raises:
        ValueError: shapes that differ, or a ``top_k`` outside ``[1, k]``.
    """
    if not (have_pos.shape == have_slots.shape == want_pos.shape == want_slots.shape) or have_pos.dim() != 3:
        raise ValueError(f"sets must be [n, H, k] alike, got {tuple(have_pos.shape)}, {tuple(have_slots.shape)}, "
                         f"{tuple(want_pos.shape)}, {tuple(want_slots.shape)}")  # fmt: skip
    n, _, k = have_pos.shape
    if top_k.shape != (n,) or (n and (int(top_k.min()) < 1 or int(top_k.max()) > k)):
        raise ValueError(f"top_k must be [{n}] values in [1, {k}], got {top_k.tolist()}")
    if n == 0:
        return VerifiedSets(have_slots.clone(), torch.zeros_like(have_pos, dtype=torch.bool), top_k.new_zeros(0))
    valid = (torch.arange(k) < top_k.view(-1, 1, 1)).expand_as(have_pos)
    width = int(torch.maximum(have_pos.max(), want_pos.max())) + 1
    keep = valid & _member(want_pos, valid, have_pos.clamp(min=0), width)  # prefetched and wanted
    missing = valid & ~_member(have_pos, valid, want_pos.clamp(min=0), width)  # wanted, not prefetched
    free = valid & ~keep
    if not torch.equal(free.sum(dim=2), missing.sum(dim=2)):
        raise ValueError("each set must hold top_k distinct positions per row and KV head")
    # Freed columns first (in column order), misses first (best first): pair them up one to one.
    free_cols = torch.sort((~free).to(torch.int8), dim=2, stable=True).indices
    miss_at = torch.sort((~missing).to(torch.int8), dim=2, stable=True).indices
    take = torch.arange(k) < free.sum(dim=2, keepdim=True)
    src = torch.where(take, want_slots.gather(2, miss_at), have_slots.gather(2, free_cols))
    return VerifiedSets(have_slots.scatter(2, free_cols, src), free, keep.sum(dim=(1, 2)))


class LayerVerification:
    """Applies :func:`verify_sets` to the plan's verified rows (``plan.checks.verify_rows``) at each layer:
    the real query's set, chosen as ``host_sync`` chooses it, with the prefetched tokens kept in
    place and the misses fetched now by the step's source (:mod:`dd_sglang.prefetch.sources`: into the
    in-place table, or copied into the ring slot's freed columns).

    Args:
        host: the host tier (``k``/``v`` ``[layers, slots, Hkv, D]``).
        host_sync: the ``host_sync`` selector; ``indexes``: the runner's key indexes (``"host"``).
        tally: the step's :class:`~dd_sglang.prefetch.events.StepTally`.
        blocks: the runner's :class:`~dd_sglang.prefetch.hit_rate.StepBlocks`.
        attended: the hit-rate probe's per-layer attended sets (written on sampled steps).
    """

    def __init__(self, host, host_sync, indexes, tally, blocks, attended: dict):
        self.host = host
        self.host_sync = host_sync
        self.indexes = indexes
        self.tally = tally
        self.blocks = blocks
        self.attended = attended

    def run(self, plan, layer: int, q3: torch.Tensor, scale: float, source) -> None:
        """Verify ``layer``'s sets of the verified rows against their real queries (``q3``:
        ``[tokens, Hq, D]``; copied to the host: the one device-to-host copy verification needs) and hand
        the result to ``source`` (``put_verified``)."""
        rows = plan.checks.verify_rows
        blocks = self.blocks.take(plan, "verify", rows)
        k = plan.layout.k
        q = q3[plan.checks.verify_tokens].detach().cpu()
        want_pos, want_slots = self.host_sync.select(q, blocks, self.host.k[layer], k, scale,
                                                     self.indexes.index("host"), layer)  # fmt: skip
        top_k = plan.selection.top_k[rows]
        fixed = plan.fixed
        v = verify_sets(fixed.pos[layer][rows], fixed.slots[layer][rows], want_pos, want_slots, top_k)
        attended = source.put_verified(plan, layer, rows, v, bool(plan.checks.sampled.numel()))
        hkv, labels = want_pos.shape[1], plan.requests.labels
        for i, j in enumerate(rows.tolist()):
            self.tally.verify(labels[j], int(v.hits[i]), hkv * int(top_k[i]))
        self.tally.miss("verify", int(v.fetched.flatten(1).any(dim=1).sum()), int(v.fetched.sum()))
        if attended is not None:  # what attention reads, for the sampled recall
            self.attended[layer] = attended
