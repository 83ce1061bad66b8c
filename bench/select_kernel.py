"""The C selection kernel alone: time per decode step's selection, host tier on huge pages or not.

``spec_host``'s selection (``dd_sglang.kernels.native.spec_host_select``) reads the int8 key
index of every candidate and the bf16 keys of the re-ranked ones, scattered over the host tier.
This bench times it over buffers from :func:`dd_sglang.kvcache.host_memory.host_zeros` (advised
onto 2 MiB transparent huge pages, what the server allocates) against the same data in plain
:func:`torch.zeros` buffers (4 KiB pages), in one run: the two layouts alternate per round and the
ratio is taken per round. SmolLM2-135M's geometry (30 layers, 3 KV heads x 3 queries, head_dim 64),
random keys (seed 0), each request's positions on consecutive host slots as the server lays them
out, ``k`` 256 and ``rerank`` 2 (the CPU preset), 10 layers a call (the default's chunk; ``--chunk 1``:
one layer a call, as ``host_sync`` selects at attention time).

With ``--baseline-rev REV`` the two timed variants are instead this checkout's kernel and REV's
``cpu_select.c`` built with the same flags, both on huge pages (``baseline_over_current``).

Run: ``python -m bench.select_kernel --out bench/results/select_kernel_cpu.json`` (about 1 min;
on a quiet machine: nothing else running).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.cli import write_result
from dd_sglang.kernels import native
from dd_sglang.kvcache.host_memory import host_zeros, transparent_huge_pages
from dd_sglang.prefetch.selectors import SpecHostSelector
from harness.server import ROOT

LAYERS, HKV, GROUP, HEAD_DIM = 30, 3, 3, 64  # SmolLM2-135M
CHUNK = 10  # layers per call, the default's chunk


def _buffers(rows: int, tokens: int, huge: bool) -> dict:
    """The host tier's keys and int8 index for ``rows`` requests of ``tokens`` positions."""
    slots_n = rows * tokens
    make = host_zeros if huge else (lambda shape, dtype: torch.zeros(shape, dtype=dtype))
    g = torch.Generator().manual_seed(0)
    keys = make((LAYERS, slots_n, HKV, HEAD_DIM), torch.bfloat16)
    keys.copy_(torch.randn(keys.shape, generator=g))
    q8 = make((LAYERS, slots_n, HKV, HEAD_DIM), torch.int8)
    scale = make((LAYERS, slots_n, HKV), torch.float32)
    native.quantize_keys(keys, torch.arange(slots_n), q8, scale)  # the server's index arithmetic
    return {"keys": keys, "q8": q8, "scale": scale}


def _step_seconds(buf: dict, rows: int, tokens: int, k: int, m: int, calls: int, chunk: int = CHUNK) -> float:
    """Mean seconds of one decode step's selection (every layer, in calls of ``chunk`` layers)."""
    slots = torch.arange(rows * tokens).view(rows, tokens)
    ok = torch.ones(rows, tokens, dtype=torch.bool)
    q = torch.randn(chunk, rows, HKV * GROUP, HEAD_DIM, generator=torch.Generator().manual_seed(1))
    chunks = [slice(c, c + chunk) for c in range(0, LAYERS, chunk)]
    t0 = time.perf_counter()
    for i in range(calls):
        ls = chunks[i % len(chunks)]
        native.spec_host_select(q, slots, ok, buf["q8"][ls], buf["scale"][ls], buf["keys"][ls], k, m, 0.125)
    return (time.perf_counter() - t0) / calls * len(chunks)


