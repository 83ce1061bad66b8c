"""The sampled prefetch hit-rate measurement (``prefetch.hit_rate_sample``).

For the plan's sampled lookahead rows (``plan.checks.sampled``), after each layer's attention, on the
select worker: how many of the exact top-k tokens of the *real* query had been prefetched, and
the softmax mass on the prefetched set and on the exact top-k (:meth:`PrefetchEvents.prefetch`);
with the set the layer attended, that set's recall against ``host_sync``'s set for the same real
query, selected again apart from the step (:meth:`PrefetchEvents.recall`). The counts come from
the C kernel where the runner uses it, else from :func:`hit_counts_torch`.
"""

from __future__ import annotations

import torch

from dd_sglang.kernels import native as native_kernel


class StepBlocks:
    """``plan.selection.blocks.take(rows)`` for a plan's named rows (``verify``, ``sampled``), taken once per
    step: every layer reads the same rows, and the taken blocks keep their ``tokens``."""

    def __init__(self):
        self.plan = None
        self.taken: dict = {}

    def take(self, plan, name: str, rows: torch.Tensor):
        """The candidate blocks of plan rows ``rows`` (``[n]`` int64), named ``name``."""
        if self.plan is not plan:
            self.plan, self.taken = plan, {}
        blocks = self.taken.get(name)
        if blocks is None:
            blocks = self.taken[name] = plan.selection.blocks.take(rows)
        return blocks


def hit_counts_torch(exact, k: int, blocks, host_k: torch.Tensor, q: torch.Tensor, kr: torch.Tensor,
                     have: torch.Tensor, scale: float):  # fmt: skip
    """``(hits, mass_have, mass_top)`` per row with PyTorch operations (what the C kernel's
    ``measure_hits`` computes).

    Args:
        exact: the ``oracle`` selector (exact scores over every candidate).
        k: the plan's column budget; ``kr``: ``[n, 1, 1]`` int64 each row's ``top_k`` (``<= k``).
        blocks: the rows' candidate blocks; ``host_k``: the layer's host keys ``[slots, Hkv, D]``.
        q: ``[n, Hq, D]`` the real queries; ``have``: ``[n, Hkv, k]`` int64 prefetched positions.
    """
    _, _, score = exact.score(q, blocks, host_k, k, scale, None, 0)
    prob = score.exp()  # [n, Hkv, P]: position p at index p
    top = prob.topk(k, dim=-1)
    valid = torch.arange(k) < kr  # [n, 1, k]
    hit = (have.unsqueeze(-1) == top.indices.unsqueeze(-2)) & valid.unsqueeze(-1) & valid.unsqueeze(-2)
    hits = hit.any(dim=-1).sum(dim=(1, 2))
    mass_have = (prob.gather(-1, have) * valid).sum(dim=(1, 2))
    mass_top = (top.values * valid).sum(dim=(1, 2))
    return hits, mass_have, mass_top


class HitRateProbe:
    """Measures the sampled rows of each step (module docstring).

    Args:
        host: the host tier (``k`` ``[layers, slots, Hkv, D]``).
        indexes: the :class:`~dd_sglang.prefetch.key_indexes.KeyIndexes` (``host_sync`` reads ``"host"``).
        host_sync: the ``host_sync`` selector; ``exact``: the ``oracle`` selector.
        native: whether the C kernel counts the hits.
        events: the :class:`~dd_sglang.prefetch.events.PrefetchEvents` receiver.
        blocks: the runner's :class:`StepBlocks`.
    """

    def __init__(self, host, indexes, host_sync, exact, native: bool, events, blocks: StepBlocks):
        self.host = host
        self.indexes = indexes
        self.host_sync = host_sync
        self.exact = exact
        self.native = native
        self.events = events
        self.blocks = blocks
        #: Sampled steps: per layer, the ahead rows' attended critical sets (``[n_ahead, Hkv, k]`` host slots).
        self.attended: dict[int, torch.Tensor] = {}

    def measure(self, plan, layer: int, q: torch.Tensor, scale: float, attended: torch.Tensor | None = None) -> None:
        """Hit rate of the sampled rows' prefetched sets against the exact top-k of the real queries
        ``q`` (``[n, Hq, D]``); with ``attended`` (``[n_ahead, Hkv, k]`` host slots the layer attended),
        the recall of that set against ``host_sync``'s set for the same real query."""
        rows = plan.checks.sampled
        if attended is not None:
            self._recall(plan, layer, q, scale, attended[rows])
        blocks = self.blocks.take(plan, "sampled", rows)
        host_k, k = self.host.k[layer], plan.layout.k
        kr = plan.selection.top_k[rows].view(-1, 1, 1)
        have = plan.fixed.pos[layer][rows]
        hkv, labels = have.shape[1], plan.requests.labels
        if self.native:
            slots, ok = blocks.tokens
            h, mh, mt = native_kernel.measure_hits(q, slots, ok, host_k, have, kr.flatten(), scale)
            hits, mass_have, mass_top = h.sum(dim=1), mh.sum(dim=1), mt.sum(dim=1)
        else:
            hits, mass_have, mass_top = hit_counts_torch(self.exact, k, blocks, host_k, q, kr, have, scale)
        for i, j in enumerate(rows.tolist()):
            sel, spec = labels[j]
            self.events.prefetch(sel, spec, layer, int(hits[i]), hkv * int(kr[i]),
                                 float(mass_have[i]), float(mass_top[i]))  # fmt: skip

    def _recall(self, plan, layer: int, q: torch.Tensor, scale: float, attended: torch.Tensor) -> None:
        """Tokens of ``host_sync``'s set for the sampled rows' real queries ``q`` that their attended sets
        (``[n, Hkv, k]`` host slots) hold, per row (:meth:`PrefetchEvents.recall`)."""
        rows = plan.checks.sampled
        blocks = self.blocks.take(plan, "sampled", rows)
        k = plan.layout.k
        _, want = self.host_sync.select(q, blocks, self.host.k[layer], k, scale, self.indexes.index("host"), layer)
        kr = plan.selection.top_k[rows].view(-1, 1, 1)
        cols = torch.arange(k)
        big = torch.iinfo(torch.int64).max  # padding past a row's top_k: matches no slot
        held = torch.where(cols < kr, attended, big).sort(dim=2).values
        at = torch.searchsorted(held, want).clamp(max=k - 1)
        found = (held.gather(2, at) == want) & (cols < kr)
        hkv, labels = want.shape[1], plan.requests.labels
        for i, j in enumerate(rows.tolist()):
            sel, spec = labels[j]
            self.events.recall(sel, spec, int(found[i].sum()), hkv * int(kr[i]))
