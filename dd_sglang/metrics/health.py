"""How long the sidecar's ``/healthz`` waits for SGLang's ``/health``, from SGLang's own setting.

Light on purpose (``os`` only): the launcher checks the setting before anything heavy is imported.
"""

from __future__ import annotations

import os

#: SGLang's default for ``SGLANG_HEALTH_CHECK_TIMEOUT`` (``sglang/srt/entrypoints/http_server.py``): the
#: seconds its ``/health`` waits for the scheduler before answering 503 itself.
SGLANG_HEALTH_CHECK_TIMEOUT_DEFAULT_S = 20


def health_wait_s(environ: dict[str, str] | None = None) -> float:
    """Seconds ``/healthz`` waits for SGLang's ``/health``: SGLang's own bound on that route
    (``SGLANG_HEALTH_CHECK_TIMEOUT`` from ``environ``, default :data:`os.environ`, as SGLang reads it; 20
    when unset) plus 1 s, so that a slow but healthy SGLang answers before the sidecar gives up and one
    variable sets both. Raises ``ValueError`` naming the variable when it is not a positive integer."""
    raw = (os.environ if environ is None else environ).get("SGLANG_HEALTH_CHECK_TIMEOUT")
    if raw is None:
        return SGLANG_HEALTH_CHECK_TIMEOUT_DEFAULT_S + 1.0
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"SGLANG_HEALTH_CHECK_TIMEOUT must be a positive integer (seconds), got {raw!r}")
    return value + 1.0
