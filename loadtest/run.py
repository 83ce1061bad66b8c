"""``make loadtest``: a bounded headless Locust run of loadtest/locustfile.py against a real server.

Usage::

    python -m loadtest.run [--users 8] [--spawn-rate 2] [--run-time 2m] [--csv PREFIX]
                           [--host URL] [-- extra launcher flags]

Without ``--host`` it starts ``python -m dd_sglang.launch_server --attention-backend dualdecoder``
(the default preset, as ``make serve ARGS="--attention-backend dualdecoder"``) on free loopback
ports, waits until it is healthy, runs Locust headless, then stops the server. With ``--host`` it
drives that server instead (a GPU host, say; ``DD_LOAD_API_KEY`` if it has a key). Locust's CSV
stats go to ``PREFIX_stats.csv`` (and ``_stats_history``, ``_failures``, ``_exceptions``).

Prints requests, failures and p50/p99 latency per scenario and in total, and exits 1 when any
request failed (an HTTP error or a wrong answer), when none ran, or when Locust itself failed;
2 when the server did not start.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.server import ROOT, start_server


def summarize(stats_csv: Path) -> tuple[list[dict], dict]:
    """Rows of Locust's ``_stats.csv``: ``(per-request-name rows, the Aggregated row)``."""
    rows = list(csv.DictReader(open(stats_csv)))
    total = next(r for r in rows if r["Name"] == "Aggregated")
    return [r for r in rows if r["Name"] != "Aggregated"], total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.run", description=__doc__.split("\n\n")[0])
    ap.add_argument("--users", "-u", type=int, default=8)
    ap.add_argument("--spawn-rate", "-r", type=float, default=2.0)
    ap.add_argument("--run-time", "-t", default="2m")
    ap.add_argument("--csv", default=str(ROOT / "loadtest" / "results" / "load"), help="CSV path prefix")
    ap.add_argument("--host", default=None, help="drive this server instead of starting one")
    ap.add_argument(
        "--max-total-tokens", type=int, default=16384, help="device KV pool of the started server"
    )
    ap.add_argument("launcher_args", nargs="*", help="extra flags for the started server (after --)")
    args = ap.parse_args(argv)
    Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
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
           "--only-summary", "--stop-timeout", "120"]  # fmt: skip
    try:
        rc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}).returncode
    finally:
        if srv is not None:
            code, alive = srv.stop()
            print(f"server stopped (exit code {code}{', left: ' + str(alive) if alive else ''})", flush=True)
    rows, total = summarize(Path(f"{args.csv}_stats.csv"))
    print(f"\n{'scenario':28s} {'requests':>8s} {'failures':>8s} {'p50 ms':>8s} {'p99 ms':>8s}")
    for r in [*rows, total]:
        print(
            f"{r['Name']:28s} {r['Request Count']:>8s} {r['Failure Count']:>8s} {r['50%']:>8s} {r['99%']:>8s}"
        )
    n, failed = int(total["Request Count"]), int(total["Failure Count"])
    if n == 0 or failed or rc != 0:
        print(f"FAILED: {n} requests, {failed} failures, locust exit code {rc} "
              f"(details: {args.csv}_failures.csv)", file=sys.stderr)  # fmt: skip
        return 1
    print(f"OK: {n} requests, 0 failures")
    return 0


if __name__ == "__main__":
    sys.exit(main())
