"""docs/metrics.md is generated from the metric definitions, and the Grafana dashboard queries only
series the code exports."""

from __future__ import annotations

import os
import subprocess
import sys

from dd_sglang.metrics.catalog import dashboard_queries, dashboard_series, exported_samples
from harness.server import ROOT

DASHBOARD = ROOT / "docker" / "grafana" / "dashboards" / "dd_sglang.json"


def test_committed_catalogue_is_the_generated_one():
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    out = subprocess.run(
        [sys.executable, "-m", "dd_sglang.metrics.catalog"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    committed = (ROOT / "docs" / "metrics.md").read_text()
    assert out.stdout == committed, (
        "docs/metrics.md is stale: python -m dd_sglang.metrics.catalog > docs/metrics.md"
    )
    # Every exported sample name is in it, each with its type.
    for name in exported_samples():
        assert f"`{name}`" in committed


def test_dashboard_queries_name_only_exported_series():
    queries = dashboard_queries(DASHBOARD)
    assert len(queries) >= 10
    used = dashboard_series(DASHBOARD)
    assert used, "the dashboard queries no dd_ series"
    unknown = used - exported_samples()
    assert not unknown, f"dashboard queries series the code does not export: {sorted(unknown)}"
