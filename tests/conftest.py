"""Shared fixtures: the session's real servers (``python -m dd_sglang.launch_server``).

A server start-up takes 25-55 s on 2 cores, mostly single-threaded imports, and a graceful
stop ~8 s, mostly SGLang's 5 s shutdown poll (``tokenizer_manager.py: sigterm_watchdog``).
The suite hides both:

* **Booted ahead.** Fixtures that own a server register how to launch it
  (:func:`tests.servers.boots`; the registry and the stops live in ``tests/servers.py``, one
  module for every conftest). Before the first test, every registered server that a selected test uses
  is launched at once (:func:`_boot`) and starts up side by side with the others and with the
  server-free tests, which run first (:func:`pytest_collection_modifyitems`). Its fixture then
  only waits for it to be healthy (:func:`tests.servers.serve`).
* **Stopped behind.** At its fixture's teardown a server gets SIGTERM and is waited for in a
  background thread; its checks (exit 0, no process left, SGLang's temporary folder removed,
  no crash or ``Traceback`` logged) are asserted at the end of the session, naming the server.

``pytest tests/test_config.py`` starts no server: only the fixtures of selected tests boot.

**OpenMP threads sleep when idle** (``OMP_WAIT_POLICY=PASSIVE``, unless the environment sets it):
set here, before anything imports PyTorch, so this process and every server it launches inherit it.
By default PyTorch's OpenMP threads spin for a while after each parallel region; with several
servers and this process on two cores that spinning takes the cores from the ones with work. Measured
on the 2-core AMD EPYC host (2026-12-05): the server-free modules 78.8 -> 68.8 s (99 -> 84 CPU
seconds), the capacity, exactness and combination tests of the ``dualdecoder`` package with their two
servers 283 -> 268 s (523 -> 457 CPU seconds). It changes no result: the suite asserts tokens and
counts, which the wait policy does not touch; the benchmarks (``bench/``) keep the default.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before PyTorch's first import (docstring)

from pathlib import Path

import pytest

from harness.server import ServerProcess, launch_server
from tests.lanes import LANE_1_NICE, make_lane_scheduling, on_this_worker, shared_servers, this_worker
from tests.servers import LAUNCHERS, booted, boots, serve, stop_and_check, stop_behind, stopping

#: KV pool cap of the test server, in tokens (small: the suite runs on 2 cores / 24 GB).
TEST_MAX_TOTAL_TOKENS = 12288


def _uses_booted(item: pytest.Item) -> bool:
    return any(name in LAUNCHERS for name in getattr(item, "fixturenames", ()))


def pytest_collection_modifyitems(session, config, items):
    """Run modules in three groups, each in collection order: server-free modules (while the
    booted servers start up), then modules using a booted server, then modules marked ``server``
    that start servers of their own (the router's workers, the launcher watchdog), so those
    never start up beside the booted ones."""
    group: dict[Path, int] = {}
    for it in items:
        g = 1 if _uses_booted(it) else 2 if it.get_closest_marker("server") else 0
        group[it.path] = max(group.get(it.path, 0), g)
    items.sort(key=lambda it: group[it.path])  # stable: collection order within a group
    workers = this_worker()[1]
    uses = [(it.nodeid, getattr(it, "fixturenames", ())) for it in items]
    if shared := shared_servers(uses, list(LAUNCHERS), workers):
        raise pytest.UsageError(f"servers used on more than one lane of tests/lanes.py (move the tests): {shared}")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist, each worker runs one lane of tests with its own servers (``tests/lanes.py``)."""
    return make_lane_scheduling(config, log)


def pytest_sessionstart(session):
    """Lane 1's worker (and every process it starts) runs at a lower CPU priority (``tests/lanes.py``:
    :data:`~tests.lanes.LANE_1_NICE`): lane 0 is the longer one, its servers' tests the suite's tail."""
    index, count = this_worker()
    if index == 1 and count >= 2 and LANE_1_NICE:
        os.nice(LANE_1_NICE)


@pytest.fixture(scope="session", autouse=True)
def _boot(request, tmp_path_factory):
    """Launch every registered server a selected test of this worker's lane uses (module docstring,
    ``tests/lanes.py``); at the end of the session, wait for every stop and assert its checks."""
    mine = [it for it in request.session.items if on_this_worker(it.nodeid)]
    needed = {n for it in mine for n in getattr(it, "fixturenames", ()) if n in LAUNCHERS}
    if needed:
        tok = request.getfixturevalue("tokenizer")
        for name in sorted(needed):
            booted[name] = LAUNCHERS[name](tmp_path_factory, tok)
    yield
    for name, srv in booted.items():  # launched for a test that was then deselected or skipped
        stop_behind(name, lambda srv=srv: stop_and_check(srv, False))
    failures = [f"{name}: {err}" for name, fut in stopping if (err := fut.result())]
    booted.clear()
    stopping.clear()
    assert not failures, "\n\n".join(failures)


@pytest.fixture(scope="session")
def model_path() -> Path:
    """The converted embedded model (``make test`` prepares it before pytest starts)."""
    from dd_sglang.models.smollm2 import prepare_model

    return prepare_model(progress=False)


@pytest.fixture(scope="session")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@boots("server")
def _launch_dense(tmp_path_factory, tokenizer) -> ServerProcess:
    return launch_server(tmp_path_factory.mktemp("server") / "server.log", TEST_MAX_TOTAL_TOKENS)


@pytest.fixture(scope="session")
def server(tmp_path_factory, tokenizer) -> ServerProcess:
    """A real dd_sglang server (SGLang's dense decode) on free loopback ports, for the session.

    Its stop (SIGTERM to the launcher) must exit 0 and leave no process it started (SGLang's
    HTTP server, scheduler, detokenizer); SGLang's own error traces are allowed in its log
    (some tests send it hostile requests).
    """
    yield from serve("server", tmp_path_factory, tokenizer, no_traceback=False)
