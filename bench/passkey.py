"""Foundation benchmark: engine start time, peak RSS, passkey retrieval over lengths and depths.

Usage::

    python -m bench.passkey [--out bench/results/foundation_cpu.json] [--lengths 512,1024,...]

Starts one dd_sglang server (default preset, ``--max-total-tokens 16384``),
then asks greedy ``/v1/completions`` for the passkey of each prompt
(:func:`bench.prompts.passkey_prompt`) and records whether the answer starts
with the passkey. Results are written as JSON; nothing here is a pass/fail test.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import tempfile
import time
from pathlib import Path

import httpx
from tqdm import tqdm

from bench.prompts import passkey_prompt
from bench.server import start_server


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.passkey", description=__doc__)
    ap.add_argument("--out", default="bench/results/foundation_cpu.json")
    ap.add_argument("--lengths", default="512,1024,2048,4096,7300")
    ap.add_argument("--depths", default="0.1,0.5,0.9")
    ap.add_argument("--max-total-tokens", type=int, default=16384)
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    depths = [float(x) for x in args.depths.split(",")]

    from transformers import AutoTokenizer

    from dd_sglang.models.smollm2 import prepare_model

    tok = AutoTokenizer.from_pretrained(prepare_model(progress=False))
    log = Path(tempfile.mkdtemp(prefix="dd_bench_")) / "server.log"
    srv = start_server(log, args.max_total_tokens)
    rows = []
    try:
        grid = [(n, d) for n in lengths for d in depths]
        for i, (n, d) in enumerate(tqdm(grid, desc="passkey", unit="prompt")):
            key = 10000 + (7919 * (i + 1)) % 90000
            prompt, n_tok = passkey_prompt(tok, n, d, key)
            t0 = time.monotonic()
            r = httpx.post(
                f"{srv.url}/v1/completions",
                json={"model": "x", "prompt": prompt, "max_tokens": 8, "temperature": 0},
                timeout=600,
            ).json()
            text = r["choices"][0]["text"]
            rows.append(
                {
                    "target_tokens": n,
                    "prompt_tokens": r["usage"]["prompt_tokens"],
                    "tokenizer_prompt_tokens": n_tok,
                    "depth": d,
                    "passkey": key,
                    "answer": text,
                    "found": bool(re.match(rf"\s*{key}\b", text)),
                    "latency_seconds": round(time.monotonic() - t0, 3),
                }
            )
    finally:
        rc, alive = srv.stop()
    result = {
        "benchmark": "foundation passkey (dense SGLang, torch_native, CPU)",
        "command": "python -m bench.passkey " + " ".join(argv or []),
        "machine": {
            "processor": platform.processor() or platform.machine(),
            "cpus": __import__("os").cpu_count(),
        },
        "engine_start_seconds": round(srv.start_seconds, 1),
        "peak_rss_bytes": srv.peak_rss_bytes,
        "shutdown": {"exit_code": rc, "processes_left": alive},
        "found": sum(r["found"] for r in rows),
        "total": len(rows),
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"passkey {result['found']}/{result['total']}, start {result['engine_start_seconds']} s, "
          f"peak RSS {srv.peak_rss_bytes / 2**30:.2f} GiB -> {out}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
