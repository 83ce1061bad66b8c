"""The C kernels must build where the project runs: a compile error in ``cpu_select.c`` fails the
suite instead of turning the native tests into skips and the server's selection into PyTorch's."""

from __future__ import annotations

import os
import platform
import shutil

import pytest

from dd_sglang.kernels import native, native_build


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which(os.environ.get("CC") or "cc") is None,
                    reason="the build is required on x86-64 with a C compiler (CI's and the developers' machines)")  # fmt: skip
def test_the_c_kernels_build_and_load_on_x86_64(tmp_path):
    """A fresh build of ``cpu_select.c`` for this CPU (compiler errors raise with their message) and
    the process's loaded kernel (what the server's selection and these tests use)."""
    lib = native_build.build(tmp_path)
    assert lib.is_file() and lib.stat().st_size > 0
    assert native.available(), native.unavailable_reason()
