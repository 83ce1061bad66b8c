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
    "sglang.srt.configs.model_config.ModelConfig.get_max_num_attention_heads",
    "sglang.srt.runtime_context.get_parallel",
    "sglang.srt.mem_cache.kv_index_translator.KVIndexTranslator.own_plan",
    "sglang.srt.mem_cache.kv_loc_plan.KVLocPlan.bind",
)


def create_dualdecoder_backend(runner):
    """Factory SGLang calls with its ``ModelRunner``: dense delegate + sparse params from the preset, the
    model's query heads on this rank and the runner's KV index translator (the dense sub-batch's plan).

    Raises:
        ValueError: ``--enable-mixed-chunk`` is set (a mixed batch would run dense
            attention over a sparse request's released positions).
    """
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.platforms import current_platform
    from sglang.srt.runtime_context import get_parallel

    from dd_sglang.attention.backend import DualDecoderAttnBackend, PrefetchParams, SparseParams
    from dd_sglang.metrics.backend_events import MetricsEvents
    from dd_sglang.plugin.runtime import current_config

    if getattr(runner.server_args, "enable_mixed_chunk", False):
        raise ValueError(
            "--attention-backend dualdecoder does not support --enable-mixed-chunk; drop that flag"
        )
    dense = ATTENTION_BACKENDS[current_platform.get_default_attention_backend()](runner)
    cfg = current_config()
    return DualDecoderAttnBackend(
        dense,
        runner.token_to_kv_pool,
        runner.req_to_token_pool.req_to_token,
        SparseParams.from_config(cfg),
        None,  # the SparseRuntime: handed over by the radix-cache factory (patches/mem_cache_registry.py)
        PrefetchParams.from_config(cfg),
        MetricsEvents(),
        q_heads=runner.model_config.get_max_num_attention_heads() // get_parallel().attn_tp_size,
        kv_index_translator=getattr(runner, "kv_index_translator", None),
    )


def register_attention_backend() -> None:
    """Add ``dualdecoder`` to SGLang's backend choices and registry (idempotent)."""
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    from sglang.srt.layers.attention.attention_registry import register_attention_backend as register

    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    register(BACKEND_NAME)(create_dualdecoder_backend)


REGISTRATIONS = [register_attention_backend]
