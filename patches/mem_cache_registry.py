"""Registration in ``sglang.srt.mem_cache.registry`` (every SGLang process).

``register_radix_cache_backend("dualdecoder")``: ``--radix-cache-backend dualdecoder``
(added by the launcher with ``--attention-backend dualdecoder``) makes SGLang's
scheduler build its tree cache with :func:`create_dualdecoder_radix_cache`:
SGLang's ``create_unified_radix_cache`` with the class
:class:`dd_sglang.kvcache.radix.DualDecoderRadixCache`, plus the process's
:class:`dd_sglang.kvcache.sparse_runtime.SparseRuntime` (host tier and DualPath
bookkeeping), whose transitions are counted in ``dd_dualpath_transitions_total``.

The runtime is handed over once, here: to the cache (``cache.runtime``, which the scheduler
hooks read through ``scheduler.tree_cache`` and ``PrefillAdder.tree_cache``) and to the
``dualdecoder`` attention backends of the model worker (``ctx.tp_worker.model_runner``, built
before the cache), as SGLang's own factory hands HiCache's layer-done counter to the worker.
No module global holds it.

Each scheduler process (one per data-parallel rank and tensor-parallel rank)
builds its own runtime over its own device pool with its share of
``sparse.host_tier_bytes`` (:func:`dd_sglang.kvcache.ranks.host_tier_share`);
transitions and reloaded tokens are counted by attention-TP rank 0 only (every
TP rank of a replica sees the same requests).
"""

from __future__ import annotations

BACKEND_NAME = "dualdecoder"
#: SGLang symbols this module uses (checked by tests/test_patches.py).
SYMBOLS = (
    "sglang.srt.mem_cache.registry.register_radix_cache_backend",
    "sglang.srt.mem_cache.registry.registered_radix_cache_backends",
    "sglang.srt.mem_cache.registry.create_unified_radix_cache",
    "sglang.srt.mem_cache.registry.TreeCacheBuildContext",
    "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.free_kv_row",
    "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.on_release",
    "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.match_prefix",
    "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.reset",
    "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.insert",
    "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.path_device_indices",
)


def _count_transition(src, dst) -> None:
    from dd_sglang.metrics.definitions import DUALPATH_TRANSITIONS

    DUALPATH_TRANSITIONS.labels(**{"from": src.value, "to": dst.value}).inc()


def _count_rebuild(n_tokens: int) -> None:
    from dd_sglang.metrics.definitions import HOST_TIER_REBUILT_TOKENS

    HOST_TIER_REBUILT_TOKENS.inc(n_tokens)


def _count_path_change(reason: str) -> None:
    from dd_sglang.metrics.definitions import DUALPATH_PATH_CHANGES

    DUALPATH_PATH_CHANGES.labels(reason=reason).inc()


def _count_pressure_offload(trigger: str) -> None:
    from dd_sglang.metrics.definitions import PRESSURE_OFFLOADS

    PRESSURE_OFFLOADS.labels(trigger=trigger).inc()


def _count_unpin() -> None:
    from dd_sglang.metrics.definitions import OFFLOAD_UNPINNED

    OFFLOAD_UNPINNED.inc()


def create_dualdecoder_radix_cache(ctx):
    """Factory SGLang calls with its ``TreeCacheBuildContext``.

    Raises:
        ValueError: ``--enable-hierarchical-cache`` is set (the dualdecoder host tier
            replaces HiCache's), or the model is hybrid (SWA / Mamba), which the
            host tier does not store.
    """
    from sglang.srt.mem_cache.registry import create_unified_radix_cache

    from dd_sglang.attention.backend import dualdecoder_backends
    from dd_sglang.kvcache import sparse_runtime
    from dd_sglang.kvcache.params import SparseParams
    from dd_sglang.kvcache.radix import DualDecoderRadixCache
    from dd_sglang.kvcache.ranks import current_ranks, host_tier_share
    from dd_sglang.plugin.runtime import current_config, request_limits

    if ctx.enable_hierarchical_cache:
        raise ValueError(
            "--radix-cache-backend dualdecoder brings its own host tier; drop --enable-hierarchical-cache"
        )
    if ctx.is_hybrid_swa or ctx.is_hybrid_ssm:
        raise ValueError(
            "--radix-cache-backend dualdecoder supports full-attention models only (no SWA/Mamba)"
        )
    cache = create_unified_radix_cache(ctx, cache_class=DualDecoderRadixCache)
    if current_ranks().primary:
        from dd_sglang.metrics.definitions import publish_policy_series

        publish_policy_series()
    allocator = ctx.params.token_to_kv_pool_allocator
    ranks = current_ranks()
    cfg = current_config()
    total = cfg.sparse.host_tier_bytes
    params = SparseParams.from_config(cfg, host_tier_bytes=host_tier_share(total, ranks))
    selectors, _ = request_limits()  # what the tokenizer manager lets requests name
    try:
        runtime = sparse_runtime.SparseRuntime(
            params,
            allocator.get_kvcache(),
            allocator,
            ctx.params.req_to_token_pool.req_to_token,
            on_transition=_count_transition if ranks.primary else None,
            on_rebuild=_count_rebuild if ranks.primary else None,
            on_unpin=_count_unpin if ranks.primary else None,
            on_path_change=_count_path_change if ranks.primary else None,
            on_pressure_offload=_count_pressure_offload if ranks.primary else None,
            selectors=selectors,
        )
    except ValueError as err:
        raise ValueError(
            f"sparse.host_tier_bytes {total} split over {ranks.processes} scheduler processes "
            f"(dp_size {ranks.dp_size} x tp_size {ranks.tp_size}) leaves {params.host_tier_bytes} "
            f"bytes each: {err}"
        ) from err
    cache.attach_runtime(runtime)
    for backend in dualdecoder_backends(getattr(ctx.tp_worker, "model_runner", None)):
        backend.attach_runtime(runtime)
    return cache


def register_radix_cache_backend() -> None:
    """Register ``dualdecoder`` with SGLang's radix-cache registry (idempotent)."""
    from sglang.srt.mem_cache.registry import register_radix_cache_backend as register
    from sglang.srt.mem_cache.registry import registered_radix_cache_backends

    if BACKEND_NAME not in registered_radix_cache_backends():
        register(BACKEND_NAME, create_dualdecoder_radix_cache)


REGISTRATIONS = [register_radix_cache_backend]
