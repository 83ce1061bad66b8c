"""Start and stop ``python -m dd_sglang.launch_router`` (N workers behind smg) for tests and benchmarks."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from dd_sglang.launch_router import healthy_workers
from harness.server import ROOT, free_port, scrape, terminate

#: SGLang's counter of finished requests (tokenizer manager), read from each worker's sidecar.
REQUESTS_SERIES = "sglang:num_requests_total"


def free_port_run(n: int, attempts: int = 50) -> int:
    """First of ``n`` consecutive free loopback ports.

    Raises:
        RuntimeError: none found in ``attempts`` tries.
    """
    for _ in range(attempts):
        base = free_port()
        if base + n > 65535:
            continue
        ok = True
        for p in range(base, base + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError(f"no {n} consecutive free ports found")


@dataclass
class Gateway:
    """A running launch_router: the gateway ``url``, each worker's API and sidecar URLs."""

    url: str
    worker_urls: list[str]
    metrics_urls: list[str]
    proc: subprocess.Popen
    log_path: Path
    start_seconds: float = 0.0
    launched_at: float = 0.0  # time.monotonic() at the launch

    def wait_ready(self, timeout: float = 900.0) -> Gateway:
        """Wait until the gateway routes to every worker (``/workers`` lists them all healthy);
        sets :attr:`start_seconds` (from the launch).

        Raises:
            RuntimeError: the router exited, or was not ready ``timeout`` s after its launch (the
                router is then stopped; the message carries the log tail).
        """
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"router exited with {self.proc.returncode} during start-up:\n{self.log_tail()}"
                )
            if healthy_workers(self.url) >= len(self.worker_urls):
                break
            if time.monotonic() - self.launched_at > timeout:
                self.stop()
                raise RuntimeError(f"gateway not ready after {timeout} s:\n{self.log_tail()}")
            time.sleep(1.0)
        self.start_seconds = time.monotonic() - self.launched_at
        return self

    def log_tail(self, n: int = 80) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def requests_served(self) -> list[float]:
        """Finished requests per worker (SGLang's counter); -1 for a worker that does not answer."""
        out = []
        for m in self.metrics_urls:
            try:
                out.append(sum(scrape(m, prefix=REQUESTS_SERIES).values()))
            except httpx.HTTPError:
                out.append(-1.0)
        return out

    def worker_launcher(self, i: int) -> psutil.Process:
        """Worker ``i``'s ``dd_sglang.launch_server`` process."""
        port = self.worker_urls[i].rsplit(":", 1)[1]
        for p in psutil.Process(self.proc.pid).children():
            cmd = p.cmdline()
            if "dd_sglang.launch_server" in cmd and port in cmd:
                return p
        raise LookupError(f"worker {i} not found")

    def kill_worker(self, i: int) -> None:
        """SIGKILL worker ``i``'s SGLang (its whole process group), as a crash would; its launcher then exits."""
        for p in self.worker_launcher(i).children():
            if "sglang.launch_server" in " ".join(p.cmdline()):
                import os

                os.killpg(p.pid, signal.SIGKILL)
                return
        raise LookupError(f"worker {i}'s SGLang not found")

    def stop(self, timeout: float = 120.0) -> tuple[int, list[int]]:
        """SIGTERM the router; return (exit code, pids of its tree still alive 1 s later)."""
        try:
            family = [self.proc.pid] + [p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            family = []
        return terminate(self.proc, family, timeout)


def served_by(gw: Gateway, before: list[float], timeout: float = 10.0) -> int:
    """Index of the one worker whose finished-request count grew since ``before``.

    Raises:
        AssertionError: none or several grew within ``timeout`` seconds.
    """
    t0 = time.monotonic()
    while True:
        now = gw.requests_served()
        grew = [i for i, (a, b) in enumerate(zip(now, before, strict=True)) if a > b]
        if len(grew) == 1:
            return grew[0]
        assert len(grew) < 2, f"several workers served: {before} -> {now}"
        assert time.monotonic() - t0 < timeout, f"no worker counted the request: {before} -> {now}"
        time.sleep(0.2)


def launch_gateway(
    log_path: Path,
    worker_args: list[str],
    workers: int = 2,
    policy: str = "cache_aware",
    worker_urls: list[str] | None = None,
) -> Gateway:
    """Launch ``dd_sglang.launch_router`` on free loopback ports and return at once, not waiting
    for it (:meth:`Gateway.wait_ready`; :func:`start_gateway` does both).

    With ``worker_urls`` no worker is started (the gateway routes to those).
    """
    port, rport = free_port(), free_port()
    cmd = [sys.executable, "-m", "dd_sglang.launch_router", "--port", str(port), "--router-metrics-port", str(rport),
           "--policy", policy]  # fmt: skip
    if worker_urls:
        cmd += ["--worker-urls", *worker_urls]
        metrics_urls: list[str] = []
    else:
        wbase, mbase = free_port_run(workers), free_port_run(workers)
        while set(range(wbase, wbase + workers)) & set(range(mbase, mbase + workers)):
            mbase = free_port_run(workers)
        cmd += [
            "--workers",
            str(workers),
            "--worker-base-port",
            str(wbase),
            "--metrics-base-port",
            str(mbase),
        ]
        worker_urls = [f"http://127.0.0.1:{wbase + i}" for i in range(workers)]
        metrics_urls = [f"http://127.0.0.1:{mbase + i}" for i in range(workers)]
        cmd += worker_args
    log = open(log_path, "w")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    return Gateway(f"http://127.0.0.1:{port}", worker_urls, metrics_urls, proc, log_path, launched_at=t0)


def start_gateway(
    log_path: Path,
    worker_args: list[str],
    workers: int = 2,
    policy: str = "cache_aware",
    worker_urls: list[str] | None = None,
    timeout: float = 900.0,
) -> Gateway:
    """Launch ``dd_sglang.launch_router`` on free loopback ports (:func:`launch_gateway`) and wait
    until the gateway routes to every worker (:meth:`Gateway.wait_ready`).

    Raises:
        RuntimeError: the router exited, or was not ready within ``timeout`` s (with the log tail).
    """
    return launch_gateway(log_path, worker_args, workers, policy, worker_urls).wait_ready(timeout)
