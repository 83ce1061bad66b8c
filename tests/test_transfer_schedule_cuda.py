"""The transfer schedule's CUDA branch: pinned host tier -> device ring on a copy stream, per-layer
CUDA events, slot reuse ordered after the compute stream's reads; and the sparse decode kernel on
the GPU against the CPU reference. Skipped without CUDA (CI and the development machines have none).
"""

from __future__ import annotations

import pytest
import torch

from dd_sglang.kernels.sparse_decode import fold_gqa, sparse_decode_attention
from dd_sglang.kvcache.layer_buffers import LayerRingBuffer
from dd_sglang.prefetch.index import KeyBlockIndex
from dd_sglang.prefetch.schedule import TransferSchedule
from dd_sglang.prefetch.scoring import row_blocks
from dd_sglang.prefetch.selectors import make_selector

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")

HKV, HQ, D, K, LAYERS, ROWS = 8, 32, 128, 2048, 32, 4


def test_cuda_copies_land_and_overlap_compute():
    g = torch.Generator().manual_seed(0)
    host_k = torch.randn(LAYERS, 65536, HKV, D, generator=g).to(torch.bfloat16).pin_memory()
    host_v = torch.randn(LAYERS, 65536, HKV, D, generator=g).to(torch.bfloat16).pin_memory()
    idx = torch.randint(0, 65536, (LAYERS, ROWS, HKV, K), generator=g)
    heads = torch.arange(HKV).unsqueeze(1)
    ring = LayerRingBuffer(2, "cuda", torch.bfloat16)
    ring.reserve(ROWS, HKV, K, D)
    assert ring.nbytes == 3 * ROWS * HKV * K * D * 2 * 2
    steps = []
    sched = TransferSchedule(ring, on_step=steps.append)

    def gather(layer, k_slot, v_slot):
        for r in range(ROWS):
            k_slot[r].copy_(host_k[layer][idx[layer, r], heads].pin_memory(), non_blocking=True)
            v_slot[r].copy_(host_v[layer][idx[layer, r], heads].pin_memory(), non_blocking=True)

    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        sched.begin_step(list(range(LAYERS)), gather)
        checks = []
        for layer in range(LAYERS):
            for _ in range(4):  # earlier layers' compute on the default stream
                x = torch.tanh(x @ x) * 0.5
            k_slot, v_slot = sched.wait(layer)
            # Read on the compute stream (ordered after the copy by the layer's event).
            checks.append(
                (layer, k_slot[:, :, :8].float().sum().item(), v_slot[:, :, :8].float().sum().item())
            )
            sched.done(layer)
        torch.cuda.synchronize()
    for layer, ks, vs in checks:
        want_k = sum(host_k[layer][idx[layer, r], heads][:, :8].float().sum().item() for r in range(ROWS))
        want_v = sum(host_v[layer][idx[layer, r], heads][:, :8].float().sum().item() for r in range(ROWS))
        assert ks == pytest.approx(want_k, rel=1e-3, abs=1e-2) and vs == pytest.approx(
            want_v, rel=1e-3, abs=1e-2
        )
    timings = steps[-1]
    assert [t.layer for t in timings] == list(range(LAYERS))
    assert sum(t.hidden_s for t in timings) > 0


def test_sparse_decode_on_cuda_matches_cpu():
    g = torch.Generator().manual_seed(1)
    r, n = 3, 4096
    q = fold_gqa(torch.randn(r, 2, HQ, D, generator=g).to(torch.bfloat16), HKV)
    keys = torch.randn(r, HKV, n, D, generator=g).to(torch.bfloat16)
    values = torch.randn(r, HKV, n, D, generator=g).to(torch.bfloat16)
    mask = torch.rand(r, 1, q.shape[2], n, generator=g) < 0.5
    cpu = sparse_decode_attention(q, keys, values, mask, D**-0.5)
    gpu = sparse_decode_attention(q.cuda(), keys.cuda(), values.cuda(), mask.cuda(), D**-0.5)
    torch.testing.assert_close(gpu.cpu().float(), cpu.float(), atol=2e-2, rtol=2e-2)


def test_quest_device_index_on_cuda_selects_what_the_cpu_index_selects():
    g = torch.Generator().manual_seed(2)
    host_k = torch.randn(2, 5120, HKV, D, generator=g)
    slots = torch.arange(5120)
    rows = row_blocks([slots], [4], [5000], [torch.arange(4)])
    q = torch.randn(1, HQ, D, generator=g)
    picked = []
    for device in ("cpu", "cuda"):
        idx = KeyBlockIndex(host_k, device)
        idx.update(slots, 0, 5120)
        picked.append(make_selector("quest_device").select(q, rows, host_k[1], 256, D**-0.5, idx, 1)[0])
    assert torch.equal(picked[0].sort(dim=-1).values, picked[1].sort(dim=-1).values)
