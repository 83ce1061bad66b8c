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

from sglang.srt.platforms.cpu import CpuDeviceMixin
from sglang.srt.platforms.device_mixin import PlatformEnum
from sglang.srt.platforms.interface import SRTPlatform

from dd_sglang.platform.dtype import default_dtype
from dd_sglang.platform.heap import trim_heap

#: The attention backend used for dense prefill and decode on this platform
#: (sglang/srt/layers/attention/torch_native_backend.py).
DENSE_ATTENTION_BACKEND = "torch_native"

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

    def empty_cache(self) -> None:
        """SGLang's release point (idle sleep with ``SGLANG_EMPTY_CACHE_INTERVAL``, ``flush_cache``,
        weight reloads): its CPU garbage-collection pass, then glibc's free heap back to the kernel
        (:func:`dd_sglang.platform.heap.trim_heap`)."""
        super().empty_cache()
        trim_heap()

    def is_pin_memory_available(self, device=None) -> bool:
        """Pinned host memory needs a CUDA driver; there is none here."""
        return False
