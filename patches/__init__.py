"""Every hook dd_sglang places into SGLang, and nothing else.

Each module here is named after the SGLang module it touches
(``managers_scheduler`` -> ``sglang.srt.managers.scheduler``) and lists its
hooks in ``HOOKS`` (wrappers applied by ``HookRegistry``; each hook function is
named after the SGLang symbol it wraps: ``Scheduler_on_idle`` ->
``Scheduler.on_idle``) and/or calls of SGLang's own registries in
``REGISTRATIONS`` (functions named after the registry function they call,
with the SGLang symbols they use in ``SYMBOLS``). Modules only wire: the logic
they call lives in ``dd_sglang``.

:func:`register_all` hands every hook to SGLang's ``HookRegistry``; SGLang's
``load_plugins()`` applies them in each process it starts (HTTP server,
tokenizer manager, scheduler, detokenizer), through the general-plugin entry
point :func:`load` (``pyproject.toml``: ``sglang.srt.plugins``, ``dd_sglang = "patches:load"``),
which SGLang calls in each of them. Nothing in ``dd_sglang`` imports this package: the wiring
points at ``dd_sglang``, never back. Set ``SGLANG_PLUGINS`` to a list without ``dd_sglang`` to
run SGLang without it. ``tests/test_patches.py`` asserts every target exists in the pinned SGLang.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

#: Hook modules, in registration order.
MODULES = (
    "patches.managers_scheduler",
    "patches.managers_tp_worker",
    "patches.managers_schedule_policy",
    "patches.managers_schedule_batch",
    "patches.layers_attention_attention_registry",
    "patches.mem_cache_registry",
    "patches.sampling_sampling_params",
    "patches.layers_logits_processor",
    "patches.layers_sampler",
    "patches.managers_tokenizer_manager",
    "patches.managers_io_struct",
    "patches.entrypoints_http_server",
    "patches.layers_quantization_unquant",
    "patches.managers_scheduler_components_weight_updater",
)


@dataclass(frozen=True)
class Hook:
    """One hook: ``target`` is SGLang's dotted path, ``kind`` a ``HookType`` name."""

    target: str
    fn: Callable
    kind: str = "AFTER"


def all_hooks() -> list[Hook]:
    """Every :class:`Hook` of every module in :data:`MODULES`."""
    hooks: list[Hook] = []
    for name in MODULES:
        hooks.extend(getattr(importlib.import_module(name), "HOOKS", []))
    return hooks


def all_symbols() -> list[str]:
    """Every SGLang symbol a module of :data:`MODULES` hooks or uses."""
    symbols = [h.target for h in all_hooks()]
    for name in MODULES:
        symbols.extend(getattr(importlib.import_module(name), "SYMBOLS", ()))
    return symbols


def load() -> None:
    """SGLang's general-plugin entry point: register dd_sglang's hooks with SGLang's ``HookRegistry``
    (:func:`register_all`), once per process (SGLang's ``load_plugins()`` then applies them)."""
    if getattr(load, "_done", False):
        return
    hooks = register_all()
    load._done = True
    logging.getLogger(__name__).info("dd_sglang: registered %d SGLang hooks", len(hooks))


def register_all() -> list[Hook]:
    """Register all hooks with ``sglang.srt.plugins.hook_registry.HookRegistry`` and run
    every module's ``REGISTRATIONS``.

    Returns the hooks registered. Raises ``KeyError`` for an unknown ``kind``.
    """
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    hooks = all_hooks()
    for hook in hooks:
        HookRegistry.register(hook.target, hook.fn, HookType[hook.kind])
    for name in MODULES:
        for register in getattr(importlib.import_module(name), "REGISTRATIONS", []):
            register()
    return hooks
