"""Every benchmark result in bench/results/ carries its provenance, the docs cite only such results
(never the archive), and docs/benchmarks.md is the page those results generate (``make report``)."""

from __future__ import annotations

import json
import re

import pytest

from bench import machine, report
from bench.cli import write_result
from harness.server import ROOT

RESULTS = ROOT / "bench" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"
CITED = re.compile(r"bench/results/[A-Za-z0-9_./-]+\.json")


def _docs() -> list:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.json")), ids=lambda p: p.name)
def test_every_result_has_provenance(path):
    problems = machine.provenance_problems(json.loads(path.read_text()))
    assert not problems, f"{path.name}: {problems} (write it with bench.cli.write_result)"


def test_docs_cite_existing_results_outside_the_archive():
    for doc in _docs():
        for cited in CITED.findall(doc.read_text()):
            assert "/archive/" not in cited, f"{doc.name} cites an archived result {cited}"
            assert (ROOT / cited).is_file(), f"{doc.name} cites {cited}, which does not exist"
            assert (ROOT / cited).parent == RESULTS


def test_benchmarks_page_is_the_generated_one():
    assert PAGE.read_text() == report.benchmarks_page(RESULTS), (
        "docs/benchmarks.md is stale: make report (python -m bench.report --page docs/benchmarks.md --plots docs/img)"
    )
    for img in re.findall(r"\]\((img/[^)]+\.png)\)", PAGE.read_text()):
        assert (ROOT / "docs" / img).is_file(), f"docs/benchmarks.md shows {img}, which does not exist"


def test_a_result_without_provenance_is_rejected():
    assert machine.provenance_problems({"command": "python -m bench.x"}) == ["no provenance block"]
    full = {"commit": "0123abc", "date": "2026-01-01T00:00:00Z", "command": "c",
            "versions": {"dd_sglang": "0.1.0", "sglang": "0.5.23", "torch": "2.14.1"},
            "machine": {"host_class": "cpu", "cpu_model": None, "cpu_flags": [], "cores": 2, "dtype": "float32",
                        "gpu": None}}  # fmt: skip
    assert machine.provenance_problems({"provenance": full}) == ["machine.cpu_model is null without a provenance_note"]
    assert machine.provenance_problems({"provenance": {**full, "provenance_note": "not recorded"}}) == []
    no_torch = {**full, "versions": {"dd_sglang": "0.1.0", "sglang": "0.5.23"}, "provenance_note": "x"}
    assert machine.provenance_problems({"provenance": no_torch}) == ["versions.torch missing"]
    assert machine.provenance_problems({"provenance": {**full, "commit": "HEAD", "provenance_note": "x"}}) == [
        "commit 'HEAD' is not a git hash"
    ]


def test_write_result_adds_one_provenance_block(tmp_path):
    out = tmp_path / "x.json"
    write_result({"benchmark": "b", "command": "python -m bench.b --flag", "machine": {"state_before": {"ms": 1}},
                  "value": 3}, out, dtype="float32")  # fmt: skip
    res = json.loads(out.read_text())
    assert list(res)[0] == "provenance" and "machine" not in res and res["value"] == 3
    p = res["provenance"]
    assert p["command"] == "python -m bench.b --flag" and p["machine"]["dtype"] == "float32"
    assert p["machine"]["state_before"] == {"ms": 1} and p["machine"]["cores"] >= 1
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", p["date"])
    assert not [x for x in machine.provenance_problems(res) if "sglang" not in x and "dd_sglang" not in x]


@pytest.mark.parametrize("cpu, gpu, cls", [
    ("AuthenticAMD AMD EPYC 9B14", None, "amd_epyc_cpu"),
    ("GenuineIntel Intel(R) Xeon(R) Platinum 8481C", None, "intel_xeon_cpu"),
    ("", None, "cpu"),
    (None, "NVIDIA H200", "h200"),
    ("AuthenticAMD AMD EPYC", "NVIDIA H100 80GB HBM3", "h100_80gb"),
])  # fmt: skip
def test_host_class_names_the_gpu_else_the_cpu_family(cpu, gpu, cls):
    assert machine.host_class(cpu, gpu) == cls
