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
#: Environment switch: "0" runs prefill-sized bfloat16 products on their own row counts, unpadded
#: (:func:`dd_sglang.platform.linear.bucketed_linear`).
ROW_BUCKETS_ENV = "DD_SGLANG_CPU_ROW_BUCKETS"

#: Entries of the two caches of oneDNN primitives a bfloat16 CPU matmul goes through, keyed by shape
#: (row count, weight shape, threads): PyTorch's ideep cache (``LRU_CACHE_CAPACITY``) and oneDNN's own
#: primitive cache (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``), 1,024 each by default. Every prefill chunk of
#: a new length (the last chunk of nearly every prompt) adds one entry per weight shape, ~0.67 MiB
#: for SmolLM2's (~2.7 MiB a new length: ``docs/operations-memory.md``), so a server fed prompts of
#: many lengths grew ~1.3 MiB a request until ~1,024 entries (~690 MiB) were held. 256 keeps a
#: decode step's shapes (its row counts x 5 weight shapes, per thread count) and bounds the caches
#: at about a quarter of that.
ONEDNN_CACHE_CAPACITY = 256
#: The variables :func:`bounded_cache_env` sets.
ONEDNN_CACHE_ENVS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bounded_cache_env(environ: dict[str, str]) -> dict[str, str]:
    """The variables the launcher adds to SGLang's environment so the oneDNN caches stay bounded
    (:data:`ONEDNN_CACHE_CAPACITY` entries each): each of :data:`ONEDNN_CACHE_ENVS` that ``environ``
    does not set already (a value the user set is kept, even one that is not a number: oneDNN and
    ideep read it)."""
    return {name: str(ONEDNN_CACHE_CAPACITY) for name in ONEDNN_CACHE_ENVS if name not in environ}


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
