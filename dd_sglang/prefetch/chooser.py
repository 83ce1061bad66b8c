"""The chooser: one selection service for a step's critical sets (the ``choose`` stage, :mod:`~dd_sglang.prefetch.profile`).

Every row's selector puts it under one of three policies when the step is planned
(:class:`~dd_sglang.prefetch.step_plan.Selections`, :class:`~dd_sglang.prefetch.step_plan.CheckedRows`):

* *sync* (``host_sync``, ``oracle``, ``quest_device``, and a lookahead row's first sparse step): before
  the layer's attention, the real query's set is chosen (one selector call per group of rows) and
  handed to the step's source (:mod:`dd_sglang.prefetch.sources`: copied into the ring, or recorded to
  be read in place);
* *verify* (every row whose set was chosen ahead): before the layer's attention, the real query's set,
  chosen as ``host_sync`` chooses it, replaces the prefetched one; only the misses are fetched
  (:mod:`dd_sglang.prefetch.verify`);
* *ahead* (``spec_host``, ``spec_host_exact``, ``recency``): after the layer's attention, the next
  step's set is chosen from this step's queries (:mod:`dd_sglang.prefetch.ahead_selection`).

A sampled step also measures the prediction's hit rate and the attended set's recall
(:mod:`dd_sglang.prefetch.hit_rate`), off the forward thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from dd_sglang.prefetch.ahead_selection import AheadSelection, selection_queries
from dd_sglang.prefetch.hit_rate import HitRateProbe
from dd_sglang.prefetch.verify import LayerVerification


@dataclass(frozen=True)
class CriticalSetChooser:
    """Runs the step's three selection policies at each layer (module docstring).

    Attributes:
        host: the host tier (``k`` ``[layers, slots, Hkv, D]``).
        indexes: the :class:`~dd_sglang.prefetch.key_indexes.KeyIndexes`.
        ahead: the :class:`AheadSelection` (next-step sets).
        verification: the :class:`LayerVerification` (ahead rows, every layer).
        probe: the :class:`HitRateProbe` (sampled steps).
        schedule: the :class:`~dd_sglang.prefetch.schedule.TransferSchedule` (its select worker runs the probe).
        tally: the step's :class:`~dd_sglang.prefetch.events.StepTally`; ``events``: the receiver.
    """

    host: object
    indexes: object
    ahead: AheadSelection
    verification: LayerVerification
    probe: HitRateProbe
    schedule: object
    tally: object
    events: object
    #: ``[plan, *bound]``: the plan's sync groups' bound selections (:meth:`Selector.bind`, with the row
    #: indices of their queries; None: the group calls :meth:`Selector.select`), bound at its first layer.
    bound: list = field(default_factory=list)

    def begin(self, plan) -> None:
        """A new step (or none, ``plan`` None): where its ahead selection runs; no attended sets kept."""
        self.ahead.begin(plan)
        self.probe.attended.clear()
        self.bound.clear()

    def _bind(self, g, q_heads: int):
        """Group ``g``'s selection bound for the step, where its rows select with their real query
        alone (``g.query`` ``[n, 1]``), with those queries' token indices; else None."""
        if g.query.shape[1] != 1:
            return None
        bound = g.selector.bind(g.blocks, self.host.k, g.k, self.indexes.of(g.selector), q_heads)
        return None if bound is None else (bound, g.query_dev[:, 0].contiguous())

    def before_attention(self, plan, layer: int, q3: torch.Tensor, scale: float, source) -> None:
        """The sync groups' sets of ``layer`` from their real queries (``q3``: ``[tokens, Hq, D]``), put
        into ``source``; the verified rows' sets checked against theirs."""
        t0 = time.perf_counter()
        sync = plan.selection.sync
        if not self.bound or self.bound[0] is not plan:
            self.bound[:] = [plan, *(self._bind(g, q3.shape[1]) for g in sync)]
        for g, bound in zip(sync, self.bound[1:], strict=True):
            if bound is not None:  # [n, Hq, D] is [n, Hkv x G, D] grouped by KV head (one query a row)
                _, slots = bound[0](q3.index_select(0, bound[1]).to("cpu", torch.float32), layer, scale)
            else:
                q = selection_queries(q3, g.query_dev, self.host.k.shape[2]).cpu()
                _, slots = g.selector.select(q, g.blocks, self.host.k[layer], g.k, scale,
                                             self.indexes.of(g.selector), layer)  # fmt: skip
            source.put(plan, layer, g.rows, slots)
            if g.selector.lookahead:
                self.events.cold(g.selector.name, int(g.rows.numel()))
        if plan.checks.verify_rows.numel():
            self.verification.run(plan, layer, q3, scale, source)
        elif plan.checks.sampled.numel():
            self.probe.attended[layer] = plan.fixed.slots[layer][: plan.n_ahead]
        if plan.selection.sync or plan.checks.verify_rows.numel():
            self.tally.phase("select", time.perf_counter() - t0)

    def after_attention(self, plan, layer: int, q3: torch.Tensor, scale: float, fused_rows) -> None:
        """The next step's sets of every ahead group from ``layer``'s queries; on a sampled step, the hit
        rate queued on the select worker. ``fused_rows``: the fused attender's
        :class:`~dd_sglang.prefetch.layer_rows.LayerRows` of the step, or None."""
        self.ahead.after_layer(plan, layer, q3, scale, fused_rows)
        if plan.checks.sampled.numel():
            q = q3[plan.checks.sampled_tokens].detach().to("cpu", copy=True)
            attended = self.probe.attended.get(layer)
            self.schedule.submit_select(lambda: self.probe.measure(plan, layer, q, scale, attended))
