"""The CPU platform's prepacked bfloat16 linear layers (:mod:`dd_sglang.platform.linear`):
the same bits as ``F.linear``, and packed again whenever the weight may have changed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dd_sglang.platform import linear

pytestmark = pytest.mark.skipif(
    not linear.prepack_enabled(), reason="oneDNN bfloat16 is not supported on this CPU (packing stays off)"
)


class _Layer(torch.nn.Module):
    def __init__(self, out_features: int, in_features: int, dtype=torch.bfloat16, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        w = (torch.randn(out_features, in_features, generator=g) * 0.05).to(dtype)
        self.weight = torch.nn.Parameter(w, requires_grad=False)


@pytest.mark.parametrize("shape", [(1728, 576), (576, 1536), (64, 64)])
@pytest.mark.parametrize("rows", [1, 2, 17, 32])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_product_has_the_bits_of_f_linear(shape, rows, with_bias):
    layer = _Layer(*shape)
    g = torch.Generator().manual_seed(rows)
    bias = torch.randn(shape[0], generator=g).bfloat16() if with_bias else None
    x = torch.randn(rows, shape[1], generator=g).bfloat16()
    with torch.inference_mode():
        got = linear.packed_linear(layer, x, bias)
        assert got is not None
        assert torch.equal(got, F.linear(x, layer.weight, bias))
        x3 = torch.randn(1, rows, shape[1], generator=g).bfloat16()  # [batch, rows, in]
        assert torch.equal(linear.packed_linear(layer, x3, bias), F.linear(x3, layer.weight, bias))
        xs = torch.randn(rows, 2 * shape[1], generator=g).bfloat16()[:, ::2]  # strided input
        assert torch.equal(linear.packed_linear(layer, xs, bias), F.linear(xs, layer.weight, bias))


def test_products_of_more_rows_keep_f_linear():
    x = torch.randn(linear.PACK_MAX_ROWS + 1, 128).bfloat16()
    with torch.inference_mode():
        assert linear.packed_linear(_Layer(64, 128), x, None) is None
        assert linear.packed_linear(_Layer(64, 128), x[: linear.PACK_MAX_ROWS], None) is not None


def test_a_weight_update_is_packed_again():
    layer = _Layer(256, 128)
    x = torch.randn(2, 128).bfloat16()
    with torch.inference_mode():
        before = linear.packed_linear(layer, x, None)
    layer.weight.data.mul_(2)  # how SGLang's loaders write: no version counter sees it
    linear.invalidate_packs()  # what the weight-updater hooks call after every update
    with torch.inference_mode():
        after = linear.packed_linear(layer, x, None)
    assert torch.equal(after, F.linear(x, layer.weight))
    assert not torch.equal(after, before)
    layer.weight = torch.nn.Parameter(_Layer(256, 128, seed=1).weight.data, requires_grad=False)  # a new tensor
    with torch.inference_mode():
        assert torch.equal(linear.packed_linear(layer, x, None), F.linear(x, layer.weight))


def test_other_layers_keep_f_linear(monkeypatch):
    x = torch.randn(2, 128).bfloat16()
    assert linear.packed_linear(_Layer(64, 128, dtype=torch.float32), x.float(), None) is None
    assert linear.packed_linear(_Layer(64, 128), x.float(), None) is None  # float32 input
    amx = _Layer(64, 128)
    amx.use_intel_amx_backend = True  # SGLang's own AMX path: its weight is already in VNNI layout
    assert linear.packed_linear(amx, x, None) is None
    grad = _Layer(64, 128)
    grad.weight.requires_grad_(True)
    assert linear.packed_linear(grad, x, None) is None
    assert linear.packed_linear(_Layer(64, 128), x, torch.zeros(64)) is None  # float32 bias
    monkeypatch.setattr(linear, "_ENABLED", False)  # DD_SGLANG_CPU_PREPACK=0
    assert linear.packed_linear(_Layer(64, 128), x, None) is None


def test_a_pack_that_is_not_exact_is_not_used(monkeypatch, caplog):
    monkeypatch.setattr(linear, "_probed", {})
    monkeypatch.setattr(linear, "_exact", lambda *a: False)
    with torch.inference_mode():
        assert linear.packed_linear(_Layer(64, 128), torch.randn(2, 128).bfloat16(), None) is None
    assert "keeping F.linear" in caplog.text


def test_the_environment_switch_turns_packing_off(monkeypatch):
    monkeypatch.setenv(linear.PREPACK_ENV, "0")
    assert linear.prepack_enabled() is False
    monkeypatch.setenv(linear.PREPACK_ENV, "1")
    assert linear.prepack_enabled() is True


def test_the_probe_runs_once_per_shape_bias_and_threads(monkeypatch):
    monkeypatch.setattr(linear, "_probed", {})
    calls = []
    real = linear._exact
    monkeypatch.setattr(linear, "_exact", lambda w, p, b: calls.append((tuple(w.shape), b is None)) or real(w, p, b))
    x = torch.randn(3, 128).bfloat16()
    with torch.inference_mode():
        for seed in range(3):  # three weights of one shape: one probe, every product still exact
            layer = _Layer(64, 128, seed=seed)
            assert torch.equal(linear.packed_linear(layer, x, None), F.linear(x, layer.weight))
        bias = torch.randn(64).bfloat16()
        assert torch.equal(linear.packed_linear(_Layer(64, 128, seed=5), x, bias), F.linear(x, _Layer(64, 128, seed=5).weight, bias))
        assert linear.packed_linear(_Layer(32, 128), x, None) is not None
    assert calls == [((64, 128), True), ((64, 128), False), ((32, 128), True)]
    # a failed probe keeps F.linear for every weight of that kind, without probing again
    monkeypatch.setattr(linear, "_probed", {((16, 128), False, torch.get_num_threads()): False})
    with torch.inference_mode():
        assert linear.packed_linear(_Layer(16, 128), x, None) is None
    assert len(calls) == 3


def test_a_thread_count_not_probed_yet_is_probed_before_the_pack_is_used(monkeypatch):
    """A pack made and probed on one thread count is not used on another before that count's probe
    passes (a split CPU step runs its forward on 1 thread): a failing verdict there keeps F.linear."""
    monkeypatch.setattr(linear, "_probed", {})
    layer, x = _Layer(48, 128), torch.randn(2, 128).bfloat16()
    with torch.inference_mode():
        assert torch.equal(linear.packed_linear(layer, x, None), F.linear(x, layer.weight))
        here = torch.get_num_threads()
        assert list(linear._probed) == [((48, 128), False, here)]
        monkeypatch.setattr(linear, "_exact", lambda *a: False)  # the other count's probe fails
        monkeypatch.setattr(linear.torch, "get_num_threads", lambda: here + 1)
        assert linear.packed_linear(layer, x, None) is None
        assert linear._probed[((48, 128), False, here + 1)] is False
        monkeypatch.setattr(linear.torch, "get_num_threads", lambda: here)
        assert torch.equal(linear.packed_linear(layer, x, None), F.linear(x, layer.weight))  # still packed here


def test_row_buckets_are_eight_sizes_an_octave_with_at_most_an_eighth_padding():
    """Hand-computed buckets: decode-sized products keep their rows; above 32 rows a product runs at
    the next multiple of an eighth of its octave's lower bound; 33-4,096 rows take 56 sizes."""
    assert [linear.bucket_rows(n) for n in (1, 32, 33, 36, 37, 64, 65, 100, 129, 257, 1000, 2049, 4096)] == [
        1, 32, 36, 36, 40, 64, 72, 104, 144, 288, 1024, 2304, 4096]  # fmt: skip
    sizes = {linear.bucket_rows(n) for n in range(33, 4097)}
    assert len(sizes) == 56
    assert all(n <= linear.bucket_rows(n) <= n * 9 / 8 for n in range(33, 20_000))


