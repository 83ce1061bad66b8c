"""One layer's extend attention after a cached prefix: SGLang's ``torch_native`` against the ``dualdecoder`` backend's.

SGLang's ``TorchNativeAttnBackend._run_sdpa_forward_extend`` recomputes every cached prefix token's
query; :func:`dd_sglang.kernels.extend.prefix_extend_attention` starts at an aligned row and gives
the same output bits (module docstring there). This bench times both on the same tensors, one
request per call, SmolLM2-135M's head layout (9 query heads, 3 KV heads, head_dim 64), bfloat16,
over a pool with the request's positions on shuffled slots (as SGLang's allocator leaves them),
and checks in every cell that the outputs are equal bit for bit. The two alternate per round
and the ratio is taken per round (absolute times on these machines are noise).

Cells: a prompt repeated (its last token recomputed: ``new`` 1), a chat turn's follow-up
(``new`` 64 and 512), at contexts of 2k, 4k and 7.9k tokens.

Run: ``python -m bench.extend_cpu --out bench/results/extend_cpu.json`` (about 1-2 min on 2 cores;
nothing else running).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

from bench.cli import write_result
from bench.machine import describe, machine_state
from dd_sglang.kernels.extend import aligned_query_start, prefix_extend_attention

HQ, HKV, D = 9, 3, 64  # SmolLM2-135M
LAYERS = 30


def _cell(context: int, new: int, rounds: int, g: torch.Generator) -> dict:
    prefix = context - new
    k_pool = torch.randn(context + 16, HKV, D, generator=g).bfloat16()
    v_pool = torch.randn(context + 16, HKV, D, generator=g).bfloat16()
    slots = torch.randperm(context + 16, generator=g)[:context]
    r2t = slots.view(1, -1)
    q = torch.randn(new, HQ, D, generator=g).bfloat16()
    scale = D**-0.5

    def sglang():
        out = torch.empty_like(q)
        TorchNativeAttnBackend._run_sdpa_forward_extend(
            None, q, out, k_pool, v_pool, r2t, torch.tensor([0]), torch.tensor([context]),
            torch.tensor([prefix]), torch.tensor([new]), scaling=scale, enable_gqa=True, causal=True,
        )  # fmt: skip
        return out

    def ours():
        tokens = r2t[0].long()
        return prefix_extend_attention(q, k_pool[tokens], v_pool[tokens], prefix, scale)

    equal = torch.equal(sglang(), ours())  # also the warm-up call of each
    times = {"sglang_torch_native": [], "dualdecoder": []}
    for r in range(rounds):
        pair = [("sglang_torch_native", sglang), ("dualdecoder", ours)]
        for name, fn in pair if r % 2 == 0 else reversed(pair):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    ratios = [a / b for a, b in zip(times["sglang_torch_native"], times["dualdecoder"], strict=True)]
    start = aligned_query_start(prefix, context)
    return {
        "context": context, "new_tokens": new, "cached_prefix": prefix,
        "query_rows": {"sglang_torch_native": context, "dualdecoder": context - start},
        "layer_ms": {n: round(statistics.median(v) * 1e3, 2) for n, v in times.items()},
        "request_attention_s_30_layers": {n: round(statistics.median(v) * LAYERS, 2) for n, v in times.items()},
        "speedup": round(statistics.median(ratios), 2),
        "speedup_range": [round(min(ratios), 2), round(max(ratios), 2)],
        "bit_identical": equal,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.extend_cpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--out", default="bench/results/extend_cpu.json")
    ap.add_argument("--contexts", default="2000,4000,7900", help="tokens (prefix + new), comma-separated")
    ap.add_argument("--new", default="1,64,512", help="new tokens after the cached prefix, comma-separated")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    try:
        contexts = [int(x) for x in args.contexts.split(",")]
        news = [int(x) for x in args.new.split(",")]
    except ValueError:
        contexts = news = []
    if not contexts or not news or min(news) < 1 or any(n >= c for c in contexts for n in news):
        ap.error(f"--contexts and --new must be positive integers with every new < every context; "
                 f"got {args.contexts!r} and {args.new!r}")  # fmt: skip
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    before = machine_state()
    g = torch.Generator().manual_seed(0)
    cells = []
    for c in contexts:
        for n in news:
            cells.append(_cell(c, n, args.rounds, g))
            print(cells[-1], flush=True)
    write_result({
        "bench": "extend_cpu", "command": "python -m bench.extend_cpu " + " ".join(argv or sys.argv[1:]),
        "machine": {**describe(before, machine_state()), "threads": torch.get_num_threads()},
        "settings": {"q_heads": HQ, "kv_heads": HKV, "head_dim": D, "dtype": "bfloat16", "rounds": args.rounds},
        "cells": cells,
    }, args.out)  # fmt: skip
    return 0 if all(c["bit_identical"] for c in cells) else 1


if __name__ == "__main__":
    raise SystemExit(main())
