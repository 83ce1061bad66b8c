"""The CPU platform's heap trim (:mod:`dd_sglang.platform.heap`, issue 52).

Whether a trim returns memory is measured on glibc's own figures in a subprocess: freed blocks of
sizes that never repeat stay in the heap as free memory (``mallinfo2().fordblks``) until
``malloc_trim(0)``, and the process's RSS falls by what it returned.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from dd_sglang.platform.heap import (
    DEFAULT_TRIM_INTERVAL_S,
    TRIM_INTERVAL_ENV,
    HeapTrimmer,
    trim_heap,
    trim_interval_s,  # fmt: skip
)


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_trimmer_trims_at_most_once_per_interval():
    clock, calls = _Clock(), []
    def trim():
        calls.append(clock.t)
        clock.t += 0.25  # each trim takes a quarter second
        return True

    trimmer = HeapTrimmer(5.0, clock=clock, trim=trim)
    done = []
    for t in (101.0, 104.9, 105.0, 106.0, 110.2, 110.25, 130.0):
        clock.t = t
        done.append(trimmer.after_prefill())
    assert done == [False, False, True, False, False, True, True]  # 5 s from the end of the last trim
    assert calls == [105.0, 110.25, 130.0]
    assert (trimmer.trims, trimmer.released, trimmer.seconds) == (3, 3, 0.75)


def test_trimmer_trims_once_when_idle_behind_a_prefill():
    clock, calls = _Clock(), []
    trimmer = HeapTrimmer(5.0, clock=clock, trim=lambda: calls.append(clock.t) or True)
    clock.t = 101.0
    assert trimmer.when_idle() is False  # no prefill yet
    assert trimmer.after_prefill() is False  # within 5 s of construction: left behind
    clock.t = 102.0
    assert [trimmer.when_idle(), trimmer.when_idle()] == [True, False]  # once per idle spell
    clock.t = 110.0
    assert trimmer.after_prefill() is True  # 8 s since the idle trim
    assert trimmer.when_idle() is False  # nothing behind it
    assert calls == [102.0, 110.0] and trimmer.trims == 2


def test_trimmer_off_never_trims():
    clock = _Clock()
    trimmer = HeapTrimmer(0.0, clock=clock, trim=lambda: pytest.fail("trimmed while off"))
    clock.t = 1e9
    assert trimmer.after_prefill() is False and trimmer.when_idle() is False and trimmer.trims == 0


def test_trim_interval_from_the_environment():
    assert trim_interval_s({}) == DEFAULT_TRIM_INTERVAL_S
    assert trim_interval_s({TRIM_INTERVAL_ENV: "0"}) == 0.0
    assert trim_interval_s({TRIM_INTERVAL_ENV: " 2.5 "}) == 2.5
    for bad in ("-0.1", "x", "inf", "nan", "3600.5"):
        with pytest.raises(ValueError, match=rf"{TRIM_INTERVAL_ENV} must be seconds in \[0, 3600\]"):
            trim_interval_s({TRIM_INTERVAL_ENV: bad})


_FRAGMENT = textwrap.dedent(
    """
    import ctypes, json, sys
    from dd_sglang.platform.heap import trim_heap

    class Mallinfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = Mallinfo2
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.mallopt(-3, 64 << 20)  # M_MMAP_THRESHOLD: these blocks come from the heap, as after glibc raised it

    def rss():
        return int(open("/proc/self/statm").read().split()[1]) * 4096

    # Blocks of sizes that never repeat, every other one kept: the freed ones cannot merge, so
    # glibc keeps them as free heap, touched (resident) but unused.
    held, freed = [], []
    for i in range(200):
        p = libc.malloc((256 << 10) + 4096 * i)
        ctypes.memset(p, 1, (256 << 10) + 4096 * i)
        (held if i % 2 else freed).append(p)
    for p in freed:
        libc.free(p)
    before = (libc.mallinfo2().fordblks, rss())
    released = trim_heap()
    after = (libc.mallinfo2().fordblks, rss())
    print(json.dumps({"released": released, "free_heap": before[0], "rss_before": before[1], "rss_after": after[1]}))
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc_trim and mallinfo2 are glibc's (Linux)")
def test_trim_returns_the_free_heap_to_the_kernel():
    """100 freed blocks of 256-652 KiB kept by glibc (over 40 MiB of free heap): the trim reports a
    release and RSS falls by at least 90% of the free heap glibc reported."""
    import json

    out = subprocess.run([sys.executable, "-c", _FRAGMENT], capture_output=True, text=True, timeout=120, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["free_heap"] > 40 << 20, r
    assert r["released"] is True
    assert r["rss_before"] - r["rss_after"] >= 0.9 * r["free_heap"], r


def test_trim_without_malloc_trim_reports_nothing(monkeypatch):
    import dd_sglang.platform.heap as heap

    monkeypatch.setattr(heap, "_malloc_trim", lambda: None)
    assert trim_heap() is False


_PREFILLS = textwrap.dedent(
    """
    import random, sys, torch, torch.nn.functional as F
    from dd_sglang.platform.heap import scheduler_trimmer

    def rss():
        return int(open("/proc/self/statm").read().split()[1]) * 4096

    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2-135M's q/k/v, o, gate/up, down
    ws = [torch.randn(o, i).bfloat16() for o, i in shapes]
    rng, trimmer, marks = random.Random(0), scheduler_trimmer(), []
    for half in range(2):
        after = []
        for _ in range(int(sys.argv[1])):
            x = torch.randn(rng.randint(100, 2048), 576).bfloat16()  # a prefill chunk of a new length
            qkv = F.linear(x, ws[0])
            gu = F.linear(F.linear(qkv[:, :576], ws[1]), ws[2])
            x = F.linear(F.silu(gu[:, :1536]) * gu[:, 1536:], ws[3]) + x
            trimmer.after_prefill()
            after.append(rss())
        marks.append(min(after[-20:]))  # the floor of the half's last 20 steps (just after a trim, if any)
    print(marks[1] - marks[0], trimmer.trims)
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc_trim is glibc's (Linux)")
def test_prefills_of_new_lengths_stop_growing_memory_with_the_trim():
    """Issue 52's mechanism without SGLang: one bfloat16 layer of SmolLM2-135M's products on a
    prefill chunk of a new length (100-2,048 rows) per step, the launcher's cache caps, and the
    scheduler's trimmer after each step at an interval scaled to these ~0.13 s steps as the
    server's 5 s is to its prefills (0.2 s). RSS is read after every step and each half's figure is the
    lowest of its last 20 (the floor a trim leaves; without trims RSS only rises). After 80 steps, 80
    more add at most 32 MiB with the trim (-2 to -5 MiB in three runs on the Intel AMX host this was written
    on). With
    ``DD_SGLANG_CPU_HEAP_TRIM_S=0`` in the environment (honoured here) glibc keeps the freed
    buffers: +154 MiB there, which fails."""
    import os

    interval = "0" if os.environ.get(TRIM_INTERVAL_ENV, "").strip() == "0" else "0.2"
    env = {**os.environ, TRIM_INTERVAL_ENV: interval, "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "256", "LRU_CACHE_CAPACITY": "256"}
    r = subprocess.run([sys.executable, "-c", _PREFILLS, "80"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    grown, trims = r.stdout.split()[-2:]
    grown = int(grown) / 2**20
    print(f"RSS growth over the second 80 steps: {grown:.1f} MiB, {trims} trims ({TRIM_INTERVAL_ENV}={interval})")
    assert grown <= 32, f"{grown:.1f} MiB over 80 prefills of new lengths ({trims} trims, {TRIM_INTERVAL_ENV}={interval})"
