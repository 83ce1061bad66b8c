"""``make loadtest``: a bounded headless Locust run of loadtest/locustfile.py against a real server.

Usage::

    python -m loadtest.run [--users 8] [--spawn-rate 2] [--run-time 2m] [--stop-timeout 120]
                           [--csv PREFIX] [--host URL] [-- extra launcher flags]

Without ``--host`` it starts ``python -m dd_sglang.launch_server --attention-backend dualdecoder``
(the default preset, as ``make serve ARGS="--attention-backend dualdecoder"``) on free loopback
ports, waits until it is healthy, runs Locust headless, then stops the server. With ``--host`` it
drives that server instead (a GPU host, say; ``DD_LOAD_API_KEY`` if it has a key). Locust's CSV
stats go to ``PREFIX_stats.csv`` (and ``_stats_history``, ``_failures``, ``_exceptions``), its
final stats to ``PREFIX_final.json``; the default ``PREFIX`` is in ``loadtest/results/last/``,
which git ignores (the committed ``loadtest/results/load_*.csv`` are a recorded run).

Prints requests, failures and p50/p99 latency per scenario and in total, and exits 1 when any
request failed (an HTTP error or a wrong answer), when none ran, or when Locust itself failed;
2 when the server did not start. The figures come from Locust's final stats (``--json-file``,
written at its exit), which count the requests that finish during ``--stop-timeout``; its CSV
is rewritten only once a second while it runs and misses them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from harness.server import ROOT, start_server


def _row(name: str, entries: list[dict]) -> dict:
    """One summary row over Locust stats entries: requests, failures, p50/p99 response time (ms)."""
    times = [(int(ms), n) for e in entries for ms, n in e["response_times"].items()]
    samples = np.repeat([ms for ms, _ in times], [n for _, n in times]) if times else np.zeros(1)
    p50, p99 = np.percentile(samples, [50, 99], method="inverted_cdf")
    return {"name": name, "requests": sum(e["num_requests"] for e in entries),
            "failures": sum(e["num_failures"] for e in entries), "p50_ms": int(p50), "p99_ms": int(p99)}  # fmt: skip


def summarize(final_json: Path) -> tuple[list[dict], dict]:
    """Locust's final stats (``--json-file``: a list of entries with ``name``, ``num_requests``,
    ``num_failures`` and ``response_times``, a histogram of rounded milliseconds) as
    ``(one row per request name, the total row)``: :func:`_row`'s keys; percentiles by nearest
    rank (numpy's ``inverted_cdf``). Raises ``OSError`` / ``ValueError`` for a missing or bad file."""
    entries = json.loads(final_json.read_text())
    names = sorted({e["name"] for e in entries})
    rows = [_row(n, [e for e in entries if e["name"] == n]) for n in names]
    return rows, _row("Aggregated", entries)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.run", description=__doc__.split("\n\n")[0])
    ap.add_argument("--users", "-u", type=int, default=8)
    ap.add_argument("--spawn-rate", "-r", type=float, default=2.0)
    ap.add_argument("--run-time", "-t", default="2m")
    ap.add_argument("--stop-timeout", type=int, default=120,
                    help="seconds Locust waits for running requests after --run-time")  # fmt: skip
    ap.add_argument("--csv", default=str(ROOT / "loadtest" / "results" / "last" / "load"),
                    help="path prefix of Locust's CSV stats and the final JSON")  # fmt: skip
    ap.add_argument("--host", default=None, help="drive this server instead of starting one")
    ap.add_argument(
        "--max-total-tokens", type=int, default=16384, help="device KV pool of the started server"
    )
    ap.add_argument("launcher_args", nargs="*", help="extra flags for the started server (after --)")
    args = ap.parse_args(argv)
    if args.stop_timeout < 0:
        ap.error(f"--stop-timeout must be >= 0 seconds, got {args.stop_timeout}")
    Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
    final = Path(f"{args.csv}_final.json")
    final.unlink(missing_ok=True)  # a stale one must not pass for this run's
    srv = None
    host = args.host
    if host is None:
        log = Path(tempfile.mkdtemp(prefix="dd_loadtest_")) / "server.log"
        print(f"starting a dualdecoder server (log: {log})", flush=True)
        try:
            srv = start_server(log, args.max_total_tokens,
                               ["--attention-backend", "dualdecoder", "--enable-cache-report", *args.launcher_args],
                               timeout=900)  # fmt: skip
        except RuntimeError as err:
            print(err, file=sys.stderr)
            return 2
        host = srv.url
        print(f"server ready in {srv.start_seconds:.0f} s at {host}", flush=True)
    locust = Path(sys.executable).with_name("locust")
    cmd = [str(locust), "-f", str(ROOT / "loadtest" / "locustfile.py"), "--headless", "-u", str(args.users),
           "-r", str(args.spawn_rate), "-t", args.run_time, "--host", host, "--csv", args.csv,
           "--json-file", str(final.with_suffix("")), "--only-summary", "--stop-timeout", str(args.stop_timeout)]  # fmt: skip
    try:
        rc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}).returncode
    finally:
        if srv is not None:
            code, alive = srv.stop()
            print(f"server stopped (exit code {code}{', left: ' + str(alive) if alive else ''})", flush=True)
    if not final.is_file():
        print(f"FAILED: Locust wrote no final stats ({final}); locust exit code {rc}", file=sys.stderr)
        return 1
    rows, total = summarize(final)
    print(f"\n{'scenario':28s} {'requests':>8s} {'failures':>8s} {'p50 ms':>8s} {'p99 ms':>8s}")
    for r in [*rows, total]:
        print(f"{r['name']:28s} {r['requests']:>8d} {r['failures']:>8d} {r['p50_ms']:>8d} {r['p99_ms']:>8d}")
    n, failed = total["requests"], total["failures"]
    if n == 0 or failed or rc != 0:
        print(f"FAILED: {n} requests, {failed} failures, locust exit code {rc} "
              f"(details: {args.csv}_failures.csv)", file=sys.stderr)  # fmt: skip
        return 1
    print(f"OK: {n} requests, 0 failures")
    return 0


if __name__ == "__main__":
    sys.exit(main())
