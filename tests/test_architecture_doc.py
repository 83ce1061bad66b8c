"""docs/architecture.md names, per device, the file and function of each stage of a decode step: every
``dd_sglang/...py: Name.attr`` entry of its stage table is imported here, so a rename or a move fails;
a runner built with each named device profile uses the stages its column names, and a profile or
transfer outside the allowed values is refused."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
ENTRY = re.compile(r"`(dd_sglang/[\w/]+\.py): ([\w.]+)`")


def stage_entries() -> list[tuple[str, str]]:
    text = DOC.read_text()
    table = text.split("<!-- stages: begin -->", 1)[1].split("<!-- stages: end -->", 1)[0]
    return ENTRY.findall(table)


def test_the_stage_table_names_both_devices_for_every_stage():
    text = DOC.read_text()
    table = text.split("<!-- stages: begin -->", 1)[1].split("<!-- stages: end -->", 1)[0]
    rows = [r for r in table.strip().splitlines()[2:] if r.startswith("|")]
    stages = [r.split("|")[1].strip() for r in rows]
    assert stages[0].startswith("plan") and any(s.startswith("move") for s in stages)
    assert any(s.startswith("consume") for s in stages) and sum(s.startswith("choose") for s in stages) == 2
    assert len(stage_entries()) >= 15


def test_every_function_the_stage_table_names_exists():
    missing = []
    for path, name in stage_entries():
        obj = importlib.import_module(path[: -len(".py")].replace("/", "."))
        for part in name.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                missing.append(f"{path}: {name}")
                break
    assert missing == []


def _profile_columns() -> dict[str, set[str]]:
    """Per profile named in the stage table's header, the class names its column's entries use."""
    text = DOC.read_text()
    table = text.split("<!-- stages: begin -->", 1)[1].split("<!-- stages: end -->", 1)[0]
    rows = [r.split("|")[1:-1] for r in table.strip().splitlines() if r.startswith("|")]
    names = [re.match(r"\s*`(\w+)` profile", cell).group(1) for cell in rows[0][1:]]
    return {name: {n.split(".")[0] for row in rows[2:] for _, n in ENTRY.findall(row[1 + i])}
            for i, name in enumerate(names)}  # fmt: skip


def test_a_runner_built_with_each_profile_uses_the_stages_its_column_names():
    """The header names each profile of ``dd_sglang/prefetch/profile.py`` with its stages, and a runner
    built with that profile (on CPU tensors, the fakes of the backend tests) holds the source and
    attender classes its column names."""
    from dd_sglang.prefetch.params import PrefetchParams
    from dd_sglang.prefetch.profile import PROFILES
    from dd_sglang.prefetch.runner import SparseStepRunner
    from tests.test_backend_unit import Harness

    columns = _profile_columns()
    assert set(columns) == set(PROFILES)
    header = DOC.read_text().split("<!-- stages: begin -->", 1)[1].splitlines()[1]
    h = Harness()
    for name, profile in PROFILES.items():
        assert f"source `{profile.source}`, attender `{profile.attender}`" in header
        runner = SparseStepRunner(h.rt.host, "cpu", h.rt.host.k.dtype, h.r2t, PrefetchParams(kernel="torch"),
                                  profile=profile)  # fmt: skip
        used = {type(runner.source).__name__, type(runner.attender).__name__}
        assert used <= columns[name], (name, used, columns[name])


def test_a_profile_or_transfer_outside_the_allowed_values_is_refused_naming_the_field():
    from dd_sglang.prefetch.profile import CPU, DeviceProfile, resolve_profile

    with pytest.raises(ValueError, match=r"DeviceProfile.source must be one of \['copy_ahead', 'copy_inline', 'in_place'\]"):
        DeviceProfile("x", "host_sync", "in-place", "fused_c")
    with pytest.raises(ValueError, match=r"DeviceProfile.attender must be one of"):
        DeviceProfile("x", "host_sync", "in_place", "fused")
    with pytest.raises(ValueError, match=r"experimental.transfer must be one of \['auto', 'worker', 'inline', 'in_place'\]"):
        resolve_profile("cpu", "ahead", True, True, True)
    assert resolve_profile("cpu", "auto", True, True, True) is CPU
