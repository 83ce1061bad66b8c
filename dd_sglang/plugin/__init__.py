"""SGLang general plugin (entry point group ``sglang.srt.plugins``).

SGLang calls :func:`load` in every process it starts (``load_plugins()`` in
``sglang/launch_server.py``, ``managers/scheduler.py``,
``managers/detokenizer_manager.py``, ...), then applies the registered hooks
with ``HookRegistry.apply_hooks()``. ``load`` registers every hook listed in
the top-level ``patches`` package. Later layers (the ``dualdecoder``
attention backend, the host-tier pool) are registered from here too.

Set ``SGLANG_PLUGINS`` to a list without ``dd_sglang`` to run SGLang without it.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def load() -> None:
    """Register dd_sglang's hooks with SGLang's ``HookRegistry`` (idempotent per process)."""
    import patches

    if getattr(load, "_done", False):
        return
    hooks = patches.register_all()
    load._done = True
    logger.info("dd_sglang: registered %d SGLang hooks", len(hooks))
