"""docs/architecture.md names, per device, the file and function of each stage of a decode step: every
``dd_sglang/...py: Name.attr`` entry of its stage table is imported here, so a rename or a move fails."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

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
