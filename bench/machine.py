"""The machine a speed benchmark ran on, and how fast it was at that moment.

This machine kind is not one CPU. On 2026-12-04 from 00:13 to 05:10 SGLang dense decoded 2-3x
slower than the evening before while the sparse step slowed by at most 1.4x
(``bench/results/capacity_rounds_split_morning_cpu.json``, ``decode_speed_morning_cpu.json``); in
that state one bfloat16 ``scaled_dot_product_attention`` of one query over 4,000 keys (SmolLM2's 9
heads of 64) took 2.3-3.1 ms against 0.4-0.7 ms in float32. That day's evening a host that named
itself an AMD EPYC (``avx512_bf16``, no AMX) read 2.2-2.5 ms against 0.3-0.5 ms, and there that
bfloat16 call makes no oneDNN call (``ONEDNN_VERBOSE=1`` prints none for it; a bfloat16 matmul
prints ``brg_matmul:avx512_core_bf16``), where the fast runs of 2026-12-03 recorded AMX: most likely
two hosts, not two hours (README, **Which CPU**). SGLang's
``torch_native`` decode makes that call once per request and layer (30 layers), and the sparse
path's C attention does not. So :func:`machine_state` times that call (and a float32 one beside
it) in the benchmark's own process, before its servers start and after they stop, and
:func:`describe` records it with the CPU model and its bf16 instructions: a ratio of the sparse
path over dense means little without the dense attention's speed on that host.
"""

from __future__ import annotations

import os
import platform
import sys
import time

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


def measured(benchmark: str, command: str, fn) -> dict:
    """Run ``fn()`` (a benchmark's measurement, returning a dict of its figures) between two
    :func:`machine_state` probes (the first one logged to stderr); returns the benchmark JSON's head
    ``{"benchmark", "command", "machine": describe(before, after)}`` followed by ``fn``'s figures."""
    before = machine_state()
    print(summary(before), file=sys.stderr)
    fig = fn()
    return {"benchmark": benchmark, "command": command, "machine": describe(before, machine_state()), **fig}
