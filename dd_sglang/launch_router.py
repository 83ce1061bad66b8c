"""``python -m dd_sglang.launch_router``: N dd_sglang workers behind SGLang's gateway ``smg``.

Usage::

    python -m dd_sglang.launch_router [--workers N] [--host H] [--port P] [--policy NAME]
                                      [--worker-base-port P] [--metrics-base-port P]
                                      [--router-metrics-port P] [--smg-arg ARG ...]
                                      [any dd_sglang.launch_server / sglang flag for every worker ...]
    python -m dd_sglang.launch_router --worker-urls http://w0:30000 http://w1:30000 [...]

The gateway is ``smg`` (Shepherd Model Gateway, PyPI package ``smg``, the
successor of ``sglang-router``), run as ``python -m smg.launch_router``. With
HTTP workers, its ``cache_aware`` policy (the default here) keeps, per worker,
an approximate radix tree of the text it routed there (``--max-tree-size``
characters); a request goes to the worker whose tree shares the longest
prefix with it when that share is at least ``--cache-threshold`` (0.3),
otherwise to the worker with the smallest tree, and shortest-queue takes over
when loads diverge (``--balance-abs-threshold`` / ``--balance-rel-threshold``).
Event-driven cache routing (SGLang's ``--kv-events-config``) reaches smg only
from gRPC workers (``smg-grpc-servicer``); HTTP workers, as started here, are
routed on routed text. The tree is never told that a worker evicted a prefix
from its device, so a chat session's second turn returns to the worker that
served its first turn, whose ``dualdecoder`` host tier reloads the first
turn's KV (``REBUILD``) even after the device evicted it.

Start-up, in order:

1. Split the router flags from the worker flags (every flag not listed above
   goes to every worker's ``dd_sglang.launch_server`` unchanged). Worker
   ``--port``/``--metrics-port``/``--host`` are refused (exit 2): the router
   assigns them (``--worker-base-port + i``, ``--metrics-base-port + i``, the
   router's ``--worker-host``).
2. Check every port is free and that smg's own parser accepts ``--policy``
   and the ``--smg-arg`` flags (exit 2 if not).
3. Start the N workers at once (each a launcher in its own session, told to
   stop with this process: ``PR_SET_PDEATHSIG``) and wait until every one
   answers ``/health`` (``--start-timeout-s``); a worker that exits during
   start-up stops everything (exit 1).
4. Start ``smg`` with ``--worker-urls`` of the workers, ``--policy``, its
   Prometheus port, and :data:`SMG_DEFAULTS` (health checks of ``/ready``
   every :data:`HEALTH_CHECK_INTERVAL_S` s).
5. Supervise: a worker that dies is logged and left out (the gateway routes
   around it: its health checks and transport failures exclude it); if
   ``smg`` exits, everything stops (exit 1).
6. SIGINT/SIGTERM: SIGTERM to ``smg`` and to every worker launcher (each
   stops its SGLang), SIGKILL after :data:`SHUTDOWN_GRACE_S` s, exit 0.

With ``--worker-urls`` only the gateway is started, in front of workers run
elsewhere (the compose variant ``docker/compose.scale.yaml`` does this).
"""

from __future__ import annotations

import argparse
import logging
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import httpx

from dd_sglang.launcher.sglang_argv import has_flag
from dd_sglang.launcher.startup_checks import port_error
from dd_sglang.launcher.supervision import child_setup

logger = logging.getLogger("dd_sglang.launch_router")

SHUTDOWN_GRACE_S = 60.0
#: Seconds between the gateway's health checks of each worker (smg's default is 60).
HEALTH_CHECK_INTERVAL_S = 5
#: smg's flags set here unless given through ``--smg-arg``:
#:
#: * health checks on SGLang's ``/ready`` (answered by its HTTP server) every few seconds, two
#:   failures marking a worker unhealthy: a dead worker refuses connections and leaves the routing
#:   table within seconds. smg's default, ``/health``, makes SGLang run a one-token generation that
#:   waits behind the running batch: a worker busy with a long prefill misses smg's 5 s timeout
#:   and loses its sessions to another worker;
#: * no cache hit diverted to a "thin" worker to warm it (smg diverts one hit in 8 by default):
#:   with the host tier a hit is a long prefix reloaded instead of recomputed.
SMG_DEFAULTS: tuple[tuple[str, str], ...] = (
    ("--health-check-endpoint", "/ready"),
    ("--health-check-interval-secs", str(HEALTH_CHECK_INTERVAL_S)),
    ("--health-failure-threshold", "2"),
    ("--health-check-timeout-secs", "5"),
    ("--worker-warmup-divert-every", "0"),
)
#: Worker flags the router assigns itself.
RESERVED_WORKER_FLAGS = ("--port", "--metrics-port", "--host", "--metrics-host")


@dataclass
class Worker:
    """One ``dd_sglang.launch_server`` child: API ``url``, sidecar ``metrics_url``."""

    index: int
    url: str
    metrics_url: str
    proc: subprocess.Popen | None = None
    exited_logged: bool = False


