"""The pure-PyTorch CPU platform that lets unmodified SGLang run without a GPU.

SGLang's in-tree ``CpuSRTPlatform`` is selected only with
``SGLANG_USE_CPU_ENGINE=1``, which routes through sgl-kernel's CPU build (not
on any registry). This out-of-tree platform reuses SGLang's
``CpuDeviceMixin`` for device queries (memory from psutil, ``torch.device("cpu")``)
and declares itself out-of-tree, so SGLang's generic PyTorch paths run: the
``torch_native`` attention backend (SDPA over the token-indexed KV pool),
no CUDA graphs, no pinned memory.
"""

from __future__ import annotations

import logging
from functools import cache
from pathlib import Path

from sglang.srt.platforms.cpu import CpuDeviceMixin
from sglang.srt.platforms.device_mixin import PlatformEnum
from sglang.srt.platforms.interface import SRTPlatform

logger = logging.getLogger(__name__)

#: The attention backend used for dense prefill and decode on this platform
#: (sglang/srt/layers/attention/torch_native_backend.py).
DENSE_ATTENTION_BACKEND = "torch_native"

#: CPU flags (``/proc/cpuinfo``) of native bf16 matrix instructions: AVX-512 BF16 and AMX-BF16.
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@cache
def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The ISA flags of the first CPU in ``cpuinfo`` (empty where the file is absent, e.g. macOS)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def native_bf16(flags: frozenset[str] | None = None) -> bool:
    """True when the CPU has native bf16 matrix instructions (:data:`NATIVE_BF16_FLAGS`)."""
    return bool(NATIVE_BF16_FLAGS & (cpu_flags() if flags is None else flags))


def default_dtype(flags: frozenset[str] | None = None) -> str:
    """SGLang ``--dtype`` for this CPU: ``bfloat16`` with native bf16 instructions, else ``float32``.

    Without them PyTorch emulates bf16 matrix products, and float32 measured faster for the
    embedded model on a 2-core AVX2 machine: prefill and decode, ``bench/results/dtype_cpu.json``
    (``python -m bench.dtype_cpu``). The KV cache follows the model dtype, so float32 doubles
    its bytes per token.
    """
    return "bfloat16" if native_bf16(flags) else "float32"


class TorchCpuPlatform(CpuDeviceMixin, SRTPlatform):
    """Out-of-tree SGLang platform: CPU device, PyTorch kernels only."""

    _enum = PlatformEnum.OOT
    device_name = "cpu"
    device_type = "cpu"

    def get_default_attention_backend(self) -> str:
        """Dense attention backend name: ``"torch_native"``."""
        return DENSE_ATTENTION_BACKEND

    def get_default_speculative_draft_attention_backend(self, algorithm: str) -> str:
        """Draft-model attention backend for speculative decoding: ``"torch_native"``."""
        return DENSE_ATTENTION_BACKEND

    def get_default_dtype(self) -> str:
        """The model dtype this CPU runs fastest (:func:`default_dtype`); the launcher passes it
        as ``--dtype`` unless the user gave one."""
        return default_dtype()

    def is_pin_memory_available(self, device=None) -> bool:
        """Pinned host memory needs a CUDA driver; there is none here."""
        return False
