"""Hook on ``sglang.srt.entrypoints.http_server`` (the HTTP server's process).

* ``_setup_and_run_http_server`` (BEFORE): before uvicorn starts serving
  SGLang's FastAPI ``app``, add :class:`dd_sglang.plugin.http_limits.RequestSizeLimit`
  with the preset's ``server.max_request_bytes``: a body over it gets HTTP 413
  instead of being read and tokenized (SGLang 0.5.23 has no limit; a 64 MiB
  prompt got its HTTP server OOM-killed). Single-tokenizer mode only (the
  default), as SGLang's own API-key middleware.
"""

from __future__ import annotations

from patches import Hook

_MODULE = "sglang.srt.entrypoints.http_server"
#: SGLang symbols this module uses (checked by tests/test_patches.py).
SYMBOLS = (f"{_MODULE}.app",)


def http_server__setup_and_run_http_server(*args, **kwargs):
    from sglang.srt.entrypoints import http_server

    from dd_sglang.plugin.http_limits import RequestSizeLimit
    from dd_sglang.plugin.runtime import current_config

    http_server.app.add_middleware(RequestSizeLimit, max_bytes=current_config().server.max_request_bytes)


HOOKS = [Hook(f"{_MODULE}._setup_and_run_http_server", http_server__setup_and_run_http_server, "BEFORE")]
