"""bench.gpu_check runs where SGLang is absent (it must not import it) and its accuracy harness
finds real errors: checked on the CPU with the PyTorch path (the GPU run is bench.gpu_check itself)."""

from __future__ import annotations

import subprocess
import sys

import torch

from bench.gpu_check import N_RES, make_step, part_accuracy
from dd_sglang.kernels.dispatch import SparseAttention


def test_gpu_check_imports_no_sglang():
    code = "import sys, bench.gpu_check; print(sorted(m for m in sys.modules if m.split('.')[0] == 'sglang'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _gen():
    return torch.Generator().manual_seed(3), torch.Generator().manual_seed(4)


def test_steps_are_shaped_like_the_ring():
    q, keys, values, mask, cap = make_step(4, 2, 3, 16, 10, torch.device("cpu"), torch.float32, _gen())
    n = N_RES + 10 + 1
    assert q.shape == (4, 2, 6, 16) and keys.shape == (4, 2, n, 16) and cap == n + 8
    assert keys.stride() == (2 * cap * 16, cap * 16, 16, 1)  # a view of a wider ring slot
    assert mask[:, 1, -1].tolist() == [True, False, True, False]  # speculated column, every other row
    assert not mask[:, 0, -1].any()
    k = mask[:, 0, N_RES : N_RES + 10].sum(-1)
    assert ((k >= 5) & (k <= 10)).all()


def test_accuracy_harness_passes_the_reference_and_catches_a_wrong_kernel():
    cpu, gen = torch.device("cpu"), _gen()
    att = SparseAttention(cpu, impl="torch")
    res = part_accuracy(att, cpu, torch.float32, [(2, 4, 16, 8), (1, 1, 16, 8)], 1e-5, float("inf"), gen)
    assert res["pass"] and res["configs_run"] == 2 and res["max_abs_err"] < 1e-5

    class Wrong(SparseAttention):  # drops the last query's result: must be caught
        def run(self, q, keys, values, scale):
            out = super().run(q, keys, values, scale).clone()
            out[:, :, -1] = 0
            return out

    res = part_accuracy(Wrong(cpu, impl="torch"), cpu, torch.float32, [(2, 4, 16, 8)], 1e-5, float("inf"), gen)
    assert not res["pass"] and res["max_abs_err"] > 1e-2
