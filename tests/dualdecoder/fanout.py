"""Send requests at once while sampling the sidecar: the package's concurrency checks share this."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from bench.server import ServerProcess, scrape


def run_at_once_sampled(srv: ServerProcess, calls: list[Callable[[], dict]], interval_s: float = 0.2):
    """Run every ``calls[i]()`` in its own thread at once, scraping ``srv``'s ``dd_`` metrics every
    ``interval_s`` seconds until all returned. Returns ``(results, samples)``: ``results[i]`` is
    ``calls[i]``'s return value (None if it raised: its thread's traceback is printed), ``samples``
    the scrapes in time order."""
    results: list[dict | None] = [None] * len(calls)
    samples: list[dict[str, float]] = []
    done = threading.Event()

    def sample():
        while not done.is_set():
            samples.append(scrape(srv.metrics_url))
            time.sleep(interval_s)

    def run(i):
        results[i] = calls[i]()

    poller = threading.Thread(target=sample)
    poller.start()
    workers = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    done.set()
    poller.join()
    return results, samples
