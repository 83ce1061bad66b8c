"""Every hook target exists in the pinned SGLang, and registration goes through HookRegistry."""

from __future__ import annotations

import pkgutil
from importlib.metadata import version

import pytest

import patches

PINNED_SGLANG = "0.5.23"


def test_pinned_sglang_version():
    assert version("sglang") == PINNED_SGLANG


@pytest.mark.parametrize("symbol", patches.all_symbols())
def test_hooked_symbol_exists(symbol):
    pkgutil.resolve_name(symbol)  # raises if sglang 0.5.23 lacks it


@pytest.mark.parametrize("hook", patches.all_hooks(), ids=lambda h: h.target)
def test_hook_target_is_callable(hook):
    assert callable(pkgutil.resolve_name(hook.target)), (
        f"{hook.target} is not callable in sglang {PINNED_SGLANG}"
    )


def test_dualdecoder_backend_registered():
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    patches.register_all()
    assert "dualdecoder" in ATTENTION_BACKEND_CHOICES
    assert ATTENTION_BACKENDS["dualdecoder"].__name__ == "create_dualdecoder_backend"


def test_dualdecoder_radix_cache_registered():
    from sglang.srt.mem_cache.registry import get_radix_cache_factory
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    from dd_sglang.kvcache.radix import DualDecoderRadixCache

    patches.register_all()
    assert get_radix_cache_factory("dualdecoder").__name__ == "create_dualdecoder_radix_cache"
    assert issubclass(DualDecoderRadixCache, UnifiedRadixCache)
    # The methods the subclass overrides exist on the parent with the signatures SGLang calls.
    import inspect

    for name, params in [("free_kv_row", ["kv", "ranges"]), ("on_release", ["req", "checkpointed"]),
                         ("match_prefix", ["params"]), ("reset", [])]:  # fmt: skip
        assert list(inspect.signature(getattr(UnifiedRadixCache, name)).parameters)[1:] == params


@pytest.mark.parametrize("hook", patches.all_hooks(), ids=lambda h: h.target)
def test_hook_named_after_symbol(hook):
    # Scheduler.on_idle -> Scheduler_on_idle
    symbol = "_".join(hook.target.split(".")[-2:])
    assert hook.fn.__name__ == symbol


def test_register_all_uses_hook_registry():
    from sglang.srt.plugins.hook_registry import HookRegistry

    saved = {k: list(v) for k, v in HookRegistry._hooks.items()}
    try:
        HookRegistry._hooks.clear()
        hooks = patches.register_all()
        for h in hooks:
            assert any(fn is h.fn for _, fn, _ in HookRegistry._hooks[h.target])
    finally:
        HookRegistry._hooks.clear()
        HookRegistry._hooks.update(saved)
