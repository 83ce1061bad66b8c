"""Observability under failure: the metrics sidecar killed and restarted, gauges that must not stay
stale, ``/stats`` behind the API key, and a real Prometheus scraping the dashboard's series."""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import time

import httpx
import psutil
import pytest
import yaml

from dd_sglang.metrics.catalog import dashboard_series
from harness.prompts import passkey_prompt
from harness.server import ROOT, free_port, scrape, wait_idle

from .geometry import API_KEY, Sampler

pytestmark = pytest.mark.server
DASHBOARD = ROOT / "docker" / "grafana" / "dashboards" / "dd_sglang.json"


def sidecar_pid(srv) -> int:
    """Pid of the launcher's metrics sidecar child process."""
    kids = [
        p for p in psutil.Process(srv.proc.pid).children()
        if "dd_sglang.metrics.sidecar" in " ".join(p.cmdline())
    ]  # fmt: skip
    assert len(kids) == 1, kids
    return kids[0].pid


def scrape_all(srv, timeout: float = 30.0) -> dict[str, float]:
    """Every ``dd_`` and ``sglang:`` sample of ``/metrics``, retried while the sidecar restarts."""
    t0 = time.monotonic()
    while True:
        try:
            return scrape(srv.metrics_url, ("dd_", "sglang:"))
        except httpx.HTTPError:
            assert time.monotonic() - t0 < timeout, "the sidecar did not come back"
            time.sleep(0.2)


def counters(samples: dict[str, float]) -> dict[str, float]:
    """The counter-like samples (``_total``, histogram ``_count``/``_sum``/``_bucket``)."""
    return {k: v for k, v in samples.items() if re.search(r"(_total|_count|_sum|_bucket)(\{|$)", k)}


def grown_by(after: dict, before: dict, name: str) -> float:
    """How much every sample of metric ``name`` (all label sets) grew, summed."""
    keys = {k for k in after if k == name or k.startswith(name + "{")}
    return sum(after[k] - before.get(k, 0.0) for k in keys)