@pytest.mark.parametrize("rows", [33, 100, 257, 1000])
def test_a_bucketed_product_runs_padded_rows_and_returns_the_real_ones(rows):
    """The product is called once on zero-padded rows of the bucket's size; the real rows come back
    in ``x``'s leading shape, equal to F.linear's within bfloat16 rounding (oneDNN may block the padded
    count differently), and the padding rows are zero in and out."""
    layer = _Layer(96, 64)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(1, rows, 64, generator=g).bfloat16()
    seen = []

    def run(xp):
        seen.append(xp.clone())
        return F.linear(xp, layer.weight)

    with torch.inference_mode():
        got = linear.bucketed_linear(layer, x, run)
        ref = F.linear(x, layer.weight)
    assert got.shape == (1, rows, 96)
    assert len(seen) == 1 and seen[0].shape == (linear.bucket_rows(rows), 64)
    assert torch.equal(seen[0][:rows], x[0]) and not seen[0][rows:].any()
    torch.testing.assert_close(got.float(), ref.float(), rtol=1.6e-2, atol=1e-2)


def test_bucketing_leaves_other_products_alone(monkeypatch):
    """Decode-sized rows, rows already a bucket, float32, and the switch off: None (the caller runs its
    own product unpadded)."""
    layer = _Layer(96, 64)
    never = lambda xp: pytest.fail("run was called")  # noqa: E731
    with torch.inference_mode():
        assert linear.bucketed_linear(layer, torch.randn(32, 64).bfloat16(), never) is None
        assert linear.bucketed_linear(layer, torch.randn(1024, 64).bfloat16(), never) is None
        assert linear.bucketed_linear(_Layer(96, 64, torch.float32), torch.randn(100, 64), never) is None
        monkeypatch.setattr(linear, "_BUCKETS", False)
        assert linear.bucketed_linear(layer, torch.randn(100, 64).bfloat16(), never) is None


