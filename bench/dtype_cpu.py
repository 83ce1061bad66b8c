"""Prefill and decode speed of the embedded model in bfloat16 vs float32 on this CPU (dense path).

Usage::

    python -m bench.dtype_cpu [--out bench/results/dtype_cpu.json] [--repeats 2] [--batch N]

For each dtype, in one run: start a dense (``torch_native``) dd_sglang server
with ``--dtype <dtype>``, then, ``--repeats`` times each and one request at a
time: prefill a ~4,000-token prompt (``max_tokens`` 1: the time to the answer
is the prefill), decode 48 tokens after a ~4,000-token prompt and after a
~100-token prompt (streamed: decode tok/s = (chunks - 1) / (last - first chunk
time)). With ``--batch N`` (> 0) also N distinct ~4,000-token prompts decoded at once, 48 tokens
each (the server's pool then holds all N): ``decode_tokens_per_second_4k_batch`` is the sum of the
N requests' decode rates (they start together and decode side by side), the dtype question at the
batch sizes a server runs, where attention over the long contexts dominates the step. The median
of the repeats is kept. Records the CPU's ISA flags that
decide the default (:func:`dd_sglang.platform.dtype.native_bf16`). Nothing here
is a pass/fail test; the launcher's default dtype on a CPU without native bf16
(float32) is the one this measured faster.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.cli import write_result
from bench.machine import command_line
from harness.prompts import passkey_prompt
from harness.server import start_server


def _stream(url: str, prompt: str, n: int) -> tuple[float, float | None]:
    """(seconds to the first token, decode tokens/s) of one greedy streamed completion of ``n``
    tokens; the rate is None when fewer than two chunks came back (``n`` = 1: a prefill timing)."""
    body = {"model": "x", "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True, "ignore_eos": True}
    t0, times = time.monotonic(), []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=1800) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                times.append(time.monotonic())
    rate = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else None
    return times[0] - t0, rate


def _batch_rate(url: str, prompts: list[str], n: int) -> float:
    """Sum of the decode tokens/s of ``prompts`` streamed at once, ``n`` tokens each (:func:`_stream`)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(prompts)) as pool:
        rates = [r for _, r in pool.map(lambda p: _stream(url, p, n), prompts)]
    if any(r is None for r in rates):
        raise RuntimeError("a batched request streamed fewer than two chunks")
    return sum(rates)


def measure(dtype: str, tok, repeats: int, batch: int = 0) -> dict:
    log = Path(tempfile.mkdtemp(prefix="dd_dtype_")) / "server.log"
    pool = max(9000, batch * 4300 + 512)
    srv = start_server(log, pool, ["--attention-backend", "torch_native", "--dtype", dtype], timeout=900)
    try:
        prefill, dec_long, dec_short, dec_batch = [], [], [], []
        for i in range(repeats):
            p, _ = passkey_prompt(tok, 4200, 0.5, 11111 + i, header=f"{dtype} prefill {i}. ")
            prefill.append(_stream(srv.url, p, 1)[0])
            p, n_long = passkey_prompt(tok, 4200, 0.5, 22222 + i, header=f"{dtype} decode {i}. ")
            dec_long.append(_stream(srv.url, p, 48)[1])
            dec_short.append(_stream(srv.url, f"Run {i}. Write a short story about a lighthouse keeper.", 48)[1])
            if batch:
                ps = [passkey_prompt(tok, 4200, (j + 0.5) / batch, 33333 + 97 * i + j, header=f"{dtype} batch {i}.{j}. ")[0]
                      for j in range(batch)]  # fmt: skip
                dec_batch.append(_batch_rate(srv.url, ps, 48))
        out = {
            "dtype": dtype,
            "prefill_seconds_4k": statistics.median(prefill),
            "decode_tokens_per_second_4k": statistics.median(dec_long),
            "decode_tokens_per_second_short": statistics.median(dec_short),
            "prompt_tokens_4k": n_long,
            "server_start_seconds": srv.start_seconds,
            "samples": {"prefill": prefill, "decode_4k": dec_long, "decode_short": dec_short},
        }
        if batch:
            out.update({"batch": batch, "decode_tokens_per_second_4k_batch": statistics.median(dec_batch)})
            out["samples"]["decode_4k_batch"] = dec_batch
        return out
    finally:
        srv.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results/dtype_cpu.json")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batch", type=int, default=0, help="also decode N ~4k prompts at once (0: no)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    if not 0 <= args.batch <= 32:
        ap.error(f"--batch must be in [0, 32], got {args.batch}")
    from transformers import AutoTokenizer

    from dd_sglang.models.smollm2 import prepare_model
    from dd_sglang.platform.dtype import cpu_flags, cpu_model, native_bf16

    tok = AutoTokenizer.from_pretrained(prepare_model(progress=False))
    runs = [measure(d, tok, args.repeats, args.batch) for d in ("bfloat16", "float32")]
    bf, f32 = runs
    result = {
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "cpu_model": cpu_model(),
                    "isa": sorted(f for f in cpu_flags() if f.startswith(("avx", "amx"))),
                    "native_bf16": native_bf16()},  # fmt: skip
        "runs": runs,
        "float32_over_bfloat16": {
            "prefill_speed_4k": bf["prefill_seconds_4k"] / f32["prefill_seconds_4k"],
            "decode_4k": f32["decode_tokens_per_second_4k"] / bf["decode_tokens_per_second_4k"],
            "decode_short": f32["decode_tokens_per_second_short"] / bf["decode_tokens_per_second_short"],
            **({f"decode_4k_batch_{args.batch}": f32["decode_tokens_per_second_4k_batch"]
                / bf["decode_tokens_per_second_4k_batch"]} if args.batch else {}),
        },
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    result["command"] = "python -m bench.dtype_cpu " + " ".join(argv) if argv is not None else command_line()
    write_result(result, args.out, dtype="bfloat16,float32")
    json.dump(result["float32_over_bfloat16"], sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
