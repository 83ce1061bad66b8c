"""The metrics sidecar app against a real prometheus-client multiprocess folder."""

from __future__ import annotations

import subprocess
import sys

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
    # livesum across the two writer processes
    assert "dd_device_kv_capacity_bytes 4.608e+06" in text
    assert 'dd_dualpath_requests{state="DENSE"} 4.0' in text
    stats = client.get("/stats").json()
    assert stats["preset"] == "t"
    assert stats["metrics"]["dd_device_kv_used_bytes"] == [{"labels": {}, "value": 2 * 7 * 23040.0}]


def test_healthz_503_when_sglang_unreachable(tmp_path):
    client = TestClient(
        create_app(sglang_url="http://127.0.0.1:9", multiproc_dir=str(tmp_path), health_timeout_s=1)
    )
    r = client.get("/healthz")
    assert r.status_code == 503
    assert r.json()["status"] == "unavailable"


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
    assert "dd_device_kv_capacity_bytes 2.304e+06" in client.get("/metrics").text
    assert client.get("/healthz").status_code == 503  # open (no 401): SGLang is just unreachable here
