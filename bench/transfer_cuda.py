"""Transfer-schedule microbenchmark on a GPU: how much of the critical-set copy the schedule hides.

Usage (needs CUDA; nothing of SGLang)::

    python -m bench.transfer_cuda [--out bench/results/transfer_h200.json]

A Llama-3.1-8B-shaped decode step without the model: 32 layers, 8 KV heads,
head_dim 128, bf16, ``--rows`` sparse requests with a critical set of ``--k``
tokens per layer and KV head, gathered from a pinned host tier of
``--host-tokens`` tokens at random positions. Each layer's "compute" is
``--matmuls`` bf16 products of a 4096 x 4096 matrix on the default stream (a
stand-in for the layer's work). Compared, same data, one process:

* ``inline``: each layer gathers and copies its critical set itself, then computes;
* ``schedule depth w`` (w = 0, 1, 2, 4): :class:`dd_sglang.prefetch.schedule.TransferSchedule`
  with a ring of w + 1 layer slots, the copy worker gathering on the host and
  copying on its own stream.

Reported per configuration: median step time (CUDA events around the step),
and from the schedule's timestamps the summed copy time, exposed wait and
hidden copy time per step.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from dd_sglang.kvcache.layer_buffers import LayerRingBuffer
from dd_sglang.prefetch.schedule import TransferSchedule

LAYERS, HKV, D = 32, 8, 128


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.transfer_cuda", description=__doc__)
    ap.add_argument("--out", default="bench/results/transfer_h200.json")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--host-tokens", type=int, default=32768)
    ap.add_argument("--matmuls", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.transfer_cuda needs CUDA")
    g = torch.Generator().manual_seed(0)
    host_k = torch.empty(LAYERS, args.host_tokens, HKV, D, dtype=torch.bfloat16).pin_memory()
    host_v = torch.empty_like(host_k).pin_memory()
    host_k.normal_(generator=g)
    host_v.normal_(generator=g)
    idx = torch.randint(0, args.host_tokens, (LAYERS, args.rows, HKV, args.k), generator=g)
    heads = torch.arange(HKV).unsqueeze(1)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

    def compute(x):
        for _ in range(args.matmuls):
            x = torch.tanh(x @ w)
        return x

    def gather_host(layer):
        return [
            (host_k[layer][idx[layer, r], heads], host_v[layer][idx[layer, r], heads])
            for r in range(args.rows)
        ]

    def gather(layer, k_slot, v_slot):
        for r, (kk, vv) in enumerate(gather_host(layer)):
            k_slot[r].copy_(kk, non_blocking=True)
            v_slot[r].copy_(vv, non_blocking=True)

    def median_step_ms(layer_step, begin=None) -> float:
        """Median over steps (the first is warm-up) of one decode step: ``begin()``, then per layer
        the compute stand-in followed by ``layer_step(layer, x)``; timed with CUDA events."""
        nonlocal x
        times = []
        for _ in range(args.steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            if begin is not None:
                begin()
            for layer in range(LAYERS):
                x = layer_step(layer, compute(x))
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return round(statistics.median(times[1:]), 3)

    # inline: gather + copy on the compute stream after the layer's compute.
    inline_ring = LayerRingBuffer(0, "cuda", torch.bfloat16)
    inline_ring.reserve(args.rows, HKV, args.k, D)

    def inline_step(layer, x):
        k_slot, v_slot = inline_ring.slot(layer)
        gather(layer, k_slot, v_slot)
        return x + k_slot[0, 0, 0, 0]  # the layer reads its critical set

    results = {
        "inline": {"step_ms": median_step_ms(inline_step)},
        "compute_only": {"step_ms": median_step_ms(lambda layer, x: x)},  # the floor
    }
    for depth in (0, 1, 2, 4):
        ring = LayerRingBuffer(depth, "cuda", torch.bfloat16)
        ring.reserve(args.rows, HKV, args.k, D)
        steps = []
        sched = TransferSchedule(ring, on_step=steps.append)

        def scheduled_step(layer, x, sched=sched):
            k_slot, _ = sched.wait(layer)
            x = x + k_slot[0, 0, 0, 0]
            sched.done(layer)
            return x

        step_ms = median_step_ms(
            scheduled_step, lambda sched=sched: sched.begin_step(list(range(LAYERS)), gather)
        )
        last = steps[-1]
        results[f"schedule_depth_{depth}"] = {
            "step_ms": step_ms,
            "ring_bytes": ring.nbytes,
            "copy_ms_per_step": round(1e3 * sum(t.copy_s for t in last), 3),
            "exposed_wait_ms_per_step": round(1e3 * sum(t.wait_s for t in last), 3),
            "hidden_copy_ms_per_step": round(1e3 * sum(t.hidden_s for t in last), 3),
        }
    out = {
        "benchmark": "layer-aware transfer schedule on a GPU (no model: matmul stand-in per layer)",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shape": {"layers": LAYERS, "kv_heads": HKV, "head_dim": D, "rows": args.rows, "k": args.k,
                  "bytes_per_layer": 2 * args.rows * HKV * args.k * D * 2, "host_tokens": args.host_tokens},
        "results": results,
    }  # fmt: skip
    from bench.machine import provenance  # no SGLang import: this runs on a host without it

    out = {"provenance": provenance(dtype="bfloat16"), **out}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
