"""The CPU platform plugin: active only without CUDA; registered as SGLang entry points."""

from __future__ import annotations

import pkgutil
from importlib.metadata import entry_points

import dd_sglang.platform as plat


def test_inactive_when_cuda_available(monkeypatch):
    monkeypatch.setattr(plat, "cuda_available", lambda: True)
    assert plat.activate() is None


def test_active_without_cuda(monkeypatch):
    monkeypatch.setattr(plat, "cuda_available", lambda: False)
    assert plat.activate() == "dd_sglang.platform.cpu.TorchCpuPlatform"


def test_platform_class_is_an_out_of_tree_srt_platform():
    from sglang.srt.platforms.interface import SRTPlatform

    cls = pkgutil.resolve_name(plat.PLATFORM_CLASS)
    assert issubclass(cls, SRTPlatform)
    p = cls()
    assert p.is_out_of_tree()
    assert p.get_default_attention_backend() == "torch_native"
    assert str(p.get_device()) == "cpu"
    assert p.is_pin_memory_available() is False


def test_entry_points_are_installed():
    platforms = {ep.name: ep.value for ep in entry_points(group="sglang.srt.platforms")}
    plugins = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert platforms.get("dd_sglang_cpu") == "dd_sglang.platform:activate"
    assert plugins.get("dd_sglang") == "dd_sglang.plugin:load"


def test_sglang_resolves_our_platform_here():
    """On this CUDA-less machine SGLang's own discovery picks the dd_sglang platform."""
    import torch
    from sglang.srt.platforms import _resolve_platform

    if torch.cuda.is_available():
        assert not _resolve_platform().is_out_of_tree()
    else:
        assert type(_resolve_platform()).__name__ == "TorchCpuPlatform"
