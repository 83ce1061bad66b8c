"""Registration in ``sglang.srt.layers.attention.attention_registry`` (every SGLang process).

* ``add_attention_backend_choices`` (``sglang.srt.arg_groups.choices``): makes
  ``--attention-backend dualdecoder`` a valid SGLang flag value.
* ``register_attention_backend("dualdecoder")``: SGLang's model runner calls
  :func:`create_dualdecoder_backend` to build the backend.
"""

from __future__ import annotations

BACKEND_NAME = "dualdecoder"
#: SGLang symbols this module uses (checked by tests/test_patches.py).
SYMBOLS = (
    "sglang.srt.layers.attention.attention_registry.register_attention_backend",
    "sglang.srt.layers.attention.attention_registry.ATTENTION_BACKENDS",
    "sglang.srt.arg_groups.choices.add_attention_backend_choices",
    "sglang.srt.arg_groups.choices.ATTENTION_BACKEND_CHOICES",
)


def create_dualdecoder_backend(runner):
    """Factory SGLang calls with its ``ModelRunner``: dense delegate + sparse params from the preset.

    Raises:
        ValueError: ``--enable-mixed-chunk`` is set (a mixed batch would run dense
            attention over a sparse request's released positions).
    """
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.platforms import current_platform

    from dd_sglang.attention.backend import DualDecoderAttnBackend, SparseParams
    from dd_sglang.kvcache import sparse_runtime
    from dd_sglang.metrics.definitions import SPARSE_DECODE_ROWS
    from dd_sglang.plugin.runtime import current_config

    if getattr(runner.server_args, "enable_mixed_chunk", False):
        raise ValueError(
            "--attention-backend dualdecoder does not support --enable-mixed-chunk; drop that flag"
        )
    dense = ATTENTION_BACKENDS[current_platform.get_default_attention_backend()](runner)
    params = SparseParams(**current_config().sparse.model_dump())
    return DualDecoderAttnBackend(
        dense,
        runner.token_to_kv_pool,
        runner.req_to_token_pool.req_to_token,
        params,
        sparse_runtime.current,
        SPARSE_DECODE_ROWS.inc,
        _count_prefetch,
    )


def _count_prefetch(selector: str, layer: int, hits: int | None, lookups: int | None) -> None:
    from dd_sglang.metrics import definitions as m

    if hits is None:
        m.PREFETCH_COLD.labels(selector=selector).inc()
        return
    m.PREFETCH_HITS.labels(selector=selector).inc(hits)
    m.PREFETCH_LOOKUPS.labels(selector=selector).inc(lookups)
    m.PREFETCH_LAYER_HIT_RATE.labels(layer=str(layer)).observe(hits / lookups)


def register_attention_backend() -> None:
    """Add ``dualdecoder`` to SGLang's backend choices and registry (idempotent)."""
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    from sglang.srt.layers.attention.attention_registry import register_attention_backend as register

    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    register(BACKEND_NAME)(create_dualdecoder_backend)


REGISTRATIONS = [register_attention_backend]
