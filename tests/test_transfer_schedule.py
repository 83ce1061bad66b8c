"""The layer ring and the layer-aware transfer schedule on the CPU, with real tensors and real threads.

Overlap is asserted from the schedule's recorded timestamps (copy time that ran
before attention started waiting), never from wall-clock thresholds.
"""

from __future__ import annotations

import threading

import pytest
import torch

from dd_sglang.kvcache.layer_buffers import LayerRingBuffer
from dd_sglang.prefetch.schedule import TransferSchedule

HKV, D, K = 3, 64, 256
LAYERS = 30


def test_ring_bytes_are_exact_and_bounded():
    ring = LayerRingBuffer(depth=2, device="cpu", dtype=torch.bfloat16)
    assert ring.nbytes == 0
    ring.reserve(rows=4, num_kv_heads=HKV, k=K, head_dim=D)
    bound = (2 + 1) * 4 * K * HKV * D * 2 * 2  # (w+1) x batch x k x kv_heads x head_dim x (K,V) x bf16
    assert ring.nbytes == bound
    ring.reserve(rows=2, num_kv_heads=HKV, k=128, head_dim=D)  # fits: kept, no reallocation
    assert ring.nbytes == bound and ring.allocations == 1
    ring.reserve(rows=5, num_kv_heads=HKV, k=K, head_dim=D)
    assert ring.nbytes == (2 + 1) * 5 * K * HKV * D * 2 * 2 and ring.allocations == 2
    k0, _ = ring.slot(0)
    k3, _ = ring.slot(3)
    assert k0.data_ptr() == k3.data_ptr()  # layer l uses slot l % (w+1)
    ring.release()
    assert ring.nbytes == 0 and ring.peak_bytes == (2 + 1) * 5 * K * HKV * D * 2 * 2


def test_bad_depth():
    with pytest.raises(ValueError, match="prefetch.depth must be >= 0"):
        LayerRingBuffer(depth=-1, device="cpu", dtype=torch.float32)


def _host(n=8192, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYERS, n, HKV, D, generator=g), torch.randn(LAYERS, n, HKV, D, generator=g)


@pytest.mark.parametrize("depth", [0, 2])
def test_copies_land_in_the_right_slot_and_overlap_compute(depth):
    host_k, host_v = _host()
    rows = 4
    idx = torch.randint(
        0, host_k.shape[1], (LAYERS, rows, HKV, K), generator=torch.Generator().manual_seed(1)
    )
    heads = torch.arange(HKV).unsqueeze(1)
    ring = LayerRingBuffer(depth, "cpu", torch.float32)
    ring.reserve(rows, HKV, K, D)
    steps = []
    sched = TransferSchedule(ring, on_step=steps.append)
    in_use: set[int] = set()
    lock = threading.Lock()

    def gather(layer, k_slot, v_slot):
        with lock:
            # The slot this copy writes is never one a layer is reading.
            assert layer % (depth + 1) not in {u % (depth + 1) for u in in_use}
        for r in range(rows):
            k_slot[r].copy_(host_k[layer][idx[layer, r], heads])
            v_slot[r].copy_(host_v[layer][idx[layer, r], heads])

    x = torch.randn(512, 512)
    for _ in range(2):
        sched.begin_step(list(range(LAYERS)), gather)
        for layer in range(LAYERS):
            for _ in range(3):  # "earlier layers compute"
                x = torch.tanh(x @ x) * 0.5
            k_slot, v_slot = sched.wait(layer)
            with lock:
                in_use.add(layer)
            for r in range(rows):
                assert torch.equal(k_slot[r], host_k[layer][idx[layer, r], heads])
                assert torch.equal(v_slot[r], host_v[layer][idx[layer, r], heads])
            with lock:
                in_use.discard(layer)
            sched.done(layer)
        sched.end_step()
    assert len(steps) == 2 and [t.layer for t in steps[-1]] == list(range(LAYERS))
    timings = steps[-1]
    assert all(t.copy_end >= t.copy_start > 0 and t.wait_end >= t.wait_start > 0 for t in timings)
    copy_s = sum(t.copy_s for t in timings)
    hidden_s = sum(t.hidden_s for t in timings)
    # Copy time that did not show up as wait: layers whose copy finished before attention asked.
    assert hidden_s > 0
    assert sum(t.copy_end <= t.wait_start for t in timings) > 0
    assert hidden_s <= copy_s


def test_copy_failure_reaches_the_forward_thread():
    ring = LayerRingBuffer(1, "cpu", torch.float32)
    ring.reserve(1, HKV, 4, D)
    sched = TransferSchedule(ring)

    def gather(layer, k_slot, v_slot):
        raise IndexError("bad host slot")

    sched.begin_step([0, 1], gather)
    with pytest.raises(RuntimeError, match="transfer worker failed"):
        sched.wait(0)


def test_selection_jobs_finish_before_the_next_step_copies():
    ring = LayerRingBuffer(1, "cpu", torch.float32)
    ring.reserve(1, HKV, 4, D)
    sched = TransferSchedule(ring)
    chosen = {}
    for layer in range(4):
        sched.submit_select(lambda layer=layer: chosen.__setitem__(layer, torch.full((HKV, 4), layer)))

    def gather(layer, k_slot, v_slot):
        k_slot[0].copy_(chosen[layer].float().unsqueeze(-1).expand(HKV, 4, D))

    sched.begin_step([0, 1, 2, 3], gather)  # drains the select worker first
    for layer in range(4):
        k_slot, _ = sched.wait(layer)
        assert torch.all(k_slot[0] == layer)
        sched.done(layer)
    sched.end_step()


def test_inline_selection_runs_on_the_calling_thread_before_submit_returns():
    ring = LayerRingBuffer(1, "cpu", torch.float32)
    sched = TransferSchedule(ring, select_inline=True)
    threads = []
    sched.submit_select(lambda: threads.append(threading.current_thread()))
    assert threads == [threading.current_thread()]  # done before submit_select returned
    worker = TransferSchedule(ring)
    worker.submit_select(lambda: threads.append(threading.current_thread()))
    worker.drain_select()
    assert threads[1].name == "dd-select"