_GROWTH_SCRIPT = r"""
import random, sys, torch, torch.nn.functional as F
from dd_sglang.platform import linear

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) * 1024

class L(torch.nn.Module):
    def __init__(self, o, i):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(o, i).bfloat16(), requires_grad=False)

layers = [L(960, 576), L(576, 576), L(3072, 576), L(576, 1536)]  # SmolLM2's four weight shapes
rng = random.Random(0)
marks = []
with torch.inference_mode():
    for phase in range(2):
        for _ in range(int(sys.argv[1])):
            rows = rng.randint(33, int(sys.argv[2]))
            for layer in layers:
                x = torch.randn(rows, layer.weight.shape[1]).bfloat16()
                out = linear.bucketed_linear(layer, x, lambda xp, w=layer.weight: F.linear(xp, w))
                if out is None:
                    F.linear(x, layer.weight)
        marks.append(rss())
print(marks[1] - marks[0])
"""


def test_new_prefill_lengths_stop_growing_memory_with_row_buckets():
    """The mechanism of issue 52, without SGLang: SmolLM2's four bfloat16 products at a random row
    count each step (33-1,024 rows: the last prefill chunk of prompts of every length), with the
    launcher's cache caps (256 entries). After 300 steps fill the caches, 300 more add at most
    32 MiB with the row buckets (+10.3 MiB measured on the Intel AMX host this was written on).
    Without them (``DD_SGLANG_CPU_ROW_BUCKETS=0``, which this test honours) each new row count
    builds primitives that evict others, and the freed memory is kept: +81 MiB over the same 300
    steps there, which fails here."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "256", "LRU_CACHE_CAPACITY": "256"}
    r = subprocess.run([sys.executable, "-c", _GROWTH_SCRIPT, "300", "1024"], env=env, capture_output=True,
                       text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    grown = int(r.stdout.split()[-1]) / 2**20
    print(f"RSS growth over the second 300 steps: {grown:.1f} MiB")
    assert grown <= 32, f"{grown:.1f} MiB over 300 new-length steps (row buckets {linear._BUCKETS})"
