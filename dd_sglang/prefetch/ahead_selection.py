"""Choosing the next step's critical sets from this step's queries (lookahead selectors).

After each layer's attention the runner hands this layer's queries here
(:meth:`AheadSelection.after_layer`). Where the selection runs is chosen once per step, in
:meth:`AheadSelection.begin` (``experimental.select``):

* *worker*: each layer's selection is queued on the transfer schedule's select worker
  (:meth:`~dd_sglang.prefetch.schedule.TransferSchedule.submit_select`), off the forward thread;
* *inline*: the layer's selection queries are kept and, every few layers, the sets of those
  layers are chosen in one call per selector (:meth:`Selector.select_layers`): the same sets,
  with each small operation dispatched once per chunk instead of once per layer. A chunk holds
  as many layers as keep the selection's float32 scores within :data:`SELECT_CHUNK_BYTES`: in
  ``bench.decode_speed`` on 2 cores (SmolLM2, ``bench/results/archive/decode_speed_per_layer_select_cpu.json``
  against commit be9441f's ``decode_speed_cpu.json``) chunks cut the selection from 38 to 18 ms
  per step at 4k x 1 and left it at ~120 ms at 4k x 8, where scores of more layers at once no
  longer fit the caches. With the fused C attender the queries go straight into one per-step buffer
  (no stacking);
* *split* (``split``, or ``auto`` on a CPU with 2+ intra-op threads from :data:`SPLIT_MIN_ROWS`
  rows selecting ahead): the worker, with the forward's own operations on one thread.
"""

from __future__ import annotations

import time

import torch

from dd_sglang.kernels.sparse_decode import fold_gqa

#: Inline selection: largest float32 score tensor (layers x rows x candidates x query heads x 4 B)
#: one chunk of layers may make; at most :data:`SELECT_CHUNK_LAYERS` layers a chunk.
SELECT_CHUNK_BYTES = 3 << 20
SELECT_CHUNK_LAYERS = 10
#: ``experimental.select: auto`` on a CPU with 2+ intra-op threads: a sparse step with at least this many
#: rows selecting ahead runs as ``split`` (the selection on the select worker, the forward's own
#: operations on one thread), a smaller one inline. ``bench.decode_speed`` on 2 cores, 4k tokens, split
#: over inline tokens/s: 0.89x at 1 row (``bench/results/archive/decode_speed_split_cpu.json``), 0.86x at 4 and
#: 1.06x at 8 rows (``bench/results/archive/decode_speed_select_auto_cpu.json``, run with this at 4). The
#: worker's single-thread selection took 2.2-2.8x the inline two-thread time (memory and the GIL
#: shared with the forward), so only from 8 rows does moving it off the forward thread pay for the
#: forward's own operations on one thread.
SPLIT_MIN_ROWS = 8


