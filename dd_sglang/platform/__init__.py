"""SGLang platform plugin (entry point group ``sglang.srt.platforms``).

How SGLang uses it (sglang/srt/platforms/__init__.py, 0.5.23):

1. On the first access to ``sglang.srt.platforms.current_platform`` in any
   SGLang process, every installed ``sglang.srt.platforms`` entry point is
   loaded and called with no arguments.
2. A plugin that returns None is inactive. A plugin that returns a dotted class
   path is active; SGLang resolves it with ``pkgutil.resolve_name`` and checks
   that it subclasses ``SRTPlatform``.
3. Exactly one active plugin is used. None active: SGLang falls back to its
   in-tree detection (CUDA, ROCm, ...). Two active: SGLang raises
   ``RuntimeError`` unless ``SGLANG_PLATFORM`` names one.

:func:`activate` is active only when CUDA is not available, so on a GPU host
SGLang's own CUDA platform stays in charge and this module changes nothing.
On a CPU-only host it selects :class:`dd_sglang.platform.cpu.TorchCpuPlatform`,
which runs unmodified SGLang with pure-PyTorch kernels. It never sets
``SGLANG_USE_CPU_ENGINE``: that path needs a CPU build of sgl-kernel.
"""

from __future__ import annotations

PLATFORM_CLASS = "dd_sglang.platform.cpu.TorchCpuPlatform"
#: Environment switch: "0" keeps every linear layer on ``F.linear`` (:mod:`dd_sglang.platform.linear`).
#: Here, not in ``linear``, so the launcher refuses a bad value without importing PyTorch.
PREPACK_ENV = "DD_SGLANG_CPU_PREPACK"


def cuda_available() -> bool:
    """True when PyTorch sees a usable CUDA (or ROCm) device.

    Kept as its own function so the activation rule can be tested by
    substituting it; import of torch is deferred to the call.
    """
    import torch

    return bool(torch.cuda.is_available())


def activate() -> str | None:
    """Entry point called by SGLang's platform discovery.

    Returns:
        ``"dd_sglang.platform.cpu.TorchCpuPlatform"`` when no CUDA device is
        available, else None (SGLang keeps its in-tree CUDA platform).
    """
    if cuda_available():
        return None
    return PLATFORM_CLASS
