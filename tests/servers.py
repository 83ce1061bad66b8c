"""The suite's servers, shared by every conftest: which fixtures launch one (:func:`boots`), the
servers launched ahead (:data:`booted`) and the background stops (:func:`stop_behind`).

A module of its own, imported as ``tests.servers`` everywhere: pytest loads ``tests/conftest.py``
under another module name than ``from tests.conftest import ...`` would, and two copies of this
state would not see each other's registrations or stops (the package servers were then neither
booted ahead nor their stops checked).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from dd_sglang.launch_server import TMP_DIR_PREFIX
from harness.server import ServerProcess

#: Seconds a server may take from its launch to healthy (a loaded 2-core machine: > 300 s).
START_TIMEOUT_S = 900

#: fixture name -> function(tmp_path_factory, tokenizer) that launches its server (not waiting).
LAUNCHERS: dict[str, Callable[[pytest.TempPathFactory, object], ServerProcess]] = {}
booted: dict[str, ServerProcess] = {}
stopping: list[tuple[str, Future]] = []
reaper = ThreadPoolExecutor(max_workers=4, thread_name_prefix="server-stop")


def boots(fixture_name: str):
    """Register ``fn(tmp_path_factory, tokenizer) -> ServerProcess`` (from
    :func:`harness.server.launch_server`) as the launch of the server that fixture
    ``fixture_name`` serves with :func:`serve`."""

    def register(fn):
        LAUNCHERS[fixture_name] = fn
        return fn

    return register


def stop_and_check(srv: ServerProcess, no_traceback: bool) -> str | None:
    """Stop ``srv``; None, or what went wrong with its log tail."""
    rc, alive = srv.stop()
    log = srv.log_path.read_text(errors="replace")
    if rc != 0 or alive:
        return f"launcher exit code {rc}, processes left {alive} after SIGTERM:\n{srv.log_tail()}"
    if "crashed with exit code" in log:
        return f"SGLang saw a crash during a normal stop:\n{srv.log_tail()}"
    if left := list(Path(tempfile.gettempdir()).glob(f"{TMP_DIR_PREFIX}{srv.proc.pid}_*")):
        return f"SGLang's temporary folder left behind: {left}"
    if no_traceback and "Traceback" in log:
        return f"a Traceback in the server log ({srv.log_path}):\n{srv.log_tail()}"
    return None


def stop_behind(name: str, stop: Callable[[], str | None]) -> None:
    """Run ``stop`` (a server's stop and checks: None, or what went wrong) in the background;
    its result is asserted at the end of the session, under ``name``."""
    stopping.append((name, reaper.submit(stop)))


def serve(name: str, tmp_path_factory, tokenizer, no_traceback: bool = True):
    """A fixture body for a booted server (:func:`boots`): wait until it is healthy (a failed
    start fails the test), yield it, then stop it in the background (``tests/conftest.py``). A
    server not booted ahead (its fixture was reached another way) is launched here.

    ``no_traceback``: also require that its log holds no ``Traceback`` at the stop.
    """
    srv = booted.pop(name, None) or LAUNCHERS[name](tmp_path_factory, tokenizer)
    try:
        srv.wait_ready(START_TIMEOUT_S)
    except RuntimeError as err:
        pytest.fail(f"{name}: {err}")
    yield srv
    stop_behind(name, lambda: stop_and_check(srv, no_traceback))
