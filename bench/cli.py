"""The benchmarks' command-line and result-file helpers: result JSON with provenance, range checks of
flags, the parser the long-request benches share. (Servers, clients and prompts: :mod:`harness`.)"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def write_result(result: dict, path: str | Path, dtype: str | None = None) -> None:
    """Write a benchmark's result as indented JSON to ``path`` (parent folders created) and print where.

    The file starts with the result's ``provenance`` block (:func:`bench.machine.provenance`:
    commit, date, command, versions, one machine block); what a ``provenance`` the result brings
    states (taken before the run) wins over what is taken now. The bench's own ``machine`` field (speed probes, :func:`bench.machine.describe`) moves into that
    block's ``machine``; its ``command`` is kept and copied there. ``dtype``: the model dtype the
    benchmark ran in; default the result's ``dtype`` (or ``settings.dtype``), else the dtype the
    launcher chooses on this host (:func:`dd_sglang.platform.dtype.default_dtype`) on a CPU host.
    """
    from bench import machine

    body = dict(result)
    given = body.pop("provenance", None) or {}
    probes = body.pop("machine", None)
    if probes is not None and not isinstance(probes, dict):
        probes = {"description": probes}
    if dtype is None:
        dtype = body.get("dtype") or (body.get("settings") or {}).get("dtype")
    if dtype is None and machine.gpu_name() is None:
        from dd_sglang.platform.dtype import default_dtype

        dtype = default_dtype()
    prov = machine.provenance(body.get("command"), dtype, probes)
    # A block taken earlier (bench.machine.measured: before the run) keeps its commit and date.
    prov.update({k: v for k, v in given.items() if k != "machine" and v is not None})
    prov["machine"].update({k: v for k, v in (given.get("machine") or {}).items() if v is not None})
    body = {"provenance": prov, **body}
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(body, indent=1) + "\n")
    print(f"-> {out}")


def check_ranges(ap, args, ranges: tuple[tuple[str, float, float], ...]) -> None:
    """Stop with ``ap.error`` (exit code 2) naming the first ``--flag`` of ``ranges`` (``(dest, lo, hi)``,
    inclusive) whose value in ``args`` lies outside ``[lo, hi]``."""
    for name, lo, hi in ranges:
        if not lo <= getattr(args, name) <= hi:
            ap.error(f"--{name.replace('_', '-')} must be in [{lo}, {hi}], got {getattr(args, name)}")


def long_request_parser(prog: str, doc: str, out: str, requests: int, prompt_tokens: int):
    """An ``argparse.ArgumentParser`` for a bench that sends long passkey requests to one server, with
    the flags such benches share: ``--out`` (JSON path), ``--requests``, ``--prompt-tokens``
    (:func:`harness.prompts.passkey_prompt`'s size target) and ``--max-total-tokens`` (device KV pool,
    tokens, default 8,400), defaults as given; ``doc`` (the module docstring) is its description."""
    ap = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=out)
    ap.add_argument("--requests", type=int, default=requests)
    ap.add_argument("--prompt-tokens", type=int, default=prompt_tokens, help="passkey_prompt size target")
    ap.add_argument("--max-total-tokens", type=int, default=8400, help="device KV pool (tokens)")
    return ap
