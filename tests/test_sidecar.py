"""The metrics sidecar app against a real prometheus-client multiprocess folder."""

from __future__ import annotations

import subprocess
import sys

import pytest
from fastapi.testclient import TestClient

from dd_sglang.metrics.sidecar import create_app

WRITER = """
from dd_sglang.metrics import definitions as m
m.DEVICE_KV_CAPACITY_BYTES.set(23040 * 100)
m.DEVICE_KV_USED_BYTES.set(23040 * 7)
m.DUALPATH_REQUESTS.labels(state="DENSE").set(2)
"""


def _write_metrics(tmp_path, n_processes: int):
    for _ in range(n_processes):  # each process writes its own file, as SGLang's ranks do
        subprocess.run(
            [sys.executable, "-c", WRITER],
            env={"PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PATH": ""},
            check=True,
        )


def test_metrics_and_stats_merge_processes(tmp_path):
    _write_metrics(tmp_path, 2)
    client = TestClient(create_app(sglang_url="http://127.0.0.1:9", multiproc_dir=str(tmp_path), preset="t"))
    text = client.get("/metrics").text
    # livesum across the two writer processes (neither registered a rank: data-parallel rank 0)
    assert 'dd_device_kv_capacity_bytes{dp_rank="0"} 4.608e+06' in text
    assert 'dd_dualpath_requests{dp_rank="0",state="DENSE"} 4.0' in text
    stats = client.get("/stats").json()
    assert stats["preset"] == "t"
    assert stats["metrics"]["dd_device_kv_used_bytes"] == [
        {"labels": {"dp_rank": "0"}, "value": 2 * 7 * 23040.0}
    ]


def test_healthz_503_when_sglang_unreachable(tmp_path):
    client = TestClient(
        create_app(sglang_url="http://127.0.0.1:9", multiproc_dir=str(tmp_path), health_timeout_s=1)
    )
    r = client.get("/healthz")
    assert r.status_code == 503
    assert r.json()["status"] == "unavailable"


def test_healthz_waits_sglangs_own_health_bound_plus_a_second():
    from dd_sglang.metrics.health import health_wait_s

    assert health_wait_s({}) == 21.0  # SGLang's default SGLANG_HEALTH_CHECK_TIMEOUT is 20
    assert health_wait_s({"SGLANG_HEALTH_CHECK_TIMEOUT": "45"}) == 46.0
    for bad in ("0", "-3", "1.5", "soon"):
        with pytest.raises(ValueError, match="SGLANG_HEALTH_CHECK_TIMEOUT must be a positive integer"):
            health_wait_s({"SGLANG_HEALTH_CHECK_TIMEOUT": bad})


def test_stats_needs_the_api_key_metrics_and_healthz_do_not(tmp_path):
    _write_metrics(tmp_path, 1)
    client = TestClient(
        create_app(sglang_url="http://127.0.0.1:9", multiproc_dir=str(tmp_path), health_timeout_s=1, api_key="s3")
    )
    assert client.get("/stats").status_code == 401
    assert client.get("/stats", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.get("/stats", headers={"Authorization": "Basic s3"}).status_code == 401
    ok = client.get("/stats", headers={"Authorization": "bearer s3"})
    assert ok.status_code == 200 and ok.json()["metrics"]["dd_device_kv_used_bytes"][0]["value"] == 7 * 23040
    assert 'dd_device_kv_capacity_bytes{dp_rank="0"} 2.304e+06' in client.get("/metrics").text
    assert client.get("/healthz").status_code == 503  # open (no 401): SGLang is just unreachable here


def _get_until_up(url: str, timeout: float = 60.0):
    import time

    import httpx

    t0 = time.monotonic()
    while True:
        try:
            return httpx.get(url, timeout=5)
        except httpx.HTTPError:
            assert time.monotonic() - t0 < timeout, f"{url} never answered"
            time.sleep(0.2)


def test_launcher_restarts_a_killed_sidecar_on_the_same_socket(tmp_path):
    """The launcher's Sidecar child serves the launcher's socket; killed, a new one serves the same
    port and reads the same counters (nothing reset: the figures live in the multiprocess folder)."""
    import signal
    import time

    from dd_sglang.launch_server import SIDECAR_RESTART_MIN_S, Sidecar, _bind

    _write_metrics(tmp_path, 1)
    sock = _bind("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    sc = Sidecar(sock, sglang_url="http://127.0.0.1:9", multiproc_dir=str(tmp_path), preset="t",
                 api_key="k")  # fmt: skip
    sc.start()
    try:
        assert 'dd_device_kv_used_bytes{dp_rank="0"} 161280.0' in _get_until_up(f"{url}/metrics").text
        assert _get_until_up(f"{url}/stats").status_code == 401
        first = sc.proc.pid
        sc.proc.send_signal(signal.SIGKILL)
        sc.proc.wait()
        time.sleep(SIDECAR_RESTART_MIN_S)
        sc.restart_if_dead()
        assert sc.restarts == 1 and sc.proc.pid != first
        assert 'dd_device_kv_used_bytes{dp_rank="0"} 161280.0' in _get_until_up(f"{url}/metrics").text
        sc.restart_if_dead()  # alive: nothing happens
        assert sc.restarts == 1
    finally:
        sc.stop()
        sock.close()
    assert sc.proc.poll() is not None
