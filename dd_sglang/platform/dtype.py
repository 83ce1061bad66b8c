"""The model dtype a CPU runs fastest, from its ISA flags (no SGLang import: the launcher reads it early)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

#: CPU flags (``/proc/cpuinfo``) of native bf16 matrix instructions: AVX-512 BF16 and AMX-BF16.
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@cache
def _first_cpu(cpuinfo: str) -> dict[str, str]:
    """``key: value`` fields of the first processor's block of ``cpuinfo`` (empty where the file is
    absent, e.g. macOS)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The ISA flags of the first CPU in ``cpuinfo`` (empty where the file is absent, e.g. macOS)."""
    return frozenset(_first_cpu(cpuinfo).get("flags", "").split())


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The first CPU's ``vendor_id`` and ``model name`` in ``cpuinfo`` (e.g. ``"AuthenticAMD AMD EPYC"``),
    or ``""`` where the file is absent. Hosts of one machine kind differ (an Intel CPU with AMX one
    day, an AMD one without it the next), and bf16 speed follows the CPU, so benchmarks record it."""
    fields = _first_cpu(cpuinfo)
    return " ".join(v for k in ("vendor_id", "model name") if (v := fields.get(k)))


def native_bf16(flags: frozenset[str] | None = None) -> bool:
    """True when the CPU has native bf16 matrix instructions (:data:`NATIVE_BF16_FLAGS`)."""
    return bool(NATIVE_BF16_FLAGS & (cpu_flags() if flags is None else flags))


def default_dtype(flags: frozenset[str] | None = None) -> str:
    """SGLang ``--dtype`` for this CPU: ``bfloat16`` with native bf16 instructions, else ``float32``.

    Without them PyTorch emulates bf16 matrix products, and float32 measured faster for the
    embedded model on a 2-core AVX2 machine: prefill and decode (``python -m bench.dtype_cpu``). With
    them the choice is not settled: on a 2-core AMD EPYC with ``avx512_bf16``,
    ``bench/results/dtype_cpu.json`` measured bfloat16 prefill 1.36x as fast as float32 but float32
    decode 1.69x (one ~4k request) and 1.55x (eight) as fast. The KV cache follows the model dtype,
    so float32 doubles its bytes per token.
    """
    return "bfloat16" if native_bf16(flags) else "float32"
