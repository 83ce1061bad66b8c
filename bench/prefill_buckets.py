"""Prefill speed and scheduler memory with and without a CPU platform setting (issue 52): the row
buckets by default, or any other switch of the launcher's environment (``--switch``).

The CPU platform pads prefill-sized bfloat16 products to a few row counts
(:func:`dd_sglang.platform.linear.bucketed_linear`) so that oneDNN builds and caches primitives
for 56 row counts instead of one per new prompt length. This measures what that costs or saves in
prefill, on dense servers of the same launcher that differ only in ``DD_SGLANG_CPU_ROW_BUCKETS``
(1: buckets, the default; 0: each product at its own row count), started one after the other,
``--rounds`` times each, alternating: every server gets the same ``--requests`` prompts of uniform
random lengths in ``--tokens`` (token ids cut from Debian's licence texts, :func:`bench.soak.prompt_tokens`),
one at a time, greedy, one new token each (so the time is the prefill's). Per server: the prompt
tokens per second over the requests (wall time of each request as the client sees it), and the
scheduler's RSS before and after the requests.

``--switch NAME --values OFF ON`` compares the two values of another variable instead, e.g. the
heap trim: ``--switch DD_SGLANG_CPU_HEAP_TRIM_S --values 0 5``; the JSON then names the variable
(``switch``) and keys the figures by its values.

Run: ``python -m bench.prefill_buckets --out bench/results/prefill_buckets_cpu.json`` (about 10 min).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

from bench.cli import check_ranges, write_result
from bench.soak import MiB, license_token_ids, prompt_tokens
from dd_sglang.platform import ROW_BUCKETS_ENV
from harness.server import launch_server, role_of


def _scheduler_rss(srv) -> int:
    return sum(p.memory_info().rss for p in srv.family() if role_of(p, srv.proc.pid) == "scheduler")


def one_server(value: str, prompts: list[list[int]], args, tmp: Path) -> dict:
    """Start a dense server with ``args.switch`` set to ``value``, send ``prompts`` one at a time, stop it."""
    env = {args.switch: value}
    flags = ["--chunked-prefill-size", str(args.chunked_prefill_size)]
    srv = launch_server(tmp / f"server_{value}_{time.monotonic_ns()}.log", args.max_total_tokens, flags, env=env)
    try:
        srv.wait_ready(900)
        warm = srv.post("/generate", {"input_ids": prompts[0][:50], "sampling_params": {"max_new_tokens": 1}})
        warm.raise_for_status()
        before = _scheduler_rss(srv)
        seconds = []
        for ids in prompts:
            t0 = time.perf_counter()
            r = srv.post("/generate", {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 1}})
            r.raise_for_status()
            seconds.append(time.perf_counter() - t0)
        after = _scheduler_rss(srv)
    finally:
        rc, alive = srv.stop()
    tokens = sum(len(p) for p in prompts)
    key = {"row_buckets": value == "1"} if args.switch == ROW_BUCKETS_ENV else {}
    return {**key, "value": value, "prompt_tokens": tokens, "seconds": round(sum(seconds), 2),
            "prefill_tokens_per_s": round(tokens / sum(seconds), 1),
            "scheduler_rss_mib": {"before": round(before / MiB, 1), "after": round(after / MiB, 1)},
            "exit_code": rc, "processes_left": alive}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, nargs=2, default=(100, 6000), metavar=("MIN", "MAX"))
    ap.add_argument("--max-total-tokens", type=int, default=8192)
    ap.add_argument("--chunked-prefill-size", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--switch", default=ROW_BUCKETS_ENV, help="the environment variable the two servers differ in")
    ap.add_argument("--values", nargs=2, default=("0", "1"), metavar=("OFF", "ON"), help="its two values")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    check_ranges(ap, args, (("requests", 1, 10_000), ("rounds", 1, 20), ("max_total_tokens", 256, 10**7),
                            ("chunked_prefill_size", 16, 10**6)))  # fmt: skip
    lo, hi = args.tokens
    if not 1 <= lo <= hi < args.max_total_tokens:
        ap.error(f"--tokens must be MIN MAX with 1 <= MIN <= MAX < --max-total-tokens, got {lo} {hi}")
    if args.values[0] == args.values[1]:
        ap.error(f"--values must be two different values, got {args.values[0]!r} twice")
    rng = random.Random(args.seed)
    ids = license_token_ids()
    prompts = [prompt_tokens(rng, ids, lo, hi) for _ in range(args.requests)]
    tmp = Path(tempfile.mkdtemp(prefix="dd_prefill_buckets_"))
    runs = []
    for _ in range(args.rounds):
        for value in args.values:
            runs.append(one_server(value, prompts, args, tmp))
            print(runs[-1], file=sys.stderr, flush=True)
    rate = {v: sum(r["prefill_tokens_per_s"] for r in runs if r["value"] == v) / args.rounds for v in args.values}
    off, on = args.values
    settings = {"requests": args.requests, "rounds": args.rounds, "tokens": [lo, hi], "max_total_tokens": args.max_total_tokens,
                "chunked_prefill_size": args.chunked_prefill_size, "seed": args.seed}  # fmt: skip
    out = {"bench": "prefill_buckets", "command": "python -m bench.prefill_buckets " + " ".join(sys.argv[1:] if argv is None else argv),
           "settings": settings, "runs": runs}  # fmt: skip
    if args.switch == ROW_BUCKETS_ENV and (off, on) == ("0", "1"):
        out |= {"prefill_tokens_per_s": {"buckets": round(rate[on], 1), "no_buckets": round(rate[off], 1)},
                "buckets_over_no_buckets": round(rate[on] / rate[off], 3)}  # fmt: skip
    else:
        out |= {"switch": args.switch, "prefill_tokens_per_s": {off: round(rate[off], 1), on: round(rate[on], 1)},
                "on_over_off": round(rate[on] / rate[off], 3)}  # fmt: skip
    print(f"prefill tokens/s: {args.switch}={on} {rate[on]:.1f}, ={off} {rate[off]:.1f}: {rate[on] / rate[off]:.3f}x")
    if args.out:
        write_result(out, args.out)
    return 0 if all(r["exit_code"] == 0 and not r["processes_left"] for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
