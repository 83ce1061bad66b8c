"""The static split of the suite into two pytest-xdist lanes (``tests/lanes.py``)."""

from __future__ import annotations

import pytest

from tests.lanes import lane_indices, lane_of, shared_servers, this_worker

COLLECTION = [
    "tests/test_config.py::test_invalid_yaml",
    "tests/test_host_pool.py::test_alloc",
    "tests/reliability/test_rel_prefix_cache.py::test_flush_cache_right_after_a_request",
    "tests/dualdecoder/test_dualdecoder_e2e.py::test_capacity_8_concurrent_2k_requests",
    "tests/test_router_e2e.py::test_killing_a_worker_routes_new_sessions_to_the_other",
    "tests/test_server_e2e.py::test_streamed_chat_equals_unstreamed",
    "tests/test_launcher_watchdog.py::test_start_timeout_stops_sglang_and_exits_1",
]


def test_two_workers_split_by_module_in_collection_order():
    assert lane_indices(COLLECTION, 0, 2) == [1, 3, 5]
    assert lane_indices(COLLECTION, 1, 2) == [0, 2, 4, 6]
    # A third worker gets nothing; one worker (or none) runs everything.
    assert lane_indices(COLLECTION, 2, 3) == []
    assert lane_indices(COLLECTION, 0, 1) == list(range(7))
    assert lane_of("tests/reliability_extra.py::t", 2) == 0  # a prefix of a folder, not a word


def test_a_server_used_on_both_lanes_is_named():
    uses = [
        (COLLECTION[2], ("rel_server", "tokenizer")),
        (COLLECTION[3], ("dd_server", "server", "tokenizer")),
        (COLLECTION[5], ("server",)),
    ]
    servers = ["server", "dd_server", "rel_server"]
    assert shared_servers(uses, servers, 2) == {}
    uses.append((COLLECTION[2], ("server",)))
    assert shared_servers(uses, servers, 2) == {"server": [0, 1]}
    assert shared_servers(uses, servers, 1) == {}  # one lane: nothing is shared


def test_this_worker_reads_xdist_environment(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    assert this_worker() == (0, 1)
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    assert this_worker() == (1, 2)


def test_lane_1_niceness_is_checked():
    from tests.lanes import _lane_1_nice

    assert _lane_1_nice("0") == 0 and _lane_1_nice("19") == 19
    for bad in ("20", "-1", "high", ""):
        with pytest.raises(ValueError, match=r"DD_TEST_LANE_1_NICE must be an integer in \[0, 19\]"):
            _lane_1_nice(bad)