def chunk_layers(g, q: torch.Tensor) -> int:
    """Layers per inline selection call for group ``g`` (``q``: one layer's ``[rows, heads, D]``)."""
    per_layer = q.shape[0] * q.shape[1] * g.blocks.cand.shape[1] * 4
    return max(1, min(SELECT_CHUNK_LAYERS, SELECT_CHUNK_BYTES // max(per_layer, 1)))


def selection_queries(q3: torch.Tensor, query: torch.Tensor, hkv: int) -> torch.Tensor:
    """The queries that drive a selection, ``[n, Hkv x Q x group, D]``, grouped by KV head, on ``q3``'s device.

    ``query``: ``[n, Q]`` token indices (``Q`` riding positions, or the real one), best on ``q3``'s
    device already (``SelectionGroup.query_dev``; one on another is moved). Every query of
    a KV head joins that head's GQA group, so a selector's max over the group ranks by all ``Q``
    queries at once, at the same budget ``k``.
    """
    sel = fold_gqa(q3[query.to(q3.device)].detach(), hkv)  # [n, Hkv, Q x group, D]
    return sel.reshape(sel.shape[0], -1, sel.shape[3])


class AheadSelection:
    """The next step's sets of every lookahead group (module docstring).

    Args:
        host: the host tier (``k`` ``[layers, slots, Hkv, D]``, ``layer_num``).
        schedule: the :class:`~dd_sglang.prefetch.schedule.TransferSchedule` (select worker;
            its ``select_inline`` is this step's choice).
        store: the :class:`~dd_sglang.prefetch.plan.PredictionStore` whose ``next_sets`` (replaced
            each step by the plan) the chosen sets go into.
        indexes: the :class:`~dd_sglang.prefetch.key_indexes.KeyIndexes`.
        tally: the step's :class:`~dd_sglang.prefetch.events.StepTally`; ``events``: the receiver.
        split_threads: ``(threads outside split steps, inside them)`` for the forward thread, or None
            where no step splits (CUDA, ``worker``, ``inline``, or a single intra-op thread).
        split_min_rows: rows selecting ahead from which a step splits.
    """

    def __init__(self, host, schedule, store, indexes, tally, events, split_threads: tuple[int, int] | None,
                 split_min_rows: int):  # fmt: skip
        self.host = host
        self.schedule = schedule
        self.store = store
        self.indexes = indexes
        self.tally = tally
        self.events = events
        self.split = (split_threads, split_min_rows)
        #: Inline selection: each ahead group's selection queries of the layers not yet selected.
        self.pending: list[dict[int, torch.Tensor]] = []
        self.fast_queries: list[torch.Tensor] = []  # fast inline selection: per ahead group [L, n, Q x Hq, D]
        self.next_layer: list[int] = []  # per ahead group, the first layer not yet selected
        self.layers_per_call: list[int | None] = []  # per ahead group, its layers per selection call

    def begin(self, plan) -> None:
        """Choose where this step's selection runs and start its groups empty. Called after the
        previous step's selections were drained, so none is in flight."""
        threads, min_rows = self.split
        if threads is not None:
            rows = sum(int(g.query.shape[0]) for g in plan.selection.ahead) if plan is not None else 0
            split = plan is not None and rows >= min_rows
            self.schedule.select_inline = not split
            self.split_threads(split)
        groups = plan.selection.ahead if plan is not None else ()
        self.pending = [{} for _ in groups]
        self.next_layer = [0 for _ in groups]
        self.layers_per_call = [None for _ in groups]

    def split_threads(self, split: bool) -> None:
        """Where steps may split, set the calling (forward) thread's intra-op threads for the coming
        forward: 1 for a split step (the select worker has the other core), else the count the
        runner was built with; elsewhere nothing."""
        threads = self.split[0]
        if threads is not None:
            n = threads[1 if split else 0]
            if torch.get_num_threads() != n:
                torch.set_num_threads(n)

    def after_layer(self, plan, layer: int, q3: torch.Tensor, scale: float, fast_rows) -> None:
        """Queue or run the next step's selection of every ahead group from ``layer``'s queries ``q3``
        (``[tokens, Hq, D]``). ``fast_rows``: the step's :class:`~dd_sglang.prefetch.layer_rows.LayerRows`
        of the fused C attender, else None."""
        last = layer == self.host.layer_num - 1
        inline = self.schedule.select_inline
        for gi, g in enumerate(plan.selection.ahead):
            if inline and fast_rows is not None:
                self._into_step_buffer(gi, g, layer, q3, scale, last, fast_rows.sel_rows[gi])
                continue
            q = selection_queries(q3, g.query_dev, self.host.k.shape[2]).to("cpu", copy=True)
            if inline:
                pending = self.pending[gi]
                pending[layer] = q
                if len(pending) == chunk_layers(g, q) or last:
                    l0, l1 = min(pending), max(pending) + 1
                    self._select_layers(g, torch.stack([pending[i] for i in range(l0, l1)]), l0, scale)
                    pending.clear()
                continue
            self.schedule.submit_select(self._worker_job(g, layer, q, scale))

    def _worker_job(self, g, layer: int, q: torch.Tensor, scale: float):
        """The select worker's job: group ``g``'s next-step sets of ``layer`` from its queries ``q``."""
        index = self.indexes.of(g.selector)
        host_k = self.host.k[layer]
        nxt, events = self.store.next_sets, self.events

        def select() -> None:
            t0 = time.perf_counter()
            pos, slots = g.selector.select(q, g.blocks, host_k, g.k, scale, index, layer)
            nxt.put(layer, g.dest, pos, slots)
            events.phase("select_ahead", time.perf_counter() - t0)

        return select

    def _into_step_buffer(self, gi: int, g, layer: int, q3: torch.Tensor, scale: float, last: bool,
                          sel: torch.Tensor) -> None:  # fmt: skip
        """Inline selection with the fused C attender: the layer's selection queries (token rows ``sel``) go
        into the step's ``[layers, n, Q x Hq, D]`` buffer (one ``index_select``); a full chunk is
        selected from a view of it (no stacking)."""
        d = q3.shape[2]
        if self.layers_per_call[gi] is None:  # the step's first layer: the buffer and the chunk size
            n = int(g.query.shape[0])
            shape = (self.host.layer_num, n, sel.numel() // n, d)
            if gi >= len(self.fast_queries):
                self.fast_queries.append(q3.new_empty(0))
            if tuple(self.fast_queries[gi].shape) != shape or self.fast_queries[gi].dtype != q3.dtype:
                self.fast_queries[gi] = q3.new_empty(shape)
            self.layers_per_call[gi] = chunk_layers(g, self.fast_queries[gi][0])
        buf = self.fast_queries[gi]
        torch.index_select(q3.reshape(-1, d), 0, sel, out=buf[layer].view(-1, d))
        l0 = self.next_layer[gi]
        if layer + 1 - l0 == self.layers_per_call[gi] or last:
            self._select_layers(g, buf[l0 : layer + 1], l0, scale)
            self.next_layer[gi] = layer + 1

    def _select_layers(self, g, q: torch.Tensor, l0: int, scale: float) -> None:
        """One group's next-step sets of layers ``[l0, l0 + len(q))`` from their selection queries
        ``q`` (``[L, rows, Q x Hq, D]``)."""
        t0 = time.perf_counter()
        l1 = l0 + q.shape[0]
        index = self.indexes.of(g.selector)
        nxt = self.store.next_sets
        out = nxt.direct(l0, l1, g.dest, g.k, self.host.k.shape[2])  # written in place when it can be
        pos, slots = g.selector.select_layers(q, g.blocks, self.host.k[l0:l1], g.k, scale, index, slice(l0, l1),
                                              out=out)  # fmt: skip
        if out is None:
            nxt.put_layers(l0, g.dest, pos, slots)
        self.tally.phase("select_ahead", time.perf_counter() - t0)
