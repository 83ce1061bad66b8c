"""The machine a benchmark ran on, how fast it was at that moment, and the provenance of its result.

Every benchmark JSON under ``bench/results/`` carries one ``provenance`` block, written by
:func:`provenance` through ``bench.cli.write_result``::

    {"commit": "<40 hex>", "dirty": false, "date": "2026-12-05T10:11:12Z", "command": "python -m bench...",
     "versions": {"dd_sglang": "0.1.0", "sglang": "0.5.23", "torch": "2.14.1", "python": "3.11.9"},
     "machine": {"host_class": "amd_epyc_cpu", "cpu_model": "...", "cpu_flags": [...], "cores": 2,
                 "dtype": "bfloat16", "gpu": null, ...the bench's own probes...}}

``tests/test_bench_results.py`` rejects a cited result without it (a field that was not recorded
is null, and then ``provenance_note`` says why). File names say the benchmark and
:func:`host_class`, nothing else.

Speed probes. CPUs of this machine kind differ: on a host with ``avx512_bf16`` and no AMX one
bfloat16 ``scaled_dot_product_attention`` of one decode query over 4,000 keys (SmolLM2's 9 heads
of 64) took several times the float32 call, and SGLang's ``torch_native`` decode makes that call
once per request and layer while the sparse path's C attention does not. So :func:`machine_state`
times that call (and a float32 one beside it) in the benchmark's own process, before its servers
start and after they stop, and :func:`describe` records it with the CPU model and its bf16
instructions: a ratio of the sparse path over dense means little without the dense attention's
speed on that host.
"""

from __future__ import annotations

import datetime
import os
import platform
import re
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import torch
import torch.nn.functional as F

from dd_sglang.platform.dtype import NATIVE_BF16_FLAGS, cpu_flags, cpu_model

#: The probe's shapes: SmolLM2-135M's query heads and head dim (``dd_sglang.models.smollm2``), one
#: decode query against a 4,000-token context (the 4k cells of ``bench.decode_speed`` and
#: ``bench.capacity``).
PROBE_HEADS, PROBE_HEAD_DIM, PROBE_KEYS = 9, 64, 4000


def sdpa_decode_ms(dtype: torch.dtype, calls: int = 50, keys: int = PROBE_KEYS) -> float:
    """Mean milliseconds of one ``F.scaled_dot_product_attention`` call of one query over
    ``keys`` keys (``[1, 9, 1, 64]`` against ``[1, 9, keys, 64]``, ``dtype``), after one warm-up call,
    on this thread's intra-op threads.

    Raises:
        ValueError: ``calls`` or ``keys`` below 1.
    """
    if calls < 1 or keys < 1:
        raise ValueError(f"calls and keys must be >= 1, got calls={calls}, keys={keys}")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, PROBE_HEADS, 1, PROBE_HEAD_DIM, generator=g).to(dtype)
    k = torch.randn(1, PROBE_HEADS, keys, PROBE_HEAD_DIM, generator=g).to(dtype)
    v = torch.randn(1, PROBE_HEADS, keys, PROBE_HEAD_DIM, generator=g).to(dtype)
    with torch.inference_mode():
        F.scaled_dot_product_attention(q, k, v)
        t0 = time.perf_counter()
        for _ in range(calls):
            F.scaled_dot_product_attention(q, k, v)
        return (time.perf_counter() - t0) / calls * 1e3


def machine_state(calls: int = 50) -> dict:
    """``{"sdpa_decode_ms": {"bfloat16": ms, "float32": ms}, "intra_op_threads": n}``, measured now
    (:func:`sdpa_decode_ms`, ``calls`` calls each; ~0.2 s on 2 cores)."""
    return {
        "intra_op_threads": torch.get_num_threads(),
        "sdpa_decode_ms": {
            name: round(sdpa_decode_ms(dtype, calls), 3)
            for name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32))
        },
    }


