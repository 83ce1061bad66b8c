"""Prometheus receiver of the ``dualdecoder`` attention backend's events.

Implements the methods of :class:`dd_sglang.attention.step.BackendEvents`
(and of :class:`dd_sglang.prefetch.events.PrefetchEvents`, which it extends)
(by name; no import of the attention layer) with the metrics of
:mod:`dd_sglang.metrics.definitions`. Lives in the scheduler process, where
``PROMETHEUS_MULTIPROC_DIR`` is set before SGLang starts.
"""

from __future__ import annotations


class MetricsEvents:
    """Counts the backend's events in ``dd_sparse_decode_rows_total``, ``dd_sparse_exact_rows_total``,
    ``dd_extend_query_rows_skipped_total``, ``dd_prefetch_*``,
    ``dd_spec_*`` and ``dd_transfer_*``.

    With tensor parallelism every TP rank of a replica runs the same requests and steps over its
    own KV heads. Per-(request, layer) and per-step counts and step times (sparse rows, cold
    steps, misses, speculation, decode steps and their phases) are then written by the
    attention-TP rank 0 only (``primary``), so they count each request and step once; per-KV-head
    sums (prefetch hits, lookups, mass, verified hits and lookups, recall, fetched tokens, bytes copied) and each rank's own copy
    timings are written by every rank and add up.

    Args:
        primary: this process counts request-level events (default: from SGLang's ranks,
            :func:`dd_sglang.kvcache.ranks.current_ranks`).
        metrics: the metric definitions module (default :mod:`dd_sglang.metrics.definitions`).
    """

    def __init__(self, primary: bool | None = None, metrics=None):
        if metrics is None:
            from dd_sglang.metrics import definitions as metrics
        if primary is None:
            from dd_sglang.kvcache.ranks import current_ranks

            primary = current_ranks().primary
        self.m = metrics
        self.primary = primary

    def sparse_rows(self, n: int) -> None:
        if self.primary:
            self.m.SPARSE_DECODE_ROWS.inc(n)

    def exact_rows(self, n: int) -> None:
        if self.primary:
            self.m.SPARSE_EXACT_ROWS.inc(n)

    def extend_rows_skipped(self, n: int) -> None:
        if self.primary and n:
            self.m.EXTEND_QUERY_ROWS_SKIPPED.inc(n)

    def cold(self, selector: str, n: int) -> None:
        if self.primary:
            self.m.PREFETCH_COLD.labels(selector=selector).inc(n)

    def prefetch(self, selector, speculator, layer, hits, lookups, mass_prefetched, mass_top_k) -> None:
        m, lab = self.m, {"selector": selector, "speculator": speculator}
        m.PREFETCH_HITS.labels(**lab).inc(hits)
        m.PREFETCH_LOOKUPS.labels(**lab).inc(lookups)
        m.PREFETCH_MASS_PREFETCHED.labels(**lab).inc(mass_prefetched)
        m.PREFETCH_MASS_TOP_K.labels(**lab).inc(mass_top_k)
        m.PREFETCH_LAYER_HIT_RATE.labels(layer=str(layer)).observe(hits / lookups)

    def speculation(self, speculator: str, accepted: bool) -> None:
        if not self.primary:
            return
        self.m.SPEC_PROPOSED.labels(speculator=speculator).inc()
        if accepted:
            self.m.SPEC_ACCEPTED.labels(speculator=speculator).inc()

    def miss(self, policy: str, n: int, repaired_tokens: int) -> None:
        if self.primary:
            self.m.PREFETCH_MISSES.labels(policy=policy).inc(n)
        if repaired_tokens:
            self.m.PREFETCH_REPAIRED_TOKENS.inc(repaired_tokens)

    def verified(self, selector: str, speculator: str, hits: int, lookups: int) -> None:
        lab = {"selector": selector, "speculator": speculator}
        self.m.PREFETCH_VERIFIED_HITS.labels(**lab).inc(hits)
        self.m.PREFETCH_VERIFIED_LOOKUPS.labels(**lab).inc(lookups)

    def recall(self, selector: str, speculator: str, held: int, lookups: int) -> None:
        lab = {"selector": selector, "speculator": speculator}
        self.m.CRITICAL_SET_RECALL_HELD.labels(**lab).inc(held)
        self.m.CRITICAL_SET_RECALL_LOOKUPS.labels(**lab).inc(lookups)

    def copied(self, nbytes: int) -> None:
        self.m.TRANSFER_BYTES.inc(nbytes)

    def phase(self, name: str, seconds: float) -> None:
        if self.primary:
            self.m.STEP_PHASE_SECONDS.labels(phase=name).inc(seconds)

    def step(self, kind: str, seconds: float) -> None:
        if self.primary:
            self.m.DECODE_STEPS.labels(kind=kind).inc()
            self.m.DECODE_STEP_SECONDS.labels(kind=kind).inc(seconds)

    def transfer(self, timings) -> None:
        m = self.m
        hidden = 0.0
        for t in timings:
            m.TRANSFER_COPY_SECONDS.observe(t.copy_s)
            if t.wait_start:
                m.TRANSFER_WAIT_SECONDS.observe(t.wait_s)
            hidden += t.hidden_s
        m.TRANSFER_HIDDEN_SECONDS.inc(hidden)
