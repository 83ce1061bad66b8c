"""``python -m dd_sglang.launch_router`` flag handling, and the launcher's CPU rank arithmetic (no server)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from dd_sglang.launch_router import SMG_DEFAULTS, parse_router_args, smg_command
from dd_sglang.launch_server import cpu_threads_bind, parallel_ranks
from harness.server import ROOT


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dd_sglang.launch_router", *args], cwd=ROOT, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip


def test_unknown_flags_go_to_every_worker():
    args, worker = parse_router_args(
        [
            "--workers",
            "3",
            "--policy",
            "round_robin",
            "--attention-backend",
            "dualdecoder",
            "--max-total-tokens",
            "8192",
        ]
    )
    assert (args.workers, args.policy) == (3, "round_robin")
    assert worker == ["--attention-backend", "dualdecoder", "--max-total-tokens", "8192"]


def test_smg_command_line():
    args, _ = parse_router_args(["--port", "31000", "--router-metrics-port", "31001", "--smg-arg=--cache-threshold",
                                 "--smg-arg=0.5", "--smg-arg=--health-check-interval-secs", "--smg-arg=2"])  # fmt: skip
    cmd = smg_command(args, ["http://127.0.0.1:30010", "http://127.0.0.1:30011"])
    assert cmd[:3] == [sys.executable, "-m", "smg.launch_router"]
    tail = cmd[3:]
    assert tail[tail.index("--worker-urls") + 1 : tail.index("--worker-urls") + 3] == [
        "http://127.0.0.1:30010", "http://127.0.0.1:30011",
    ]  # fmt: skip
    assert tail[tail.index("--policy") + 1] == "cache_aware"
    assert tail[tail.index("--port") + 1] == "31000"
    assert tail[tail.index("--prometheus-port") + 1] == "31001"
    # --smg-arg wins over the default it names, the other defaults stay.
    assert tail.count("--health-check-interval-secs") == 1
    assert tail[tail.index("--health-check-interval-secs") + 1] == "2"
    for flag, value in SMG_DEFAULTS:
        if flag != "--health-check-interval-secs":
            assert tail[tail.index(flag) + 1] == value
    assert tail[-4:] == ["--cache-threshold", "0.5", "--health-check-interval-secs", "2"]


def test_smg_accepts_the_command_line():
    """smg's own parser accepts every flag the router passes (no gateway is started)."""
    from smg.launch_router import parse_router_args as smg_parse

    args, _ = parse_router_args([])
    smg_args = smg_parse(smg_command(args, ["http://127.0.0.1:30010"])[3:])
    assert smg_args.policy == "cache_aware"
    assert smg_args.worker_urls == ["http://127.0.0.1:30010"]
    assert smg_args.health_check_interval_secs == 5


@pytest.mark.parametrize(("flag", "argv"), [("--metrics-port", ["--metrics-port", "1234"]),
                                            ("--metrics-host", ["--metrics-host=0.0.0.0"]),
                                            ("--port", ["--", "--port", "1234"])])  # fmt: skip
def test_worker_flags_the_router_assigns_are_refused(flag, argv):
    """``--port``/``--host`` before ``--`` are the gateway's; a worker's are refused."""
    r = _run(*argv)
    assert r.returncode == 2
    assert f"worker flag {flag} is assigned by the router" in r.stderr


def test_busy_port_is_refused_before_anything_starts():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        busy = s.getsockname()[1]
        r = _run("--workers", "2", "--worker-base-port", str(busy - 1), "--metrics-base-port", "1")
    assert r.returncode == 2
    assert "not available" in r.stderr or "must be in" in r.stderr


def test_bad_policy_is_refused_by_smgs_parser_before_workers_start():
    r = _run("--policy", "fastest", "--workers", "1")
    assert r.returncode == 2
    assert "invalid choice: 'fastest'" in r.stderr and "smg refused its flags" in r.stderr


def test_worker_urls_take_no_worker_flags():
    r = _run("--worker-urls", "http://127.0.0.1:30010", "--max-total-tokens", "8192")
    assert r.returncode == 2
    assert "--worker-urls starts no worker" in r.stderr


@pytest.mark.parametrize(
    ("argv", "n"),
    [
        ([], 1),
        (["--dp-size", "2"], 2),
        (["--tp", "3", "--dp-size=2"], 6),
        (["--pp-size", "2", "--tp-size", "2"], 4),
    ],
)
def test_parallel_ranks(argv, n):
    assert parallel_ranks(argv) == n


def test_parallel_ranks_rejects_bad_sizes():
    with pytest.raises(ValueError, match="--dp-size must be an integer >= 1, got '0'"):
        parallel_ranks(["--dp-size", "0"])


def test_cpu_threads_bind_splits_cores_per_rank():
    assert cpu_threads_bind(1, ["0,1"]) is None  # one rank per NUMA node: SGLang's default fits
    assert cpu_threads_bind(2, ["0,1", "2,3"]) is None
    assert cpu_threads_bind(2, ["0,1"]) == "0|1"
    assert cpu_threads_bind(2, ["0,1,2,3,4,5,6,7"]) == "0,1,2,3|4,5,6,7"
    assert cpu_threads_bind(3, ["0,1"]) == "0|0|1"  # more ranks than cores: cores are shared
    assert cpu_threads_bind(4, ["0,1", "2,3"]) == "0|1|2|3"
