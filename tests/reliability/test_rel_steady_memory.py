"""Memory under steady traffic (issue 44): the scheduler's resident set stops growing.

A server fed prompts of many lengths grew ~1.3 MiB a request (``docs/operations-memory.md``): in
bfloat16, every prefill chunk of a new length made oneDNN a new primitive per weight shape, kept in
two caches of 1,024 entries each (PyTorch's ideep cache and oneDNN's own), ~2.7 MiB a new length for
SmolLM2. The launcher bounds both (:func:`dd_sglang.platform.bounded_cache_env`). Short prompts show
it: each length from 33 tokens up (decode-sized products of at most 32 rows take the packed path)
to the server's chunk is a new shape. This sends prompts of distinct lengths one at a time, enough
first to fill bounded caches, then more, and bounds the scheduler's growth over the second part:
with the caches at 1,024 entries it was ~2.7 MiB a request there.

Issue 52: buffers of new sizes, freed, are kept by glibc as free heap; the scheduler trims its heap
after prefill batches (:mod:`dd_sglang.platform.heap`), and the trims are counted on the sidecar's
``dd_cpu_heap_trims_total``: the test's 96 requests (~26 s here, five times the 5 s interval) must
see at least one. What the trim saves at prompt lengths of thousands of tokens is measured in
``tests/test_platform_heap.py`` and by ``bench.soak --tokens 100 6000`` (``docs/operations-memory.md``).

Last in the package (file name order): it fills the device pool's prefix cache with its prompts.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import psutil
import pytest

from dd_sglang.platform import ONEDNN_CACHE_CAPACITY, ONEDNN_CACHE_ENVS
from harness.server import role_of, scrape

pytestmark = pytest.mark.server
MiB = 1024**2
#: Prompt lengths (tokens) of the warm-up and of the measured part: distinct, between the packed
#: path's 32 rows and the reliability server's prefill chunk (128), shuffled with a fixed seed.
LENGTHS = random.Random(44).sample(range(33, 129), 96)
#: Warm-up requests: x 4 weight shapes of a new row count (SmolLM2's q/k/v, o, gate/up and down
#: products) = 272 entries > 256, so bounded caches are full before the measured part.
WARMUP = 68
#: Largest mean growth of the scheduler's RSS per measured request (bytes): a fifth of the ~2.7 MiB
#: per new prompt length measured with the caches unbounded.
MAX_GROWTH_PER_REQUEST = 0.5 * MiB


def scheduler(srv) -> psutil.Process:
    """The server's one scheduler process (``sglang::scheduler``)."""
    found = [p for p in srv.family() if role_of(p, srv.proc.pid) == "scheduler"]
    assert len(found) == 1, [(p.pid, p.cmdline()) for p in srv.family()]
    return found[0]


def environ(pid: int) -> dict[str, str]:
    """A process's environment (``/proc/PID/environ``)."""
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(kv.decode(errors="replace").split("=", 1) for kv in raw if b"=" in kv)


def send(srv, lengths: list[int], seed: int) -> None:
    """One greedy one-token ``/generate`` per length, one at a time, of random token ids (no shared prefix)."""
    rng = random.Random(seed)
    for n in lengths:
        ids = [rng.randrange(1000, 40000) for _ in range(n)]
        body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 1}}
        r = srv.post("/generate", body, timeout=120)
        assert r.status_code == 200, r.text[:300]


def test_scheduler_runs_with_the_onednn_caches_bounded(rel_server):
    env = environ(scheduler(rel_server).pid)
    assert {n: env.get(n) for n in ONEDNN_CACHE_ENVS} == dict.fromkeys(ONEDNN_CACHE_ENVS, str(ONEDNN_CACHE_CAPACITY))


def trims(srv) -> float:
    """The scheduler's heap trims so far (``dd_cpu_heap_trims_total``; published at most every
    ``metrics.update_interval_s``, so read after the gauges settle)."""
    return scrape(srv.metrics_url, "dd_cpu_heap_trim").get("dd_cpu_heap_trims_total", 0.0)


def test_scheduler_memory_stops_growing_with_new_prompt_lengths(rel_server):
    sched, trims_before = scheduler(rel_server), trims(rel_server)
    send(rel_server, LENGTHS[:WARMUP], seed=1)
    before = sched.memory_info().rss
    measured = LENGTHS[WARMUP:]
    send(rel_server, measured, seed=2)
    grown = sched.memory_info().rss - before
    time.sleep(1.5)  # the sidecar sees the counters the scheduler published after its last batch or idle poll
    trimmed = trims(rel_server) - trims_before
    print(f"scheduler RSS {before / MiB:.1f} MiB -> +{grown / MiB:.1f} MiB over {len(measured)} requests; {trimmed:.0f} heap trims over all {len(LENGTHS)}")
    assert trimmed >= 1, "the scheduler never trimmed its heap after a prefill (DD_SGLANG_CPU_HEAP_TRIM_S)"
    assert grown <= MAX_GROWTH_PER_REQUEST * len(measured), (
        f"the scheduler grew {grown / MiB:.1f} MiB over {len(measured)} requests of new prompt lengths "
        f"({grown / len(measured) / MiB:.2f} MiB a request; bound {MAX_GROWTH_PER_REQUEST / MiB} MiB)"
    )