def parse_router_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Split ``argv`` into the router's flags and the worker flags (returned unchanged).

    Raises:
        SystemExit(2): a bad router flag (argparse's message).
    """
    ap = argparse.ArgumentParser(
        prog="python -m dd_sglang.launch_router",
        description="N dd_sglang workers behind SGLang's gateway smg. Unknown flags go to every worker.",
        allow_abbrev=False,
    )
    ap.add_argument("--workers", type=int, default=2, help="local workers to start (default 2)")
    ap.add_argument(
        "--worker-urls",
        nargs="+",
        default=None,
        help="route to these running workers instead of starting any",
    )
    ap.add_argument("--host", default="127.0.0.1", help="gateway host (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=30000, help="gateway port (default 30000)")
    ap.add_argument(
        "--policy",
        default="cache_aware",
        help="smg routing policy: cache_aware (default), round_robin, random, power_of_two, ...",
    )
    ap.add_argument(
        "--worker-host", default="127.0.0.1", help="host the local workers bind (default 127.0.0.1)"
    )
    ap.add_argument(
        "--worker-base-port", type=int, default=30010, help="worker i serves on this + i (default 30010)"
    )
    ap.add_argument(
        "--metrics-base-port",
        type=int,
        default=9464,
        help="worker i's metrics sidecar on this + i (default 9464)",
    )
    ap.add_argument(
        "--router-metrics-port", type=int, default=29000, help="smg's Prometheus port (default 29000)"
    )
    ap.add_argument(
        "--start-timeout-s", type=float, default=600.0, help="seconds for workers to become healthy"
    )
    ap.add_argument(
        "--smg-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one extra smg flag or value, repeatable (e.g. --smg-arg=--cache-threshold --smg-arg=0.5)",
    )
    return ap.parse_known_args(argv)


def smg_command(args: argparse.Namespace, worker_urls: list[str]) -> list[str]:
    """The gateway's command line: ``python -m smg.launch_router`` with the workers, policy, ports,
    :data:`SMG_DEFAULTS` unless ``--smg-arg`` gives them, then the ``--smg-arg`` values."""
    cmd = [
        sys.executable, "-m", "smg.launch_router",
        "--host", args.host, "--port", str(args.port),
        "--worker-urls", *worker_urls,
        "--policy", args.policy,
        "--prometheus-host", args.host, "--prometheus-port", str(args.router_metrics_port),
    ]  # fmt: skip
    for flag, value in SMG_DEFAULTS:
        if not has_flag(args.smg_arg, flag):
            cmd += [flag, value]
    return cmd + list(args.smg_arg)


def _wait_healthy(workers: list[Worker], timeout: float, stop: threading.Event) -> str | None:
    """Wait until every worker's ``/health`` is 200; an error message if one exits or time runs out."""
    t0 = time.monotonic()
    pending = {w.index for w in workers}
    while pending:
        for w in workers:
            if w.index not in pending:
                continue
            if w.proc is not None and w.proc.poll() is not None:
                return f"worker {w.index} exited with code {w.proc.returncode} during start-up"
            try:
                if httpx.get(f"{w.url}/health", timeout=2.0).status_code == 200:
                    pending.discard(w.index)
                    logger.info("worker %d healthy after %.1f s: %s", w.index, time.monotonic() - t0, w.url)
            except httpx.HTTPError:
                pass
        if not pending:
            return None
        if time.monotonic() - t0 > timeout:
            return f"workers {sorted(pending)} not healthy after {timeout:.0f} s (--start-timeout-s)"
        if stop.wait(1.0):
            return "stopped by a signal during start-up"
    return None


def healthy_workers(gateway_url: str, timeout: float = 5.0) -> int:
    """Workers smg routes to now: those ``GET /workers`` lists with ``is_healthy`` (0 while it is not up)."""
    try:
        r = httpx.get(f"{gateway_url}/workers", timeout=timeout)
    except httpx.HTTPError:
        return 0
    if r.status_code != 200:
        return 0
    workers = r.json().get("workers", [])
    return sum(1 for w in workers if isinstance(w, dict) and w.get("is_healthy") is True)


def _announce_when_ready(url: str, n: int, stop: threading.Event, t0: float) -> None:
    while not stop.wait(1.0):
        if healthy_workers(url) >= n:
            logger.info("ready in %.1f s: gateway %s routing to %d workers", time.monotonic() - t0, url, n)
            return


def _stop(procs: list[subprocess.Popen], grace: float = SHUTDOWN_GRACE_S) -> None:
    """SIGTERM every live process, then SIGKILL those alive after ``grace`` seconds."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in live:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _fail(msg: str) -> int:
    print(f"dd_sglang.launch_router: error: {msg}", file=sys.stderr)
    return 2


def _workers(args, worker_argv: list[str]) -> list[Worker] | str:
    """The workers the router fronts (``--worker-urls``, else ``--workers`` it starts), or the
    error message for a bad flag: a worker flag the router assigns, flags with no worker to go to,
    ``--workers`` outside 1..64, a port outside 1..65535, taken or given twice, or a ``--policy``
    / ``--smg-arg`` smg's own parser refuses (its message is printed above ours)."""
    for flag in RESERVED_WORKER_FLAGS:
        if has_flag(worker_argv, flag):
            return f"worker flag {flag} is assigned by the router; drop it (see --help)"
    if args.worker_urls:
        if worker_argv:
            return f"--worker-urls starts no worker; these flags have nowhere to go: {worker_argv}"
        workers = [Worker(i, u.rstrip("/"), "") for i, u in enumerate(args.worker_urls)]
    else:
        if not 1 <= args.workers <= 64:
            return f"--workers must be in 1..64, got {args.workers}"
        workers = [
            Worker(
                i,
                f"http://{args.worker_host}:{args.worker_base_port + i}",
                f"http://{args.worker_host}:{args.metrics_base_port + i}",
            )
            for i in range(args.workers)
        ]
    from smg.launch_router import parse_router_args as smg_parse_args

    try:  # smg's own parser checks --policy and every --smg-arg before any worker starts
        smg_parse_args(smg_command(args, [w.url for w in workers])[3:])
    except SystemExit:
        return "smg refused its flags (its message is above): check --policy and --smg-arg"
    return _port_problem(args, workers) or workers


def _port_problem(args, workers: list[Worker]) -> str | None:
    """The first problem with the ports the router binds or gives its workers (out of
    1..65535, the same port twice, or taken), None when there is none."""
    ports = [("--port", args.host, args.port), ("--router-metrics-port", args.host, args.router_metrics_port)]
    if not args.worker_urls:
        for w in workers:
            ports.append((f"worker {w.index} port", args.worker_host, args.worker_base_port + w.index))
            ports.append(
                (f"worker {w.index} metrics port", args.worker_host, args.metrics_base_port + w.index)
            )
    seen: dict[int, str] = {}
    for name, host, port in ports:
        if not 1 <= port <= 65535:
            return f"{name} must be in 1..65535, got {port}"
        if port in seen:
            return f"{name} {port} is also {seen[port]}"
        seen[port] = name
        if err := port_error(host, port):
            return f"{name}: {err}"
    return None


def _start_workers(args, workers: list[Worker], worker_argv: list[str]) -> list[subprocess.Popen]:
    """Start one ``dd_sglang.launch_server`` per worker (none with ``--worker-urls``), each in its
    own process group, on its assigned API and metrics ports; their processes."""
    for w in workers if not args.worker_urls else []:
        cmd = [
            sys.executable, "-m", "dd_sglang.launch_server",
            "--host", args.worker_host, "--port", str(args.worker_base_port + w.index),
            "--metrics-host", args.worker_host, "--metrics-port", str(args.metrics_base_port + w.index),
            *worker_argv,
        ]  # fmt: skip
        logger.info("starting worker %d: %s", w.index, " ".join(cmd))
        w.proc = subprocess.Popen(cmd, start_new_session=True, preexec_fn=child_setup)
    return [w.proc for w in workers if w.proc is not None]


def _supervise(gateway: subprocess.Popen, workers: list[Worker], stop: threading.Event) -> int:
    """Wait for a signal (``stop``) or smg's exit (exit code 1); log each worker that exits on its
    own once (the gateway routes around it). Returns the exit code: 0 after a signal."""
    while not stop.wait(0.5):
        if gateway.poll() is not None:
            logger.error("smg exited with code %s; stopping the workers", gateway.returncode)
            return 1
        for w in workers:
            if w.proc is not None and w.proc.poll() is not None and not w.exited_logged:
                w.exited_logged = True
                logger.warning(
                    "worker %d (%s) exited with code %s; the gateway routes around it",
                    w.index, w.url, w.proc.returncode,
                )  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the router (module docstring); returns the exit code: 2 for a refused flag (before
    anything starts), 1 when a worker never became healthy or smg exited, 0 after a signal."""
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args, worker_argv = parse_router_args(list(sys.argv[1:] if argv is None else argv))
    workers = _workers(args, worker_argv)
    if isinstance(workers, str):
        return _fail(workers)

    stop = threading.Event()
    received: list[int] = []
    t_start = time.monotonic()

    def on_signal(signum, _frame):
        received.append(signum)
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    worker_procs = _start_workers(args, workers, worker_argv)
    if worker_procs:
        if err := _wait_healthy(workers, args.start_timeout_s, stop):
            logger.error("%s; stopping", err)
            _stop(worker_procs)
            return 0 if received else 1

    cmd = smg_command(args, [w.url for w in workers])
    logger.info("starting smg: %s", " ".join(cmd))
    gateway = subprocess.Popen(cmd, start_new_session=True, preexec_fn=child_setup)
    gateway_url = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{args.port}"
    threading.Thread(
        target=_announce_when_ready, args=(gateway_url, len(workers), stop, t_start), daemon=True
    ).start()
    rc = _supervise(gateway, workers, stop)
    if received:
        logger.info("signal %s: stopping smg and %d workers", received[0], len(worker_procs))
    _stop([gateway], grace=10.0)
    _stop(worker_procs)
    logger.info("stopped (exit code %s)", rc)
    return rc


if __name__ == "__main__":
    sys.exit(main())
