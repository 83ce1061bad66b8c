"""Process-wide state of dd_sglang inside an SGLang process.

The launcher passes the validated preset to every SGLang process through the
environment variable :data:`CONFIG_ENV` (JSON of :class:`dd_sglang.config.DDConfig`).
A process started without it (plain ``python -m sglang.launch_server`` with
dd_sglang installed) uses the default preset's values.
"""

from __future__ import annotations

import json
import logging
import os
from functools import cache

from dd_sglang.config import DDConfig, parse_config

logger = logging.getLogger(__name__)

CONFIG_ENV = "DD_SGLANG_CONFIG_JSON"
_failed_once = False


@cache
def current_config() -> DDConfig:
    """The preset this process was started with (validated; cached)."""
    raw = os.environ.get(CONFIG_ENV)
    if not raw:
        return DDConfig()
    return parse_config(json.loads(raw), f"${CONFIG_ENV}")


@cache
def request_limits() -> tuple[tuple[str, ...], int]:
    """What a request's ``custom_params`` overrides may name in this process: ``(selector names,
    largest dd_top_k)``, from the preset's ``sparse.request_selectors`` and ``sparse.request_max_top_k``
    (:class:`~dd_sglang.kvcache.params.SparseParams`); cached. The tokenizer manager checks a request
    with them (:func:`~dd_sglang.kvcache.params.request_overrides`), and the scheduler's runtime holds
    the same."""
    from dd_sglang.kvcache.params import SparseParams
    from dd_sglang.prefetch.selectors import SELECTORS

    params = SparseParams.from_config(current_config())
    return params.request_selector_names(tuple(SELECTORS)), params.request_top_k_max


@cache
def _scheduler_metrics(attn_tp_rank: int):
    from dd_sglang.metrics.scheduler_stats import SchedulerMetrics

    return SchedulerMetrics(current_config().metrics.update_interval_s, report_requests=attn_tp_rank == 0)


@cache
def _register_rank() -> None:
    """Once per scheduler process: record its DP/TP rank for the sidecar (:mod:`dd_sglang.metrics.ranks`)."""
    from dd_sglang.kvcache.ranks import current_ranks
    from dd_sglang.metrics.ranks import register_process

    ranks = current_ranks()
    register_process(os.environ.get("PROMETHEUS_MULTIPROC_DIR"), ranks.dp_rank, ranks.tp_rank)


def refresh_scheduler_metrics(scheduler, force: bool = False) -> None:
    """Publish the scheduler's device-tier gauges; never raises into SGLang."""
    global _failed_once
    try:
        _register_rank()
        rank = int(getattr(scheduler, "attn_tp_rank", getattr(scheduler, "tp_rank", 0)) or 0)
        _scheduler_metrics(rank).maybe_update(scheduler, force=force)
    except Exception:  # a metrics bug must not stop serving
        if not _failed_once:
            _failed_once = True
            logger.exception("dd_sglang: scheduler metrics update failed (logged once)")
