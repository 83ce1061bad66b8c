"""Host tier on huge pages vs 4 KiB pages, in the server: steady decode of 8 concurrent ~4k requests.

Usage::

    python -m bench.host_pages [--out bench/results/host_pages_cpu.json] [--rounds 2]
                               [--new-tokens 64] [--requests 8] [--max-total-tokens 8400]

Three servers up at once, one busy at a time: SGLang dense (``torch_native``) and two
``dualdecoder`` servers with the default preset, one with its host tier, int8 key index and block
summaries advised onto transparent huge pages (``DD_SGLANG_HOST_HUGE_PAGES=1``, the default;
:mod:`dd_sglang.kvcache.host_memory`) and one on 4 KiB pages (``=0``). Each round sends every
server the same fresh passkey prompts (:func:`bench.capacity.round_prompts`), the order rotated
by one each round, and measures what :func:`bench.capacity.run_round` does (steady decode rate,
whole-run rate, passkeys). Reported: per server the per-round figures and their medians, and
``huge_over_4k_steady`` (per round and median). Results are JSON; nothing here is a pass/fail test.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from bench.capacity import round_prompts, run_round
from bench.cli import write_result
from harness.server import launch_server

#: name -> (launcher flags, environment added)
SERVERS = {
    "sglang_dense": (["--attention-backend", "torch_native"], {}),
    "default_huge_pages": (["--attention-backend", "dualdecoder"], {"DD_SGLANG_HOST_HUGE_PAGES": "1"}),
    "default_4k_pages": (["--attention-backend", "dualdecoder"], {"DD_SGLANG_HOST_HUGE_PAGES": "0"}),
}
KEEP = ("steady_decode_tokens_per_second", "output_tokens_per_second", "wall_seconds", "found", "total")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.host_pages", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--out", default="bench/results/host_pages_cpu.json")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=4200)
    ap.add_argument("--max-total-tokens", type=int, default=8400)
    args = ap.parse_args(argv)
    args.sample_interval = 1.0
    if not 1 <= args.rounds <= 20:
        ap.error(f"--rounds must be in [1, 20], got {args.rounds}")
    if not 1 <= args.new_tokens <= 4096:
        ap.error(f"--new-tokens must be in [1, 4096], got {args.new_tokens}")

    from transformers import AutoTokenizer

    from dd_sglang.models.smollm2 import prepare_model

    tok = AutoTokenizer.from_pretrained(prepare_model(progress=False))
    servers, logs = {}, {}
    per: dict[str, list[dict]] = {n: [] for n in SERVERS}
    try:
        for name, (flags, env) in SERVERS.items():
            logs[name] = Path(tempfile.mkdtemp(prefix="dd_host_pages_")) / "server.log"
            servers[name] = launch_server(logs[name], args.max_total_tokens, flags, env=env)
        for srv in servers.values():
            srv.wait_ready(900)
        names = list(SERVERS)
        for r in range(args.rounds):
            prompts = round_prompts(tok, r, args)
            for name in names[r % len(names) :] + names[: r % len(names)]:
                res = run_round(name, servers[name], prompts, args)
                per[name].append({k: res[k] for k in KEEP})
                print(f"round {r} {name}: {per[name][-1]}", file=sys.stderr)
    finally:
        for name, srv in servers.items():
            rc, alive = srv.stop()
            if rc == 0 and not alive:
                shutil.rmtree(logs[name].parent, ignore_errors=True)
    ratios = [h["steady_decode_tokens_per_second"] / f["steady_decode_tokens_per_second"]
              for h, f in zip(per["default_huge_pages"], per["default_4k_pages"], strict=True)]  # fmt: skip
    result = {
        "benchmark": "dualdecoder default, host tier on huge vs 4 KiB pages, 8 concurrent ~4k requests (CPU)",
        "command": "python -m bench.host_pages " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count()},
        "servers": {
            n: {
                "rounds": v,
                "steady_median": statistics.median(x["steady_decode_tokens_per_second"] for x in v),
            }
            for n, v in per.items()
        },  # fmt: skip
        "huge_over_4k_steady_rounds": [round(x, 3) for x in ratios],
        "huge_over_4k_steady": round(statistics.median(ratios), 3),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_result(result, out)
    print(f"huge over 4 KiB pages, steady decode: {result['huge_over_4k_steady']} (rounds {ratios}) -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
