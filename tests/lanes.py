"""Two lanes of tests for two pytest-xdist workers (``make test`` runs ``pytest -n 2``).

The suite's wall time on 2 cores is set by its servers: while one test waits on a server, a
core is often idle (the scheduler's Python between parallel regions, the tests' HTTP clients).
Two workers, each driving its own servers, fill that idle time. A test may run on either lane only
if no test on the other lane touches its server: the capacity, no-leak and flush tests read a
server's device and host accounting as if they were its only clients, and bf16 greedy tokens
depend on which requests share a batch. So the split is static, by module, and each worker
boots (``tests/conftest.py``) only the servers its own lane's tests use:

* lane 0: the session's dense server, the ``dualdecoder`` package's server and every
  other server-free module (run while those two start up);
* lane 1 (:data:`LANE_1`): the reliability package's server, the router's workers, the
  launcher watchdog's SGLang, ``test_config.py``'s SGLang-importing launcher runs and eleven
  slower server-free modules (run while the reliability server starts up). Nothing on lane 1 uses
  the dense server.

:class:`LaneScheduling` (returned from ``pytest_xdist_make_scheduler`` in ``tests/conftest.py``)
sends each worker its lane's tests in collection order, all at once. With one worker, or without
xdist, there is one lane: every test, in collection order.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

#: Node-id prefixes (from the rootdir) of lane 1's tests; every other test is on lane 0.
LANE_1 = (
    "tests/reliability/",
    "tests/test_router_e2e.py",
    "tests/test_launcher_watchdog.py",
    "tests/test_config.py",
    # Server-free modules of 10-30 s each under load, moved from lane 0 (the suite's tail) to lane 1,
    # which ended about two minutes earlier (2026-12-06, AMD EPYC host, ``--durations``).
    "tests/test_bench_quality_units.py",
    "tests/test_models.py",
    "tests/test_gpu_check.py",
    # The two memory-growth modules (subprocesses that measure RSS, not time; 46 s and 20 s under
    # load): lane 0 was the tail by ~115 s of test time (2026-12-07, Intel AMX host, ``--durations=0``).
    "tests/test_platform_heap.py",
    "tests/test_platform_linear.py",
    # Server-free modules lane 0 ran while its two servers started, then waited ~37 s for them anyway;
    # lane 1 ended ~160 s before lane 0 (2026-12-07, AMD EPYC host, per-test start and end times).
    "tests/test_extend_attention.py",
    "tests/test_native_select.py",
    "tests/test_native_build.py",
    "tests/test_launch_router.py",
    "tests/test_sidecar.py",
    "tests/test_transfer_schedule.py",
)


#: Niceness added to lane 1's worker (``tests/conftest.py``: ``pytest_sessionstart``), which its
#: servers and subprocesses inherit; ``DD_TEST_LANE_1_NICE`` (0-19) overrides it. Lane 0 is the
#: suite's tail: on the 2-core AMD EPYC host (2026-12-05, ``make test`` alone, the servers' log
#: times) lane 1 ended 43 s before lane 0 at niceness 0 (630.6 s in all), 24 s before at 4 (612.1 s)
#: and with it at 10 (612.3 s): the two cores are then busy to the end (1,090 CPU s in 612 s).
def _lane_1_nice(raw: str) -> int:
    """``DD_TEST_LANE_1_NICE``'s value; raises ``ValueError`` naming it unless an integer in [0, 19]."""
    try:
        nice = int(raw)
    except ValueError:
        nice = -1
    if not 0 <= nice <= 19:
        raise ValueError(f"DD_TEST_LANE_1_NICE must be an integer in [0, 19], got {raw!r}")
    return nice


LANE_1_NICE = _lane_1_nice(os.environ.get("DD_TEST_LANE_1_NICE", "4"))


def lane_of(nodeid: str, workers: int) -> int:
    """The worker index (0-based) that runs test ``nodeid`` when ``workers`` workers run the suite:
    1 for :data:`LANE_1`'s tests when there are 2 or more, else 0 (a third worker gets nothing)."""
    return 1 if workers >= 2 and nodeid.startswith(LANE_1) else 0


def this_worker() -> tuple[int, int]:
    """``(index, count)`` of this pytest-xdist worker, from the ``PYTEST_XDIST_WORKER``
    (``"gw1"``) and ``PYTEST_XDIST_WORKER_COUNT`` environment variables xdist sets in each
    worker; ``(0, 1)`` in a run without workers."""
    name = os.environ.get("PYTEST_XDIST_WORKER")
    if not name:
        return 0, 1
    return int(name.removeprefix("gw")), int(os.environ["PYTEST_XDIST_WORKER_COUNT"])


def on_this_worker(nodeid: str) -> bool:
    """True when this process runs test ``nodeid`` (always, without xdist workers)."""
    index, count = this_worker()
    return lane_of(nodeid, count) == index


def make_lane_scheduling(config, log):
    """A pytest-xdist scheduler that runs each worker's lane (:func:`lane_of`), in collection order.

    Built on xdist's ``EachScheduling`` (every node collects every test; a node whose process
    dies is replaced with its remaining tests); only :meth:`schedule` differs: a node gets the
    indices of its own lane instead of all of them, then ``shutdown`` (it runs them and exits).
    Imported only under xdist (``tests/conftest.py``)."""
    from xdist.scheduler import EachScheduling

    class LaneScheduling(EachScheduling):
        def schedule(self) -> None:
            assert self.collection_is_completed
            for node, pending in self.node2pending.items():
                if node in self._started:
                    continue
                if not pending:  # a node of the first round, not a replacement
                    index = int(node.gateway.id.removeprefix("gw"))
                    pending[:] = lane_indices(self.node2collection[node], index, self.numnodes)
                    if pending:
                        node.send_runtest_some(list(pending))
                    node.shutdown()
                else:
                    node.send_runtest_some(pending)
                self._started.append(node)

    return LaneScheduling(config, log)


def lane_indices(collection: Sequence[str], index: int, workers: int) -> list[int]:
    """Positions in ``collection`` (node ids in collection order) of worker ``index``'s tests."""
    return [i for i, nodeid in enumerate(collection) if lane_of(nodeid, workers) == index]


def shared_servers(uses: Sequence[tuple[str, Sequence[str]]], servers: Sequence[str], workers: int) -> dict[str, list[int]]:
    """Server fixtures that tests on more than one lane use: ``{fixture name: sorted lanes}``.

    ``uses``: ``(node id, fixture names)`` per test; ``servers``: the fixture names that own a
    booted server. Each lane's worker would boot its own copy of such a server (one more SGLang,
    ~3 GB), so ``tests/conftest.py`` refuses to run them."""
    lanes: dict[str, set[int]] = {}
    for nodeid, names in uses:
        for name in names:
            if name in servers:
                lanes.setdefault(name, set()).add(lane_of(nodeid, workers))
    return {name: sorted(ls) for name, ls in lanes.items() if len(ls) > 1}
