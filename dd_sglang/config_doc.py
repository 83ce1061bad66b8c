"""The preset reference: ``python -m dd_sglang.config_doc > docs/configuration.md``.

The schema in :mod:`dd_sglang.config` is the one declaration of every preset key; this module
renders it, and ``tests/test_config_doc.py`` fails when the committed file differs from what it
renders now. For each key it writes:

1. the dotted key (``sparse.top_k``), in the order the schema declares it;
2. its type, from the annotation (``Literal`` values listed, ``None`` shown as ``null``);
3. its default (a ``default_factory`` is called), in YAML spelling;
4. its range, from the field's ``ge`` / ``gt`` / ``le`` / ``lt`` / ``min_length`` constraints;
5. its description: the field's ``Field(description=...)`` when it has one, else a pointer to
   the section's text. Every section's class docstring is printed above its table.

Nested pydantic models are sections (``DDConfig``'s fields), rendered one table each; a section
marked ``json_schema_extra={"experimental": True}`` is rendered last, under its own heading.
Importing this module imports neither PyTorch nor SGLang.
"""

from __future__ import annotations

import inspect
import re
import types
import typing

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from dd_sglang import config

_ROLE = re.compile(r":(?:class|mod|func|meth|attr|data):`~?([^`]+)`")


def _markdown(text: str) -> str:
    """reST as the docstrings write it, in Markdown: ````x```` -> ```x```, ``:class:`~a.B``` -> ```B```."""
    text = _ROLE.sub(lambda m: f"`{m.group(1).rsplit('.', 1)[-1]}`", text)
    return text.replace("``", "`")


def _cell(text: str) -> str:
    """One Markdown table cell: one line, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def type_name(annotation: typing.Any) -> str:
    """A field's annotation as a reader writes it: ``int``, ``int or null``, ``one of `a`, `b```,
    ``list of ...``, ``mapping of str to ...``."""
    if annotation is type(None):
        return "null"
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        names = [type_name(a) for a in args if a is not type(None)]
        out = " or ".join(names)
        return out + " or null" if type(None) in args else out
    if origin is list:
        return f"list of {type_name(args[0])}"
    if origin is dict:
        return f"mapping of {type_name(args[0])} to {type_name(args[1])}"
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation)


def yaml_value(value: typing.Any) -> str:
    """A default as a preset would spell it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{}" if not value else str(value)
    if isinstance(value, list):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    return str(value)


def default_of(field: FieldInfo) -> str:
    """The field's default in YAML spelling (``default_factory`` called); ``required`` when none."""
    if field.default_factory is not None:
        return yaml_value(field.default_factory())
    if field.is_required():
        return "required"
    return yaml_value(field.default)


def range_of(field: FieldInfo) -> str:
    """``[lo, hi]`` / ``(lo, hi]`` / ``>= lo`` from the field's constraints; ``length >= n`` for
    ``min_length``; empty when it has none."""
    c: dict[str, typing.Any] = {}
    for m in field.metadata:
        for name in ("ge", "gt", "le", "lt", "min_length", "max_length"):
            if getattr(m, name, None) is not None:
                c[name] = getattr(m, name)
    parts = []
    lo = ("[", c["ge"]) if "ge" in c else ("(", c["gt"]) if "gt" in c else None
    hi = (c["le"], "]") if "le" in c else (c["lt"], ")") if "lt" in c else None
    if lo and hi:
        parts.append(f"{lo[0]}{lo[1]}, {hi[0]}{hi[1]}")
    elif lo:
        parts.append(f"{'>=' if lo[0] == '[' else '>'} {lo[1]}")
    elif hi:
        parts.append(f"{'<=' if hi[1] == ']' else '<'} {hi[0]}")
    if "min_length" in c:
        parts.append(f"length >= {c['min_length']}")
    if "max_length" in c:
        parts.append(f"length <= {c['max_length']}")
    return ", ".join(parts)


def _section_model(field: FieldInfo) -> type[BaseModel] | None:
    ann = field.annotation
    return ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None


def _experimental(field: FieldInfo) -> bool:
    extra = field.json_schema_extra
    return isinstance(extra, dict) and bool(extra.get("experimental"))


def section_table(model: type[BaseModel], prefix: str) -> list[str]:
    """Markdown lines: the model's docstring, then one row per scalar key (nested models are
    their own sections and are skipped here)."""
    lines = []
    doc = inspect.getdoc(model)
    if doc and model.__doc__:  # the model's own docstring, not one inherited from BaseModel
        lines += [_markdown(doc), ""]
    lines += ["| key | type | default | range | description |", "|---|---|---|---|---|"]
    for name, field in model.model_fields.items():
        if _section_model(field) is not None:
            continue
        desc = _markdown(field.description) if field.description else "see the section text above"
        lines.append(
            f"| `{prefix}{name}` | {_cell(type_name(field.annotation))} | `{_cell(default_of(field))}` "
            f"| {_cell(range_of(field)) or '–'} | {_cell(desc)} |"
        )
    return lines + [""]


def render(root: type[BaseModel] = config.DDConfig) -> str:
    """The whole of ``docs/configuration.md``."""
    out = [
        "# Configuration",
        "",
        "<!-- Generated by `python -m dd_sglang.config_doc > docs/configuration.md` from the pydantic",
        "     schema in dd_sglang/config.py; tests/test_config_doc.py fails when they differ. Do not edit. -->",
        "",
        "A preset is a YAML file passed as `--dd-config NAME|PATH` (a name means `configs/NAME.yaml`;",
        f"the default is `{config.DEFAULT_PRESET}`). Every key is optional; an unknown key, a value of",
        "the wrong type (no coercion: `\"512\"` is not an integer) or a value out of range stops the",
        "launcher with exit code 2 and a message naming the dotted key, before SGLang starts. A flag",
        "given on the command line wins over the preset; the preset wins over SGLang's defaults.",
        "",
    ]
    sections, experimental = [], []
    for name, field in root.model_fields.items():
        model = _section_model(field)
        if model is not None:
            (experimental if _experimental(field) else sections).append((name, model))
    out += ["## Top level", ""] + section_table(root, "")
    for name, model in sections:
        out += [f"## `{name}`", ""] + section_table(model, f"{name}.")
    if experimental:
        out += ["## Experimental", "",
                "Switches kept for benchmarks only. No shipped preset sets them; they may change or go.", ""]
        for name, model in experimental:
            out += [f"### `{name}`", ""] + section_table(model, f"{name}.")
    return "\n".join(out).rstrip("\n") + "\n"


if __name__ == "__main__":
    print(render(), end="")
