"""What the package's concurrency checks share: requests sent at once while the sidecar is sampled,
and the check that the pools are back at their baseline afterwards."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from harness.server import ServerProcess, flush_when_idle, scrape


def run_at_once(calls: list[Callable[[], dict]]) -> list[dict | None]:
    """Run every ``calls[i]()`` in its own thread at once; ``results[i]`` is ``calls[i]``'s return
    value (None if it raised: its thread's traceback is printed)."""
    results: list[dict | None] = [None] * len(calls)

    def run(i):
        results[i] = calls[i]()

    workers = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return results


def run_at_once_sampled(srv: ServerProcess, calls: list[Callable[[], dict]], interval_s: float = 0.2):
    """:func:`run_at_once`, scraping ``srv``'s ``dd_`` metrics every ``interval_s`` seconds until all
    returned. Returns ``(results, samples)``: the results as :func:`run_at_once` gives them,
    ``samples`` the scrapes in time order."""
    samples: list[dict[str, float]] = []
    done = threading.Event()

    def sample():
        while not done.is_set():
            samples.append(scrape(srv.metrics_url))
            time.sleep(interval_s)

    poller = threading.Thread(target=sample)
    poller.start()
    try:
        results = run_at_once(calls)
    finally:
        done.set()
        poller.join()
    return results, samples


def assert_back_at_baseline(srv: ServerProcess, idle: dict[str, float], base: dict[str, float]) -> dict[str, float]:
    """``idle`` (a scrape once no request is admitted): no request holds a device slot, the host tier
    holds only the prefix cache, no sparse resident set. Then ``/flush_cache``: device and host use
    are back at ``base`` (a scrape after a flush before the check), which must be 0. Returns the
    scrape after the flush."""
    assert idle["dd_device_kv_used_bytes"] == idle["dd_device_kv_evictable_bytes"]
    assert idle["dd_host_tier_used_bytes"] == idle["dd_host_tier_prefix_cache_bytes"]
    assert idle["dd_sparse_resident_bytes"] == 0
    end = flush_when_idle(srv)
    assert end["dd_device_kv_used_bytes"] == base["dd_device_kv_used_bytes"] == 0
    assert end["dd_host_tier_used_bytes"] == base["dd_host_tier_used_bytes"] == 0
    return end
