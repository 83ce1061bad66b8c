"""What the prefetch layer reports, and the per-step tally that batches its per-layer reports.

:class:`PrefetchEvents` is the receiver interface (no-ops here; the plugin's subclass turns each
call into Prometheus metrics, :mod:`dd_sglang.metrics.backend_events`). :class:`StepTally` adds up
a step's per-layer counts on the forward thread and reports them once per step.
"""

from __future__ import annotations


class PrefetchEvents:
    """What the prefetch layer reports (the plugin turns it into Prometheus metrics); no-ops here."""

    def cold(self, selector: str, n: int) -> None:
        """``n`` lookahead (request, layer)s had no set fixed in advance and selected synchronously."""

    def prefetch(self, selector: str, speculator: str, layer: int, hits: int, lookups: int,
                 mass_prefetched: float, mass_top_k: float) -> None:  # fmt: skip
        """A sampled lookahead (request, layer): ``hits`` of ``lookups`` (= k x KV heads) exact
        top-k tokens of the real query were prefetched; softmax mass on the prefetched set and
        on the exact top-k."""

    def speculation(self, speculator: str, accepted: bool) -> None:
        """A request's speculated token was checked against the real one."""

    def miss(self, policy: str, n: int, repaired_tokens: int) -> None:
        """``n`` lookahead (request, layer)s' prefetched sets missed tokens of the real query's set:
        ``verify`` (the only policy) fetched ``repaired_tokens`` of them before attention."""

    def verified(self, selector: str, speculator: str, hits: int, lookups: int) -> None:
        """A step's verified lookahead (request, layer)s: ``hits`` of ``lookups`` (= top_k x KV heads,
        summed) tokens of the real query's set had been prefetched."""

    def recall(self, selector: str, speculator: str, held: int, lookups: int) -> None:
        """A sampled lookahead (request, layer): ``held`` of ``lookups`` tokens of ``host_sync``'s set for
        the real query (selected again, apart from the step) were in the set the layer attended."""

    def transfer(self, timings) -> None:
        """The transfer schedule finished a step (per-layer timestamps)."""

    def phase(self, name: str, seconds: float) -> None:
        """Time spent in a phase of a decode step: ``plan``, ``select`` (forward thread),
        ``select_ahead`` (select worker), ``assemble``, ``attention``."""

    def copied(self, nbytes: int) -> None:
        """``nbytes`` of critical-set K/V were gathered from the host tier into the layer ring."""


#: The receiver used when none is given.
NO_EVENTS = PrefetchEvents()


class StepTally:
    """A step's per-layer event counts, reported once per step (:meth:`flush`) instead of once per
    layer: each report is a Prometheus label lookup and lock on the forward thread."""

    def __init__(self):
        self.phases: dict[str, float] = {}
        self.copied = 0
        self.misses: dict[str, list[int]] = {}
        self.verified: dict[tuple[str, str], list[int]] = {}

    def phase(self, name: str, seconds: float) -> None:
        """Add ``seconds`` to phase ``name`` (:meth:`PrefetchEvents.phase`)."""
        self.phases[name] = self.phases.get(name, 0.0) + seconds

    def miss(self, policy: str, n: int, repaired_tokens: int) -> None:
        """Count ``n`` (request, layer) misses under ``policy`` and their fetched tokens (:meth:`PrefetchEvents.miss`)."""
        m = self.misses.setdefault(policy, [0, 0])
        m[0] += n
        m[1] += repaired_tokens

    def verify(self, label: tuple[str, str], hits: int, lookups: int) -> None:
        """Add a layer's verified hits and lookups under ``(selector, speculator)`` (:meth:`PrefetchEvents.verified`)."""
        v = self.verified.setdefault(label, [0, 0])
        v[0] += hits
        v[1] += lookups

    def flush(self, events: PrefetchEvents) -> None:
        """Report what was counted to ``events`` and start again from zero."""
        for name, seconds in self.phases.items():
            events.phase(name, seconds)
        if self.copied:
            events.copied(self.copied)
        for policy, (n, tokens) in self.misses.items():
            events.miss(policy, n, tokens)
        for (selector, speculator), (hits, lookups) in self.verified.items():
            events.verified(selector, speculator, hits, lookups)
        self.phases, self.copied, self.misses, self.verified = {}, 0, {}, {}