def bf16_isa() -> list[str]:
    """This CPU's native bf16 instructions among :data:`~dd_sglang.platform.dtype.NATIVE_BF16_FLAGS`, sorted."""
    return sorted(NATIVE_BF16_FLAGS & cpu_flags())


def describe(before: dict, after: dict | None = None) -> dict:
    """A benchmark JSON's ``machine`` field: processor, CPU model (vendor and model name), its bf16
    instructions (``avx512_bf16``, ``amx_bf16``), CPU count and :func:`machine_state` taken before the
    run (``before``) and after it (``after``, when given)."""
    out = {"processor": platform.processor() or platform.machine(), "cpu_model": cpu_model(),
           "bf16_isa": bf16_isa(), "cpus": os.cpu_count(), "state_before": before}  # fmt: skip
    if after is not None:
        out["state_after"] = after
    return out


def summary(state: dict) -> str:
    """One log line of a :func:`machine_state`."""
    ms = state["sdpa_decode_ms"]
    return (f"machine state ({cpu_model() or 'CPU model unknown'}, bf16 ISA: "
            f"{'/'.join(bf16_isa()) or 'none'}): one SDPA decode call over {PROBE_KEYS} keys {ms['bfloat16']} ms bfloat16, "
            f"{ms['float32']} ms float32 ({state['intra_op_threads']} threads)")  # fmt: skip


