"""The processes the launcher starts and stops: SGLang's process group and the metrics sidecar.

Both children get SIGTERM if the launcher dies (``PR_SET_PDEATHSIG``, :func:`child_setup`).
:func:`supervise` waits for a signal, SGLang's exit or the start-up timeout, restarting a dead
:class:`Sidecar` meanwhile (at most once per :data:`SIDECAR_RESTART_MIN_S` seconds); then
:func:`stop_group` stops SGLang's whole process group: SIGTERM to its main process, then to
the group, then SIGKILL, each after :data:`SHUTDOWN_GRACE_S` seconds at most. Folders left by
launchers that died without cleaning up go at the next start (:func:`clean_stale_dirs`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

logger = logging.getLogger("dd_sglang.launch_server")

SHUTDOWN_GRACE_S = 20.0
SIDECAR_RESTART_MIN_S = 1.0
PROM_DIR_PREFIX = "dd_sglang_prom_"
#: Prefix of SGLang's private temporary folder (its ``TMPDIR``): SGLang 0.5.23 leaves its ZMQ
#: sockets and port files (``tempfile`` names) behind in the system's temporary folder, six
#: entries a run; they go with this folder when SGLang stops.
TMP_DIR_PREFIX = "dd_sglang_tmp_"
_PR_SET_PDEATHSIG = 1


def child_setup() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def clean_stale_dirs() -> None:
    """Remove metrics and SGLang temporary folders left by launchers that died without cleaning
    up (e.g. SIGKILL)."""
    for prefix in (PROM_DIR_PREFIX, TMP_DIR_PREFIX):
        for d in Path(tempfile.gettempdir()).glob(f"{prefix}*"):
            try:
                pid = int(d.name[len(prefix) :].split("_", 1)[0])
            except ValueError:
                continue
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                shutil.rmtree(d, ignore_errors=True)
            except PermissionError:
                pass


def announce_when_ready(
    url: str, metrics_url: str, stop: threading.Event, ready: threading.Event, t0: float
):
    while not stop.wait(1.0):
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                ready.set()
                logger.info(
                    "ready in %.1f s: SGLang %s, metrics %s/metrics", time.monotonic() - t0, url, metrics_url
                )
                return
        except httpx.HTTPError:
            pass


def supervise(proc: subprocess.Popen, sidecar: Sidecar, stop: threading.Event, ready: threading.Event,
               t0: float, start_timeout: float, received: list[int]) -> int:  # fmt: skip
    """Wait for a signal (``stop``), SGLang's exit or the start-up timeout (seconds from ``t0``,
    monotonic), restarting a dead sidecar; then stop SGLang's process group. Returns the exit code."""
    timed_out = False
    while proc.poll() is None and not stop.wait(0.5):
        sidecar.restart_if_dead()
        if not ready.is_set() and time.monotonic() - t0 > start_timeout:
            timed_out = True
            logger.error(
                "SGLang not healthy after %.0f s (server.start_timeout_s); stopping it", start_timeout
            )
            break

    rc = proc.poll()
    if timed_out:
        stop.set()
        stop_group(proc)
        return 1
    if rc is None:
        logger.info(
            "signal %s: stopping SGLang (process group %d)", received[0] if received else "?", proc.pid
        )
        stop_group(proc)
        return 0
    stop.set()
    logger.error("SGLang exited with code %s", rc)
    stop_group(proc)  # reap anything its processes left behind
    if rc == 2 and not ready.is_set():
        # argparse's usage error: SGLang's own parser refused a flag (its message is above),
        # before any engine process started. A bad flag is exit code 2, as for dd's own.
        logger.error("SGLang refused its command line; nothing was started")
        return 2
    return 1  # SGLang died on its own (a crash, an OOM kill): one code, its own is in the log


class Sidecar:
    """The metrics sidecar child process (:mod:`dd_sglang.metrics.sidecar`), supervised.

    It serves on ``sock``, a listening socket this launcher bound and keeps open, so a
    restarted sidecar takes over the same port without a gap in which another process
    could bind it; connections made while it restarts wait in the socket's backlog.

    Args:
        sock: the listening metrics socket (handed to the child by file descriptor).
        sglang_url, multiproc_dir, preset: see
            :func:`dd_sglang.metrics.sidecar.create_app`.
        api_key: protects ``/stats``; passed through the environment, not the command line.
    """

    def __init__(
        self,
        sock: socket.socket,
        *,
        sglang_url: str,
        multiproc_dir: str,
        preset: str,
        api_key: str | None,
    ):
        from dd_sglang.metrics.sidecar import API_KEY_ENV

        self.sock = sock
        self.cmd = [
            sys.executable, "-m", "dd_sglang.metrics.sidecar", "--fd", str(sock.fileno()),
            "--sglang-url", sglang_url, "--multiproc-dir", multiproc_dir,
            "--preset", preset,
        ]  # fmt: skip
        self.env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
        if api_key:
            self.env[API_KEY_ENV] = api_key
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self._started_at = 0.0

    def start(self) -> None:
        self._started_at = time.monotonic()
        self.proc = subprocess.Popen(
            self.cmd,
            env=self.env,
            pass_fds=(self.sock.fileno(),),
            start_new_session=True,  # a terminal's Ctrl-C reaches the launcher, which stops it in order
            preexec_fn=child_setup,
        )

    def restart_if_dead(self) -> None:
        """Start a new sidecar if the current one exited (rate-limited)."""
        if self.proc is None or self.proc.poll() is None:
            return
        if time.monotonic() - self._started_at < SIDECAR_RESTART_MIN_S:
            return
        self.restarts += 1
        logger.warning(
            "metrics sidecar (pid %d) exited with code %s; restarting it (restart %d)",
            self.proc.pid, self.proc.returncode, self.restarts,
        )  # fmt: skip
        self.start()

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM the sidecar, SIGKILL it after ``timeout`` seconds."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


#: Seconds the rest of SGLang's process group gets once its main process has exited. A main
#: process that stopped normally has stopped its children already; one killed before its
#: signal handlers were installed (a stop during start-up) leaves them running.
ORPHAN_GRACE_S = 1.0


def _wait_group(proc: subprocess.Popen, seconds: float) -> bool:
    """Wait up to ``seconds`` for SGLang's whole process group to exit; True if it did. Gives up
    early, :data:`ORPHAN_GRACE_S` after SGLang's main process exited with the group still alive."""
    deadline = time.monotonic() + seconds
    exited = None
    while time.monotonic() < deadline:
        if not _group_alive(proc.pid):
            return True
        if proc.poll() is not None:
            exited = exited or time.monotonic()
            if time.monotonic() - exited > ORPHAN_GRACE_S:
                return False
        time.sleep(0.2)
    return False


def stop_group(proc: subprocess.Popen) -> None:
    """Stop SGLang: SIGTERM to its main process (which stops its own scheduler and
    detokenizer), then SIGTERM to the whole group, then SIGKILL, each after
    :data:`SHUTDOWN_GRACE_S` seconds at most."""
    pgid = proc.pid
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        if _wait_group(proc, SHUTDOWN_GRACE_S):
            return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        if _wait_group(proc, SHUTDOWN_GRACE_S):
            return
