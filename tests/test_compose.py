"""docker/: the compose files, Prometheus configs and the dashboard agree on services, ports and labels.

Docker cannot run on the development machines, so these files are checked
by parsing them: every Prometheus target is a compose service serving
metrics on that port (worker sidecars: the preset's ``metrics.port`` unless
the service's command sets ``--metrics-port``; the gateway: its
``--router-metrics-port``), the gateway routes to every worker on its API
port, every worker is scraped under its own ``worker`` label, and every
dashboard query is per worker.
"""

from __future__ import annotations

import json
import re
import shlex

import pytest
import yaml

from dd_sglang.config import load_config
from dd_sglang.launch_router import parse_router_args
from dd_sglang.launch_server import flag_value
from harness.server import ROOT

DOCKER = ROOT / "docker"
COMPOSE_FILES = ["compose.yaml", "compose.scale.yaml"]
PRESET = load_config(None)


def _compose(name: str) -> dict:
    return yaml.safe_load((DOCKER / name).read_text())


def _entrypoint() -> list[str]:
    line = next(x for x in (DOCKER / "Dockerfile").read_text().splitlines() if x.startswith("ENTRYPOINT"))
    return json.loads(line.split(None, 1)[1])


def _argv(svc: dict, key: str) -> list[str]:
    v = svc.get(key) or []
    return shlex.split(v) if isinstance(v, str) else [str(x) for x in v]


def _workers(compose: dict) -> dict[str, dict]:
    """Services that run the image's entrypoint (dd_sglang.launch_server): name -> service."""
    return {n: s for n, s in compose["services"].items() if ("build" in s or s.get("image") == "dd_sglang:local")
            and "entrypoint" not in s}  # fmt: skip


def _worker_ports(svc: dict) -> tuple[int, int]:
    """(API port, metrics port) of a worker service: its command's flags, else the preset's."""
    argv = _entrypoint() + _argv(svc, "command")
    return (int(flag_value(argv, "--port") or PRESET.server.port),
            int(flag_value(argv, "--metrics-port") or PRESET.metrics.port))  # fmt: skip


def _prometheus(compose: dict) -> dict:
    vol = next(
        v for v in compose["services"]["prometheus"]["volumes"] if "/etc/prometheus/prometheus.yml" in v
    )
    return yaml.safe_load((DOCKER / vol.split(":")[0]).read_text())


def _targets(prom: dict, job: str) -> list[tuple[str, int, dict]]:
    out = []
    for sc in prom["scrape_configs"]:
        if sc["job_name"] != job:
            continue
        for static in sc["static_configs"]:
            for t in static["targets"]:
                host, port = t.rsplit(":", 1)
                out.append((host, int(port), static.get("labels", {})))
    return out


def test_image_serves_api_and_metrics_on_every_interface():
    ep = _entrypoint()
    assert "dd_sglang.launch_server" in ep
    assert flag_value(ep, "--host") == "0.0.0.0" and flag_value(ep, "--metrics-host") == "0.0.0.0"


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_prometheus_scrapes_every_worker_sidecar_under_its_own_label(name):
    compose = _compose(name)
    workers = _workers(compose)
    assert workers, "no worker service"
    targets = _targets(_prometheus(compose), "dd_sglang")
    assert sorted(h for h, _, _ in targets) == sorted(workers), "every worker scraped exactly once"
    for host, port, labels in targets:
        assert port == _worker_ports(workers[host])[1], (host, port)
        assert labels.get("worker") == host
        assert f"127.0.0.1:{port}:{port}" in workers[host].get("ports", [f"127.0.0.1:{port}:{port}"])


def test_scale_gateway_routes_to_every_worker_and_is_scraped():
    compose = _compose("compose.scale.yaml")
    workers = _workers(compose)
    assert len(workers) >= 2
    gw = compose["services"]["gateway"]
    argv = _argv(gw, "entrypoint")
    assert argv[:3] == [".venv/bin/python", "-m", "dd_sglang.launch_router"]
    args, rest = parse_router_args(argv[3:])
    assert rest == [], f"flags the router would refuse with --worker-urls: {rest}"
    assert args.policy == "cache_aware" and args.host == "0.0.0.0"
    urls = [re.fullmatch(r"http://([\w-]+):(\d+)", u).groups() for u in args.worker_urls]
    assert sorted(h for h, _ in urls) == sorted(workers)
    for host, port in urls:
        assert int(port) == _worker_ports(workers[host])[0], (host, port)
    assert set(gw["depends_on"]) == set(workers)
    assert all(dep["condition"] == "service_healthy" for dep in gw["depends_on"].values())
    assert all("healthcheck" in w for w in workers.values())
    assert f"127.0.0.1:{args.port}:{args.port}" in gw["ports"]
    assert f"127.0.0.1:{args.router_metrics_port}:{args.router_metrics_port}" in gw["ports"]
    smg = _targets(_prometheus(compose), "smg")
    assert [(h, p) for h, p, _ in smg] == [("gateway", args.router_metrics_port)]


DASHBOARD = json.loads((DOCKER / "grafana" / "dashboards" / "dd_sglang.json").read_text())


def _queries() -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in DASHBOARD["panels"] for t in p.get("targets", [])]


def test_dashboard_queries_are_per_worker():
    assert [v["name"] for v in DASHBOARD["templating"]["list"]] == ["worker"]
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
    for title, expr in _queries():
        selectors = re.findall(r"((?:dd_|sglang:)[a-z_:]+)\{([^}]*)\}", expr)
        names = re.findall(r"(?:dd_|sglang:)[a-z_:]+", expr)
        assert len(selectors) == len(names), f"{title}: a series without a worker selector: {expr}"
        assert all('worker=~"$worker"' in sel for _, sel in selectors), (title, expr)
        assert expr.count("sum by (worker") == len(names), (title, expr)


def test_dashboard_has_per_rank_panels():
    by_rank = [t for t, e in _queries() if "dp_rank" in e]
    assert {"Host tier used per worker and DP rank", "Admitted requests per worker and DP rank"} <= set(
        by_rank
    )
