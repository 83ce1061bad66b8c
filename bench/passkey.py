"""Passkey benchmark: engine start, peak RSS, passkey retrieval and decode speed, per attention backend.

Usage::

    python -m bench.passkey [--out bench/results/passkey_cpu.json] [--lengths 512,1024,...]
                            [--backends torch_native,dualdecoder]

For each backend, in one run, one after the other: start a dd_sglang server
(default preset, ``--max-total-tokens 16384``, ``--attention-backend B``), ask
greedy ``/v1/completions`` for the passkey of each prompt
(:func:`harness.prompts.passkey_prompt`) and record whether the answer starts with
it; then measure decode speed: stream 64 greedy tokens after a
``--decode-tokens``-token prompt and take (chunks - 1) / (last - first chunk
time), i.e. tokens/s after the first token. Results are written as JSON;
nothing here is a pass/fail test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path

import httpx
from tqdm import tqdm

from bench.cli import write_result
from harness.prompts import passkey_prompt
from harness.server import start_server


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.passkey", description=__doc__)
    ap.add_argument("--out", default="bench/results/passkey_cpu.json")
    ap.add_argument("--lengths", default="512,1024,2048,4096,7300")
    ap.add_argument("--depths", default="0.1,0.5,0.9")
    ap.add_argument("--max-total-tokens", type=int, default=16384)
    ap.add_argument("--backends", default="torch_native", help="comma-separated --attention-backend values")
    ap.add_argument(
        "--decode-tokens", type=int, default=4000, help="prompt length for the decode-speed probe (0: no probe)"
    )
    ap.add_argument("--server-args", action="append", default=[], metavar="LABEL=ARGS",
                    help="run the grid once more per value on a server with these extra flags (shell words), "
                         "e.g. 'yarn4=--context-length 32768 --json-model-override-args {...}'; with it, "
                         "--backends names the one backend they run under")  # fmt: skip
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    depths = [float(x) for x in args.depths.split(",")]

    from transformers import AutoTokenizer

    from dd_sglang.models.smollm2 import prepare_model

    tok = AutoTokenizer.from_pretrained(prepare_model(progress=False))
    runs = {}
    for backend in args.backends.split(","):
        if not args.server_args:
            runs[backend] = run_backend(tok, backend, lengths, depths, args)
        for spec in args.server_args:
            label, _, words = spec.partition("=")
            runs[label] = run_backend(tok, backend, lengths, depths, args, shlex.split(words))
            runs[label]["server_args"] = ["--attention-backend", backend, *shlex.split(words)]
    result = {
        "benchmark": "passkey retrieval and decode speed per attention backend (CPU)",
        "command": "python -m bench.passkey " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count()},
        "backends": runs,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_result(result, out)
    for b, r in runs.items():
        print(f"{b}: passkey {r['found']}/{r['total']}, decode {r['decode_tokens_per_second']} tok/s at "
              f"{r['decode_prompt_tokens']} tokens, start {r['engine_start_seconds']} s, "
              f"peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB")  # fmt: skip
    print(f"-> {out}")
    return 0


def decode_speed(url: str, prompt: str, n_new: int = 64) -> float:
    """Greedy streamed decode rate in tokens/s after the first token (one request)."""
    times = []
    payload = {"model": "x", "prompt": prompt, "max_tokens": n_new, "temperature": 0, "stream": True,
               "ignore_eos": True}  # fmt: skip
    with httpx.stream("POST", f"{url}/v1/completions", json=payload, timeout=900) as r:
        for line in r.iter_lines():
            if (
                line.startswith("data: ")
                and line != "data: [DONE]"
                and json.loads(line[6:])["choices"][0]["text"]
            ):
                times.append(time.monotonic())
    return round((len(times) - 1) / (times[-1] - times[0]), 3)


def run_backend(tok, backend: str, lengths: list[int], depths: list[float], args, extra: list[str] = ()) -> dict:
    """Start a server with ``--attention-backend backend`` (and the flags ``extra``), run the passkey
    grid and the decode probe."""
    log = Path(tempfile.mkdtemp(prefix="dd_bench_")) / "server.log"
    srv = start_server(log, args.max_total_tokens, ["--attention-backend", backend, *extra])
    rows = []
    try:
        grid = [(n, d) for n in lengths for d in depths]
        for i, (n, d) in enumerate(tqdm(grid, desc=f"passkey {backend}", unit="prompt")):
            key = 10000 + (7919 * (i + 1)) % 90000
            prompt, n_tok = passkey_prompt(tok, n, d, key)
            t0 = time.monotonic()
            r = httpx.post(
                f"{srv.url}/v1/completions",
                json={"model": "x", "prompt": prompt, "max_tokens": 8, "temperature": 0},
                timeout=3600,
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
        probe_tokens = speed = None
        if args.decode_tokens:
            probe, probe_tokens = passkey_prompt(tok, args.decode_tokens, 0.5, 54321)
            speed = decode_speed(srv.url, probe + " ")
    finally:
        rc, alive = srv.stop()
    return {
        "engine_start_seconds": round(srv.start_seconds, 1),
        "peak_rss_bytes": srv.peak_rss_bytes,
        "shutdown": {"exit_code": rc, "processes_left": alive},
        "found": sum(r["found"] for r in rows),
        "total": len(rows),
        "decode_prompt_tokens": probe_tokens,
        "decode_tokens_per_second": speed,
        "rows": rows,
    }


if __name__ == "__main__":
    raise SystemExit(main())
