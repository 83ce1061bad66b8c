"""docs/configuration.md is generated from the preset schema (dd_sglang/config.py) and matches it."""

from __future__ import annotations

import subprocess
import sys
from typing import Literal

from pydantic import BaseModel, Field

from dd_sglang import config, config_doc
from harness.server import ROOT

DOC = ROOT / "docs" / "configuration.md"


def test_committed_reference_is_the_generated_one():
    out = subprocess.run([sys.executable, "-m", "dd_sglang.config_doc"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout == DOC.read_text(), (
        "docs/configuration.md is stale: python -m dd_sglang.config_doc > docs/configuration.md"
    )


def test_every_preset_key_has_a_row():
    text = DOC.read_text()
    for section, field in config.DDConfig.model_fields.items():
        model = field.annotation
        if isinstance(model, type) and issubclass(model, BaseModel):
            for key in model.model_fields:
                assert f"| `{section}.{key}` |" in text, f"{section}.{key} missing from docs/configuration.md"
        else:
            assert f"| `{section}` |" in text


class _Inner(BaseModel):
    """Inner section text."""

    n: int = Field(8, ge=1, le=64, description="how many ``things``")
    ratio: float = Field(0.5, gt=0.0, lt=1.0)
    mode: Literal["a", "b"] = "a"
    limit: int | None = Field(None, ge=3)
    names: list[str] = Field(default_factory=list)


class _Root(BaseModel):
    """Root text."""

    name: str = Field("x", min_length=1)
    inner: _Inner = Field(default_factory=_Inner)
    lab: _Inner = Field(default_factory=_Inner, json_schema_extra={"experimental": True})


def test_rows_state_type_default_range_and_description():
    doc = config_doc.render(_Root)
    assert "| `inner.n` | int | `8` | [1, 64] | how many `things` |" in doc
    assert "| `inner.ratio` | float | `0.5` | (0.0, 1.0) | see the section text above |" in doc
    assert "| `inner.mode` | one of `a`, `b` | `a` | – |" in doc
    assert "| `inner.limit` | int or null | `null` | >= 3 |" in doc
    assert "| `inner.names` | list of str | `[]` | – |" in doc
    assert "| `name` | str | `x` | length >= 1 |" in doc
    assert "Inner section text." in doc and "Root text." in doc


def test_an_experimental_section_comes_last_under_its_own_heading():
    doc = config_doc.render(_Root)
    assert doc.index("## `inner`") < doc.index("## Experimental") < doc.index("### `lab`")
    assert "| `lab.n` |" in doc