def test_sidecar_killed_and_restarted(rel_server, tokenizer):
    """SIGKILL the sidecar: a request sent right then is served; the launcher starts a new sidecar on
    the same port; no counter went back (not reset), and the request's own counters grew by exactly
    its figures (not doubled); SGLang's latency histograms are still exported."""
    prompt = "Name the four seasons of the year."
    p = len(tokenizer.encode(prompt))
    wait_idle(rel_server)
    old = sidecar_pid(rel_server)
    before = scrape_all(rel_server)
    psutil.Process(old).send_signal(signal.SIGKILL)
    r = rel_server.post(
        "/v1/completions", {"model": "x", "prompt": prompt, "max_tokens": 6, "temperature": 0,
                            "custom_params": {"dd_selector": "spec_host"}},  # the selector that predicts
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"] == {**r.json()["usage"], "prompt_tokens": p, "completion_tokens": 6}
    wait_idle(rel_server)
    after = scrape_all(rel_server)
    assert sidecar_pid(rel_server) != old
    assert "metrics sidecar" in rel_server.log_path.read_text()
    went_back = {k: (v, after.get(k)) for k, v in counters(before).items() if after.get(k, -1.0) < v}
    assert not went_back, went_back
    assert grown_by(after, before, "sglang:prompt_tokens_total") == p
    assert grown_by(after, before, "sglang:generation_tokens_total") == 6
    assert grown_by(after, before, "sglang:e2e_request_latency_seconds_count") == 1
    assert grown_by(after, before, "sglang:time_to_first_token_seconds_count") == 1
    assert grown_by(after, before, 'dd_dualpath_transitions_total{from="DENSE",to="FINISHED"}') == 1
    assert grown_by(after, before, "dd_dualpath_transitions_total") == 1
    assert grown_by(after, before, "dd_sparse_decode_rows_total") == 0
    assert any(k.startswith("sglang:e2e_request_latency_seconds_bucket") for k in after)


def test_running_gauges_return_to_zero_within_2_s(rel_server, tokenizer):
    """While a sparse request streams 60 tokens, the gauges show it (sampled every 0.2 s; SGLang
    publishes its running-request gauge every 40 decode steps); 2 s after its last token every
    ``dd_dualpath_requests`` state and SGLang's running-request gauge are 0."""
    prompt, _ = passkey_prompt(tokenizer, 1200, 0.5, 24680, header="Gauge check. ")
    body = {
        "model": "x",
        "prompt": prompt,
        "max_tokens": 60,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with Sampler(rel_server, ("dd_", "sglang:")) as s:
        with httpx.stream("POST", f"{rel_server.url}/v1/completions", json=body, headers=rel_server.headers,
                          timeout=600) as resp:  # fmt: skip
            for _ in resp.iter_lines():
                pass
        t_end = time.monotonic()
    assert max(x.get('dd_dualpath_requests{state="DECODE_SPARSE"}', 0) for x in s.samples) == 1
    running = [v for x in s.samples for k, v in x.items() if k.startswith("sglang:num_running_reqs")]
    assert max(running) == 1
    while True:
        m = scrape_all(rel_server)
        states = [v for k, v in m.items() if k.startswith("dd_dualpath_requests{")]
        sg = [v for k, v in m.items() if k.startswith("sglang:num_running_reqs")]
        if len(states) == 6 and not any(states) and sg and not any(sg):
            break
        assert time.monotonic() - t_end < 2.0, f"stale gauges 2 s after the last token: {states} {sg}"
        time.sleep(0.05)


def test_stats_needs_the_api_key(rel_server):
    """SGLang's ``--api-key`` protects the sidecar's ``/stats``; ``/metrics`` and ``/healthz`` stay open."""
    url = rel_server.metrics_url
    assert httpx.get(f"{url}/stats", timeout=10).status_code == 401
    assert httpx.get(f"{url}/stats", headers={"Authorization": "Bearer nope"}, timeout=10).status_code == 401
    ok = httpx.get(f"{url}/stats", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10)
    assert ok.status_code == 200 and ok.json()["preset"] == "reliability"
    assert httpx.get(f"{url}/metrics", timeout=10).status_code == 200
    assert httpx.get(f"{url}/healthz", timeout=10).json() == {"status": "ok"}


@pytest.mark.skipif(
    shutil.which("prometheus") is None, reason="no prometheus binary (Debian: apt-get install prometheus)"
)
def test_prometheus_scrapes_every_dashboard_series(rel_server, tokenizer, tmp_path):
    """A real Prometheus with the compose file's scrape config (docker/prometheus.yml), its target
    pointed at the live sidecar, has samples for every ``dd_`` series the Grafana dashboard queries,
    after one sparse request (the prefetch, speculation and transfer series need one)."""
    prompt, _ = passkey_prompt(tokenizer, 1200, 0.5, 13579, header="Prometheus check. ")
    r = rel_server.post(
        "/v1/completions", {"model": "x", "prompt": prompt, "max_tokens": 6, "temperature": 0,
                            "custom_params": {"dd_selector": "spec_host"}},  # the selector that predicts
    )
    assert r.status_code == 200, r.text
    config = yaml.safe_load((ROOT / "docker" / "prometheus.yml").read_text())
    job = config["scrape_configs"][0]
    job["static_configs"][0]["targets"] = [rel_server.metrics_url.removeprefix("http://")]  # labels kept
    config["global"]["scrape_interval"] = "1s"  # the compose file's 5 s, shortened for the test
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    proc = subprocess.Popen(
        ["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "w"),
    )  # fmt: skip
    api = f"http://127.0.0.1:{port}/api/v1"
    missing = dashboard_series(DASHBOARD)
    try:
        t0 = time.monotonic()
        while missing and time.monotonic() - t0 < 60:
            time.sleep(1.0)
            for name in sorted(missing):
                try:
                    res = httpx.get(f"{api}/query", params={"query": name}, timeout=5).json()
                except httpx.HTTPError:
                    break  # Prometheus still starting
                if res["status"] == "success" and res["data"]["result"]:
                    missing.discard(name)
        targets = httpx.get(f"{api}/targets", timeout=5).json()["data"]["activeTargets"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert [t["health"] for t in targets] == ["up"], targets
    assert targets[0]["labels"]["job"] == job["job_name"]
    assert not missing, (
        f"no samples in Prometheus for {sorted(missing)}:\n{(tmp_path / 'prometheus.log').read_text()[-2000:]}"
    )
