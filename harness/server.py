"""Start and stop a real ``python -m dd_sglang.launch_server`` for tests and benchmarks."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent


#: Lowest port :func:`free_port` draws from; it draws below the kernel's ephemeral range.
PORT_FLOOR = 20000

#: Ports SGLang draws its own ``nccl_port`` from when ``--nccl-port`` is not given
#: (``get_free_port_below_ephemeral(low=22000, high=29999)`` in ``sglang/srt/utils/network.py``,
#: called by ``PortArgs.init_new`` in ``sglang/srt/server_args.py``). :func:`free_port` skips them:
#: one server's scheduler binds that port only after its start-up, and a port handed to another
#: server meanwhile was taken under that server's HTTP listener (a CI run: "[Errno 98] ... address
#: already in use", then 600 s until the launcher gave up). ``tests/test_patch_symbols.py`` checks
#: these defaults against the pinned SGLang.
SGLANG_NCCL_PORTS = range(22000, 30000)

#: How often :meth:`ServerProcess.wait_ready` relaunches on fresh ports after the HTTP port was
#: taken during start-up.
PORT_RETRIES = 2

#: What SGLang's uvicorn logs when its HTTP port was taken; SGLang then hangs in shutdown.
_BIND_FAILED = "error while attempting to bind on address"


def _ephemeral_low() -> int:
    """First port of the kernel's ephemeral range (``ip_local_port_range``; 32768 if unreadable)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1, drawn at random below the ephemeral range.

    A port the kernel handed out for ``bind(0)`` lies in the ephemeral range, which it also uses for
    the local side of outgoing connections: between this call and the server's own bind, a client
    connection (SGLang's start-up makes many) could take it ("Address already in use", seen in a
    full test run). Ports below that range are never assigned to outgoing connections, and ports in
    :data:`SGLANG_NCCL_PORTS` are left to SGLang's own draws. Falls back to ``bind(0)`` after 200
    taken draws.
    """
    hi = _ephemeral_low()
    ports = [p for p in range(PORT_FLOOR, hi) if p not in SGLANG_NCCL_PORTS]
    rng = random.SystemRandom()
    for _ in range(200 if len(ports) > 100 else 0):
        port = rng.choice(ports)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    """A launched dd_sglang server. Times in seconds, memory in bytes.

    ``start_seconds`` is the wall time from spawning the launcher until the
    sidecar's ``/healthz`` first answered 200 (SGLang warmed up and serving).
    ``peak_rss_bytes`` is the largest sum of RSS over the launcher's process
    tree seen by a 0.5 s sampler.
    """

    url: str
    metrics_url: str
    proc: subprocess.Popen
    log_path: Path
    max_total_tokens: int
    api_key: str | None = None
    start_seconds: float = 0.0
    #: The model and KV dtype SGLang resolved (``/server_info``), e.g. ``"float32"``.
    dtype: str = "bfloat16"
    peak_rss_bytes: int = 0
    _stop_sampler: threading.Event = field(default_factory=threading.Event)
    _launched: float = 0.0
    #: The launcher's arguments after ``--port P --metrics-port M``, and its extra environment.
    _args: list[str] = field(default_factory=list)
    _env: dict[str, str] | None = None
    #: Relaunches made after the HTTP port was taken during start-up (at most :data:`PORT_RETRIES`).
    relaunches: int = 0
    #: The checkout the launcher runs from (its ``dd_sglang`` is imported: ``python -m`` puts the
    #: working folder first on ``sys.path``); default this one.
    _cwd: Path = ROOT

    @property
    def env(self) -> dict[str, str]:
        """The variables added to the launcher's environment (``launch_server``'s ``env``)."""
        return dict(self._env or {})

    def _spawn(self) -> None:
        """Start the launcher on two fresh ports (:func:`free_port`), logging to :attr:`log_path`."""
        port, mport = free_port(), free_port()
        cmd = [sys.executable, "-m", "dd_sglang.launch_server",
               "--port", str(port), "--metrics-port", str(mport), *self._args]  # fmt: skip
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, cwd=self._cwd, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, **self._env} if self._env else None)  # fmt: skip
        self.url, self.metrics_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{mport}"
        self._launched = time.monotonic()

    def _port_taken(self) -> bool:
        try:
            return _BIND_FAILED in self.log_path.read_text(errors="replace")
        except OSError:
            return False

    def wait_ready(self, timeout: float = 600.0) -> ServerProcess:
        """Wait until the sidecar's ``/healthz`` is 200 (counted from the launch), then read the
        dtype SGLang resolved; returns ``self``.

        If SGLang's HTTP port was taken by another process between :func:`free_port` and SGLang's
        bind (its log says so), the launcher is stopped and started again on fresh ports, up to
        :data:`PORT_RETRIES` times; :attr:`url` and :attr:`metrics_url` then name the new ports.

        Raises:
            RuntimeError: the launcher exited, or was not healthy ``timeout`` s after its launch
                (it is then stopped; the message carries the log tail).
        """
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during start-up:\n{self.log_tail()}")
            if self._port_taken():
                tail = self.log_tail()
                self.stop()
                if self.relaunches >= PORT_RETRIES:
                    raise RuntimeError(f"server's port taken {self.relaunches + 1} times during start-up:\n{tail}")
                self.relaunches += 1
                self._stop_sampler = threading.Event()
                self._spawn()
                threading.Thread(target=self._sample, daemon=True).start()
                continue
            try:
                if httpx.get(f"{self.metrics_url}/healthz", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - self._launched > timeout:
                self.stop()
                raise RuntimeError(f"server not healthy after {timeout} s:\n{self.log_tail()}")
            time.sleep(0.5)
        if not self.start_seconds:
            self.start_seconds = time.monotonic() - self._launched
            info = httpx.get(f"{self.url}/server_info", headers=self.headers, timeout=30).json()
            dtype = info.get("dtype", "auto")
            if dtype == "auto":  # the checkpoint's dtype
                cfg = json.loads((Path(info["model_path"]) / "config.json").read_text())
                dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
            self.dtype = str(dtype).replace("torch.", "")
        return self

    @property
    def headers(self) -> dict[str, str]:
        """``Authorization: Bearer <api_key>`` when the server was started with ``--api-key``, else none."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def post(self, path: str, payload, timeout: float = 600.0) -> httpx.Response:
        """POST ``payload`` (JSON) to the SGLang API at ``path``, with the API key if any."""
        return httpx.post(f"{self.url}{path}", json=payload, headers=self.headers, timeout=timeout)

    @property
    def kv_itemsize(self) -> int:
        """Bytes of one KV element (the KV cache follows the model dtype here)."""
        return {"float32": 4, "bfloat16": 2, "float16": 2, "half": 2}[self.dtype]

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def family(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def _sample(self) -> None:
        while not self._stop_sampler.wait(0.5):
            total = 0
            for p in self.family():
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
            self.peak_rss_bytes = max(self.peak_rss_bytes, total)

    def stop(self, timeout: float = 60.0) -> tuple[int, list[int]]:
        """SIGTERM the launcher; return (exit code, pids of its tree still alive 1 s later)."""
        family = [p.pid for p in self.family()]
        self._stop_sampler.set()
        return terminate(self.proc, family, timeout)


def terminate(proc: subprocess.Popen, family: list[int], timeout: float) -> tuple[int, list[int]]:
    """SIGTERM ``proc`` and wait up to ``timeout`` s (then SIGKILL: exit code -9); return its exit
    code and the pids of ``family`` (its process tree, listed before the signal) still alive, not
    zombies, 1 s later."""
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = -9
    time.sleep(1.0)
    alive = []
    for pid in family:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return rc, alive


_RANK_LABEL = re.compile(r'dp_rank="[^"]*",?')


def scrape(metrics_url: str, prefix: str | tuple[str, ...] = "dd_", by_rank: bool = False) -> dict[str, float]:
    """The sidecar's ``/metrics`` samples whose name starts with ``prefix`` (or one of several),
    keyed by name with labels.

    The sidecar labels every ``dd_`` sample with its data-parallel rank (``dp_rank``). Unless
    ``by_rank``, that label is dropped and the ranks' samples are combined into the server's
    total: summed, or the max for ``_max`` gauges.
    """
    out: dict[str, float] = {}
    for line in httpx.get(f"{metrics_url}/metrics", timeout=10).text.splitlines():
        if not line.startswith(prefix) or line.startswith("#"):
            continue
        name, raw = line.rsplit(" ", 1)
        value = float(raw)
        if not by_rank and "dp_rank=" in name:
            name = _RANK_LABEL.sub("", name).replace(",}", "}").replace("{}", "")
            if name in out:
                value = max(out[name], value) if name.split("{")[0].endswith("_max") else out[name] + value
        out[name] = value
    return out


def transitions(samples: dict[str, float], src: str, dst: str) -> float:
    """``dd_dualpath_transitions_total{from=src,to=dst}`` in a :func:`scrape` result (0 when absent)."""
    return samples.get(f'dd_dualpath_transitions_total{{from="{src}",to="{dst}"}}', 0.0)


def delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    """How much sample ``name`` grew between two :func:`scrape` results (absent counts as 0)."""
    return after.get(name, 0.0) - before.get(name, 0.0)


def flush_when_idle(srv: ServerProcess, timeout: float = 120.0) -> dict[str, float]:
    """``/flush_cache`` once the server is idle (SGLang refuses while requests run); then the gauges.

    Raises:
        AssertionError: still refused after ``timeout`` seconds.
    """
    t0 = time.monotonic()
    while httpx.post(f"{srv.url}/flush_cache", headers=srv.headers, timeout=30).status_code != 200:
        assert time.monotonic() - t0 < timeout, "server never became idle"
        time.sleep(0.5)
    time.sleep(1.0)  # the idle hook republishes the gauges
    return scrape(srv.metrics_url)


def wait_idle(srv: ServerProcess, timeout: float = 120.0) -> dict[str, float]:
    """The gauges once no request is admitted (every ``dd_dualpath_requests`` state at 0).

    Raises:
        AssertionError: requests still admitted after ``timeout`` seconds.
    """
    t0 = time.monotonic()
    while True:
        m = scrape(srv.metrics_url)
        if all(v == 0 for k, v in m.items() if k.startswith("dd_dualpath_requests{")):
            time.sleep(1.0)
            return scrape(srv.metrics_url)
        assert time.monotonic() - t0 < timeout, "requests still admitted"
        time.sleep(0.5)


def launch_server(
    log_path: Path,
    max_total_tokens: int,
    extra_args: list[str] | None = None,
    api_key: str | None = None,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> ServerProcess:
    """Spawn dd_sglang on free loopback ports and return at once, not waiting for it to be ready.

    Call :meth:`ServerProcess.wait_ready` before using it (:func:`start_server` does both).
    Several servers launched before any is waited on start up side by side: SGLang's start-up
    (25-55 s here) is mostly single-threaded imports, so on 2 cores two of them take little
    longer than one. ``api_key`` adds SGLang's ``--api-key``; :attr:`ServerProcess.headers` then
    carries it. ``env``: variables added to this process's environment for the launcher (e.g.
    ``DD_SGLANG_CPU_PREPACK=0``). ``cwd``: another checkout of this project to run the launcher
    from (its code is served: :mod:`bench.decode_speed`'s ``--baseline-tree``); default this one.
    """
    args = ["--max-total-tokens", str(max_total_tokens), *(extra_args or []),
            *(["--api-key", api_key] if api_key else [])]  # fmt: skip
    srv = ServerProcess("", "", None, log_path, max_total_tokens, api_key, _args=args, _env=env, _cwd=cwd or ROOT)
    srv._spawn()
    threading.Thread(target=srv._sample, daemon=True).start()
    return srv


def start_server(
    log_path: Path,
    max_total_tokens: int,
    extra_args: list[str] | None = None,
    timeout: float = 600.0,
    api_key: str | None = None,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> ServerProcess:
    """Launch dd_sglang on free loopback ports and wait until ``/healthz`` is 200
    (:func:`launch_server`, then :meth:`ServerProcess.wait_ready`).

    Raises:
        RuntimeError: the launcher exited, or was not healthy within ``timeout`` s
            (the message carries the log tail).
    """
    return launch_server(log_path, max_total_tokens, extra_args, api_key, env, cwd).wait_ready(timeout)


#: The roles of a server's processes (:func:`role_of`).
ROLES = ("launcher", "tokenizer_manager", "scheduler", "detokenizer", "sidecar", "other")


def role_of(proc: psutil.Process, launcher_pid: int) -> str:
    """The role of one process of a server's tree, from its pid and command line (SGLang names its
    scheduler and detokenizer processes ``sglang::scheduler...`` / ``sglang::detokenizer``)."""
    if proc.pid == launcher_pid:
        return "launcher"
    try:
        cmd = " ".join(proc.cmdline())
    except psutil.Error:
        return "other"
    if "dd_sglang.metrics.sidecar" in cmd:
        return "sidecar"
    if "scheduler" in cmd:
        return "scheduler"
    if "detokenizer" in cmd:
        return "detokenizer"
    if "sglang.launch_server" in cmd:
        return "tokenizer_manager"  # SGLang's main process: HTTP server and tokenizer manager
    return "other"