#: Distributions whose versions :func:`provenance` records.
VERSIONED = ("sglang", "torch", "transformers", "dd_sglang")
_REPO = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str | None:
    """Output of ``git args`` in this checkout, stripped; None without git or outside a repository."""
    try:
        out = subprocess.run(["git", *args], cwd=_REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def measured(benchmark: str, command: str, fn) -> dict:
    """Run ``fn()`` (a benchmark's measurement, returning a dict of its figures) between two
    :func:`machine_state` probes (the first one logged to stderr); returns the benchmark JSON's head
    ``{"benchmark", "command", "provenance": provenance(command), "machine": describe(before, after)}``
    followed by ``fn``'s figures (:func:`provenance` is taken before ``fn`` runs; ``write_result``
    moves ``machine`` into it)."""
    before = machine_state()
    print(summary(before), file=sys.stderr)
    prov = provenance(command)
    fig = fn()
    return {"benchmark": benchmark, "command": command, "provenance": prov,
            "machine": describe(before, machine_state()), **fig}  # fmt: skip


#: The CPU flags a provenance block records: the instruction sets the kernels and PyTorch's CPU
#: paths choose between (the full flag list is ~100 names and says nothing more about speed).
ISA_FLAGS = frozenset({
    "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
    "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8",
})
#: Keys every provenance block has (``None`` allowed only with a ``provenance_note``).
PROVENANCE_KEYS = ("commit", "date", "command", "versions", "machine")
VERSION_KEYS = ("dd_sglang", "sglang", "torch")
MACHINE_KEYS = ("host_class", "cpu_model", "cpu_flags", "cores", "dtype", "gpu")


def gpu_name() -> str | None:
    """The first CUDA device's name (``torch.cuda.get_device_name``), None without CUDA."""
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def host_class(cpu: str | None, gpu: str | None = None) -> str:
    """The host class a result's file name carries: the GPU's model when there is one
    (``"NVIDIA H200"`` -> ``h200``), else the CPU's family plus ``_cpu`` (``"AuthenticAMD AMD EPYC
    9B14"`` -> ``amd_epyc_cpu``, ``"GenuineIntel Intel(R) Xeon(R) Platinum 8481C"`` ->
    ``intel_xeon_cpu``), else ``cpu`` when the CPU model is unknown."""
    if gpu:
        words = re.sub(r"[^a-z0-9 ]", " ", gpu.lower()).split()
        words = [w for w in words if w not in ("nvidia", "tesla", "geforce")]
        return "_".join(words[:2]) or "gpu"
    if not cpu:
        return "cpu"
    low = cpu.lower()
    for needle, name in (("epyc", "amd_epyc"), ("ryzen", "amd_ryzen"), ("xeon", "intel_xeon"),
                         ("core(tm)", "intel_core"), ("neoverse", "arm_neoverse"), ("graviton", "aws_graviton")):  # fmt: skip
        if needle in low:
            return f"{name}_cpu"
    return "cpu"


def host(dtype: str | None = None) -> dict:
    """The static part of a provenance ``machine`` block for this process's host: host class, CPU
    model, its ISA flags (:data:`ISA_FLAGS`), cores, the benchmark's ``dtype`` and the GPU."""
    model, gpu = cpu_model() or None, gpu_name()
    return {"host_class": host_class(model, gpu), "cpu_model": model,
            "cpu_flags": sorted(ISA_FLAGS & cpu_flags()), "cores": os.cpu_count(), "dtype": dtype, "gpu": gpu}  # fmt: skip


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict:
    """Python's version and those of :data:`VERSIONED` (None where not installed)."""
    return {"python": platform.python_version(), **{dist: _version(dist) for dist in VERSIONED}}


def command_line() -> str:
    """This process's command as a user would type it: ``python -m bench.x ARGS`` for a module run."""
    argv = list(sys.argv)
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    head = ["python", "-m", spec.name] if spec is not None and spec.name else ["python", argv[0] if argv else "?"]
    return " ".join(head + argv[1:])


def provenance(command: str | None = None, dtype: str | None = None, probes: dict | None = None) -> dict:
    """A result's ``provenance`` block, taken now: the checkout's commit, the UTC date, ``command`` (default :func:`command_line`),
    :func:`versions` and one ``machine`` block (:func:`host` with ``dtype``, then the bench's own
    ``probes``, e.g. :func:`describe`'s speed states, which never replace a static key).
    ``dirty``: files under ``bench/``, ``dd_sglang/`` or ``patches/`` differ from ``commit``
    (uncommitted code ran; None outside git)."""
    status = _git("status", "--porcelain", "--", "bench", "dd_sglang", "patches")
    machine = {**(probes or {}), **host(dtype)}
    out = {
        "commit": _git("rev-parse", "HEAD"),
        "dirty": None if status is None else bool(status),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": command or command_line(),
        "versions": versions(),
        "machine": machine,
    }
    missing = [k for k, v in out["versions"].items() if v is None]
    if missing:  # a GPU host may run a bench from the checkout without the project or SGLang installed
        out["provenance_note"] = f"not installed where this ran: {', '.join(missing)}"
    return out


def provenance_problems(result: dict) -> list[str]:
    """What a result's provenance lacks, one message each (empty: complete). A key may be None only
    when the block has a non-empty ``provenance_note``; ``dirty`` and ``gpu`` may be None always
    (not a git checkout; no GPU)."""
    p = result.get("provenance")
    if not isinstance(p, dict):
        return ["no provenance block"]
    noted = bool(str(p.get("provenance_note") or "").strip())
    out = []

    def need(where: str, d: dict, keys: tuple[str, ...], nullable: tuple[str, ...] = ()) -> None:
        for k in keys:
            if k not in d:
                out.append(f"{where}{k} missing")
            elif d[k] is None and k not in nullable and not noted:
                out.append(f"{where}{k} is null without a provenance_note")

    need("", p, PROVENANCE_KEYS)
    for key, keys, nullable in (("versions", VERSION_KEYS, ()), ("machine", MACHINE_KEYS, ("gpu",))):
        if isinstance(p.get(key), dict):
            need(f"{key}.", p[key], keys, nullable)
        elif p.get(key) is not None:
            out.append(f"{key} is not a mapping")
    if isinstance(p.get("commit"), str) and not re.fullmatch(r"[0-9a-f]{7,40}", p["commit"]):
        out.append(f"commit {p['commit']!r} is not a git hash")
    return out
