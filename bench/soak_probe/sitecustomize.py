"""``python -m bench.soak --probe``: a look inside every Python process of the soak's server.

Python imports ``sitecustomize`` at start-up from ``sys.path``; ``bench.soak --probe`` puts this
folder on the launcher's ``PYTHONPATH`` with :data:`DIR_ENV` set, and every process of the server
(the launcher, SGLang's tokenizer manager, scheduler and detokenizer, the sidecar) inherits both.
Without :data:`DIR_ENV` this does nothing. With it, a daemon thread polls ``$DIR/trigger`` once a
second; for each new line ``TAG [trim]`` it writes ``$DIR/<pid>.<TAG>.json`` with the tools that
already exist for this:

* ``rss``: ``VmRSS`` and ``RssAnon`` of ``/proc/self/status`` (bytes);
* ``mallinfo2``: glibc's heap figures summed over its arenas (``arena``: bytes taken from the
  system by ``brk``/arenas, ``uordblks``: in use, ``fordblks``: free but kept, ``hblkhd``: in
  ``mmap`` blocks), through ``ctypes``;
* ``gc_objects`` and ``gc_top``: the number of objects the garbage collector tracks, and the 40
  most common types (``gc.get_objects``);
* ``tracemalloc``: traced bytes and the 40 largest lines, when the process runs with
  ``PYTHONTRACEMALLOC`` set (``bench.soak --env PYTHONTRACEMALLOC=1``);
* with ``trim``: the same RSS and ``mallinfo2`` figures after ``malloc_trim(0)`` (how much of the
  resident heap glibc held free), under ``*_after_trim``.
"""

from __future__ import annotations

import os

DIR_ENV = "DD_SOAK_PROBE_DIR"


def _rss() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "RssAnon:")):
                out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return out


def _probe(tag: str, trim: bool) -> dict:
    import collections
    import ctypes
    import gc
    import sys

    libc = ctypes.CDLL("libc.so.6")

    class Mallinfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                    "fsmblks", "uordblks", "fordblks", "keepcost")]  # fmt: skip

    libc.mallinfo2.restype = Mallinfo2

    def mallinfo() -> dict[str, int]:
        mi = libc.mallinfo2()
        return {n: getattr(mi, n) for n, _ in Mallinfo2._fields_}

    objs = gc.get_objects()
    out = {"pid": os.getpid(), "argv": " ".join(sys.argv)[:300], "tag": tag, "rss": _rss(),
           "mallinfo2": mallinfo(), "gc_objects": len(objs),
           "gc_top": collections.Counter(type(o).__qualname__ for o in objs).most_common(40)}  # fmt: skip
    del objs
    import tracemalloc

    if tracemalloc.is_tracing():
        snap = tracemalloc.take_snapshot()
        out["tracemalloc"] = {"traced_bytes": tracemalloc.get_traced_memory()[0],
                              "top": [(str(s.traceback[0]), s.size, s.count)
                                      for s in snap.statistics("lineno")[:40]]}  # fmt: skip
    if trim:
        libc.malloc_trim(0)
        out["rss_after_trim"], out["mallinfo2_after_trim"] = _rss(), mallinfo()
    return out


def _watch(folder: str) -> None:
    import json
    import time

    trigger, done = os.path.join(folder, "trigger"), 0
    while True:
        time.sleep(1.0)
        try:
            with open(trigger) as f:
                lines = [line.split() for line in f.read().splitlines() if line.strip()]
        except OSError:
            continue
        for words in lines[done:]:
            try:
                out = _probe(words[0], "trim" in words[1:])
            except Exception as err:  # a probe must never take its process down
                out = {"pid": os.getpid(), "tag": words[0], "error": repr(err)}
            path = os.path.join(folder, f"{os.getpid()}.{words[0]}.json")
            with open(path + ".tmp", "w") as f:
                json.dump(out, f)
            os.replace(path + ".tmp", path)
        done = len(lines)


if os.environ.get(DIR_ENV):
    import threading

    threading.Thread(target=_watch, args=(os.environ[DIR_ENV],), daemon=True, name="dd-soak-probe").start()
