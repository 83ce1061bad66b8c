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
    assert plugins.get("dd_sglang") == "patches:load"


def test_sglang_resolves_our_platform_here():
    """On this CUDA-less machine SGLang's own discovery picks the dd_sglang platform."""
    import torch
    from sglang.srt.platforms import _resolve_platform

    if torch.cuda.is_available():
        assert not _resolve_platform().is_out_of_tree()
    else:
        assert type(_resolve_platform()).__name__ == "TorchCpuPlatform"


def test_default_dtype_follows_native_bf16_instructions(tmp_path):
    from dd_sglang.platform.dtype import cpu_flags, default_dtype, native_bf16

    avx2 = frozenset({"sse4_2", "avx", "avx2", "fma"})
    assert default_dtype(avx2) == "float32" and not native_bf16(avx2)
    assert default_dtype(avx2 | {"avx512f", "avx512_bf16"}) == "bfloat16"
    assert default_dtype(avx2 | {"amx_tile", "amx_bf16"}) == "bfloat16"
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(str(info)) == frozenset({"fpu", "avx2", "avx512_bf16"})
    assert cpu_flags(str(tmp_path / "missing")) == frozenset()


def test_launcher_passes_the_cpu_dtype_unless_the_user_gave_one(monkeypatch, caplog):
    """On the CPU platform the launcher adds --dtype from the platform's choice, logged; a user's wins."""
    import logging

    from dd_sglang.launch_server import with_cpu_dtype
    from dd_sglang.platform import dtype as cpu_mod

    monkeypatch.setattr(cpu_mod, "cpu_flags", lambda cpuinfo="/proc/cpuinfo": frozenset({"avx2"}))
    with caplog.at_level(logging.INFO, logger="dd_sglang.launch_server"):
        assert with_cpu_dtype(["--port", "1"], cpu=True) == ["--port", "1", "--dtype", "float32"]
    assert "lacks native bf16" in caplog.text and "--dtype float32" in caplog.text
    assert with_cpu_dtype(["--dtype", "bfloat16"], cpu=True) == ["--dtype", "bfloat16"]
    assert with_cpu_dtype(["--dtype=half"], cpu=True) == ["--dtype=half"]
    assert with_cpu_dtype([], cpu=False) == []  # CUDA: SGLang's own default
    monkeypatch.setattr(cpu_mod, "cpu_flags", lambda cpuinfo="/proc/cpuinfo": frozenset({"amx_bf16"}))
    assert with_cpu_dtype([], cpu=True) == ["--dtype", "bfloat16"]