def _baseline_library(rev: str, ap) -> Path:
    """The C kernel built from ``cpu_select.c`` as of git revision ``rev`` (same flags, the same
    build cache); ``ap.error`` naming ``--baseline-rev`` when git cannot show that file there."""
    proc = subprocess.run(["git", "show", f"{rev}:dd_sglang/kernels/cpu_select.c"], cwd=ROOT, capture_output=True)
    if proc.returncode != 0:
        ap.error(f"--baseline-rev: no dd_sglang/kernels/cpu_select.c at {rev!r} ({proc.stderr.decode().strip()})")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "cpu_select.c"
        src.write_bytes(proc.stdout)
        return native.build(source=src)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.select_kernel", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--out", default="bench/results/select_kernel_cpu.json")
    ap.add_argument("--cells", default="4000x8,7900x1", help="tokens x rows, comma-separated")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=30, help="kernel calls per round and layout")
    ap.add_argument("--k", type=int, default=256)
    ap.add_argument("--rerank", type=float, default=2.0)
    ap.add_argument("--chunk", type=int, default=CHUNK,
                    help="layers a call: 10, spec_host's next-step selection (the default's chunk); 1, host_sync's "
                         "selection at attention time, one call a layer")  # fmt: skip
    ap.add_argument("--baseline-rev", default=None, metavar="REV",
                    help="time REV's cpu_select.c (a git revision) against this checkout's, both on huge pages, "
                         "instead of huge against base pages")  # fmt: skip
    args = ap.parse_args(argv)
    if not native.available():
        print(f"the C kernel is not available: {native.unavailable_reason()}", file=sys.stderr)
        return 1
    try:
        shapes = [tuple(int(x) for x in cell.split("x")) for cell in args.cells.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(t) != 2 or min(t) < 1 for t in shapes):
        ap.error(f"--cells must be TOKENSxROWS pairs of positive integers, comma-separated; got {args.cells!r}")
    if args.k < 1 or args.rerank < 1:
        ap.error(f"--k and --rerank must be >= 1, got {args.k} and {args.rerank}")
    if not 1 <= args.chunk <= LAYERS or LAYERS % args.chunk:
        ap.error(f"--chunk must divide the model's {LAYERS} layers, got {args.chunk}")
    m = SpecHostSelector(args.rerank)._m(args.k)  # the candidates the server re-ranks
    current = native.build()
    baseline = _baseline_library(args.baseline_rev, ap) if args.baseline_rev else None
    cells = []
    for tokens, rows in shapes:
        huge = _buffers(rows, tokens, True)
        if baseline is None:  # name: (buffers, library); the ratio is the second over the first
            variants = {"huge_pages": (huge, current), "base_pages": (_buffers(rows, tokens, False), current)}
        else:
            variants = {"current": (huge, current), "baseline": (huge, baseline)}
        for buf, lib in variants.values():  # warm: first touch and the kernel's first call
            native.load(lib)
            _step_seconds(buf, rows, tokens, args.k, m, 3, args.chunk)
        per = {name: [] for name in variants}
        for r in range(args.rounds):
            order = list(variants) if r % 2 == 0 else list(reversed(variants))
            for name in order:
                buf, lib = variants[name]
                native.load(lib)
                per[name].append(_step_seconds(buf, rows, tokens, args.k, m, args.calls, args.chunk))
        first, second = variants
        ratios = [b / a for a, b in zip(per[first], per[second], strict=True)]
        key = "base_over_huge" if baseline is None else "baseline_over_current"
        cells.append({
            "tokens": tokens, "rows": rows,
            "step_ms": {name: round(statistics.median(v) * 1e3, 2) for name, v in per.items()},
            "rounds_ms": {name: [round(x * 1e3, 2) for x in v] for name, v in per.items()},
            key: round(statistics.median(ratios), 3),
            f"{key}_range": [round(min(ratios), 3), round(max(ratios), 3)],
        })  # fmt: skip
        print(cells[-1])
        del variants, huge
    native.load(current)
    write_result({
        "bench": "select_kernel", "command": "python -m bench.select_kernel " + " ".join(argv or sys.argv[1:]),
        "machine": {"processor": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "transparent_huge_pages": transparent_huge_pages()},
        "settings": {"layers": LAYERS, "kv_heads": HKV, "group": GROUP, "head_dim": HEAD_DIM, "chunk": args.chunk,
                     "k": args.k, "m": m, "rounds": args.rounds, "calls": args.calls,
                     "baseline_rev": args.baseline_rev},
        "cells": cells,
    }, args.out)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
