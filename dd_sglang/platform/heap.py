"""Returning the scheduler's freed heap to the system on the CPU platform (issue 52).

A CPU server fed prompts of every length allocates and frees prefill-sized buffers (activations,
oneDNN primitives and their scratch) of a new size with nearly every request. glibc's malloc keeps
what is freed inside its arenas for reuse, and with sizes that never repeat the kept free heap only
grows: in a dense scheduler after 75 requests of 100-6,000 tokens, heap in use rose 53 MiB and free
heap glibc kept (``mallinfo2().fordblks``) 209 MiB (``docs/operations-memory.md``). glibc's
``malloc_trim(0)`` hands every whole free page of every arena back to the kernel
(``madvise(MADV_DONTNEED)``, malloc/malloc.c ``mtrim``); the next allocation there faults fresh
zeroed pages back in, which is what a trim costs.

:class:`HeapTrimmer` calls it after a prefill batch, at most once per ``interval_s`` seconds, and once
when the scheduler goes idle after prefills it did not trim behind (so an idle server holds no
prefill's freed buffers);
:func:`trim_heap` is also what :meth:`dd_sglang.platform.cpu.TorchCpuPlatform.empty_cache` does,
so SGLang's own calls (idle sleep with ``SGLANG_EMPTY_CACHE_INTERVAL``, ``flush_cache``) return the
heap too. Under an allocator other than glibc's (tcmalloc or jemalloc through ``LD_PRELOAD``, musl)
``malloc_trim`` is absent or does nothing; :func:`trim_heap` then returns False.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import time
from collections.abc import Callable
from functools import cache

#: Environment variable: seconds between two trims of the scheduler's heap after prefill batches;
#: ``0`` turns trimming off. Read by :func:`trim_interval_s`, refused by the launcher before SGLang
#: starts unless a number in ``[0, 3600]``.
TRIM_INTERVAL_ENV = "DD_SGLANG_CPU_HEAP_TRIM_S"
#: The default interval (s), chosen by measurement (``docs/operations-memory.md``, issue 52).
DEFAULT_TRIM_INTERVAL_S = 5.0
#: Largest accepted interval (s): one hour.
MAX_TRIM_INTERVAL_S = 3600.0


def trim_interval_s(environ: dict[str, str] | None = None) -> float:
    """The trim interval in seconds from :data:`TRIM_INTERVAL_ENV` (default
    :data:`DEFAULT_TRIM_INTERVAL_S`; 0 = off).

    Raises:
        ValueError: the value is not a number in ``[0, 3600]``; the message names the variable and
            the range.
    """
    raw = (os.environ if environ is None else environ).get(TRIM_INTERVAL_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_TRIM_INTERVAL_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0.0 <= value <= MAX_TRIM_INTERVAL_S:  # NaN fails both
        raise ValueError(f"{TRIM_INTERVAL_ENV} must be seconds in [0, {MAX_TRIM_INTERVAL_S:g}] (0: off), got {raw!r}")
    return value


@cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``int malloc_trim(size_t pad)``, or None where the C library has none."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    fn = getattr(ctypes.CDLL(name), "malloc_trim", None)
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


def trim_heap() -> bool:
    """Return every whole free page of glibc's heap to the kernel (``malloc_trim(0)``).

    Returns:
        True when glibc released memory (its return value 1), False when it released none or the C
        library has no ``malloc_trim``.
    """
    fn = _malloc_trim()
    return bool(fn(0)) if fn is not None else False


class HeapTrimmer:
    """Rate-limited :func:`trim_heap` for the scheduler loop.

    Args:
        interval_s: least time between two trims (s); 0 turns it off.
        clock: monotonic clock in seconds (``time.monotonic``; a test passes its own).
        trim: the trim itself (:func:`trim_heap`; a test passes its own).

    Attributes:
        trims: trims done so far; ``released``: how many of them released memory; ``seconds``: the
            time spent in them (s, by ``clock``).
    """

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic,
                 trim: Callable[[], bool] = trim_heap) -> None:  # fmt: skip
        self.interval_s = float(interval_s)
        self._clock = clock
        self._trim = trim
        self._last = clock()
        self.trims = 0
        self.released = 0
        self.seconds = 0.0
        self._behind = False  # a prefill ran since the last trim

    def after_prefill(self) -> bool:
        """Called after each prefill (extend) batch: trim when on and ``interval_s`` has passed
        since the last trim (or since construction). Returns whether it trimmed."""
        if self.interval_s <= 0:
            return False
        now = self._clock()
        if now - self._last < self.interval_s:
            self._behind = True
            return False
        return self._run(now)

    def when_idle(self) -> bool:
        """Called while the scheduler has no batch to run: trim when on and a prefill ran since the
        last trim (once per such idle spell). Returns whether it trimmed."""
        if self.interval_s <= 0 or not self._behind:
            return False
        return self._run(self._clock())

    def _run(self, now: float) -> bool:
        self.released += bool(self._trim())
        self.trims += 1
        self._last = self._clock()  # after the trim: its own time does not count toward the next
        self.seconds += self._last - now
        self._behind = False
        return True


@cache
def scheduler_trimmer() -> HeapTrimmer:
    """This process's :class:`HeapTrimmer`, interval from the environment (:func:`trim_interval_s`)."""
    return HeapTrimmer(trim_interval_s())


def on_cpu_platform() -> bool:
    """True when SGLang runs on this package's CPU platform (:class:`~dd_sglang.platform.cpu.TorchCpuPlatform`)."""
    from sglang.srt.platforms import current_platform

    from dd_sglang.platform.cpu import TorchCpuPlatform

    return isinstance(current_platform, TorchCpuPlatform)


def after_prefill_batch() -> bool:
    """The scheduler's call after each prefill batch: :meth:`HeapTrimmer.after_prefill` of
    :func:`scheduler_trimmer` on this package's CPU platform; nothing on any other platform (a GPU
    server's host heap is left to its own allocator settings). Returns whether it trimmed."""
    return on_cpu_platform() and scheduler_trimmer().after_prefill()


def when_scheduler_idle() -> bool:
    """The scheduler's call while it has no batch: :meth:`HeapTrimmer.when_idle` of
    :func:`scheduler_trimmer` on this package's CPU platform, nothing elsewhere. Returns whether it
    trimmed."""
    return on_cpu_platform() and scheduler_trimmer().when_idle()
