"""Capacity benchmark: concurrent long requests in one device KV budget, dense vs ``dualdecoder``.

Usage::

    python -m bench.capacity [--out bench/results/capacity_cpu.json] [--requests 8]
                             [--max-total-tokens 8400] [--prompt-tokens 4200] [--new-tokens 32]

For each backend (``torch_native``, ``dualdecoder``, then ``torch_native:room``),
in one run: start a dd_sglang server whose device KV pool holds ``--max-total-tokens``
tokens (8,400: two ~4k dense requests; ``:room``: every request at once, the dense
path given the memory the sparse path saves), send ``--requests`` distinct ~4k-token passkey prompts
at once (greedy, ``--new-tokens`` each, ``ignore_eos``), and sample the sidecar
every 0.2 s. ``dualdecoder+SELECTOR`` in ``--backends`` runs the ``dualdecoder``
server again with every request choosing that selector (``custom_params.dd_selector``).
Recorded per backend:

* ``peak_concurrent_decoding``: most requests decoding at once (dense: the
  ``DENSE`` running batch; dualdecoder: ``DECODE_SPARSE``);
* ``wall_seconds`` from the first send to the last answer, and
  ``output_tokens_per_second`` = all generated tokens / wall (``output_tokens``: each
  request's ``usage.completion_tokens``, streamed with ``include_usage``; text chunks,
  ``streamed_chunks``, can be fewer: a token whose text is held back arrives with the next);
* ``decode_tokens_per_second``: generated tokens after each request's first
  one, divided by the time from the first first-token to the last answer;
* ``steady_decode_tokens_per_second``: what the server delivers while its
  fullest batch decodes, prefills left out: ``c / g``, ``c`` the most requests
  decoding at once (from the streamed tokens: a request decodes from its first
  token to its last) and ``g`` the median gap between consecutive tokens of a
  request while ``c`` requests decode (a gap that holds another request's
  prefill is rare there and the median ignores it). With ``c`` = 2 for dense at
  the 8,400-token budget and 8 for ``dualdecoder``, the ratio of the two is the
  decode-step throughput ratio the same-budget goal asks about, without the 8
  prefills that are the same work on every backend;
* passkeys found, per-request latency, the peak of the per-request device
  slots (``dd_sparse_request_device_tokens_max``) and of the host tier's bytes.

Results are JSON; nothing here is a pass/fail test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from bench.prompts import passkey_prompt
from bench.server import scrape, start_server


def steady_decode(times: list[list[float]]) -> dict:
    """Decode throughput at the fullest batch, from each request's token arrival times (seconds,
    monotonic; a request decodes from its first token to its last).

    Returns ``steady_concurrency`` (``c``, the most requests decoding at once),
    ``steady_gap_seconds`` (median gap between a request's consecutive tokens, over the gaps
    that end while ``c`` requests decode) and ``steady_decode_tokens_per_second`` = ``c / gap``.
    Raises ValueError when no request streamed two tokens.
    """
    spans = [(t[0], t[-1]) for t in times if len(t) >= 2]
    if not spans:
        raise ValueError("steady_decode: no request streamed two tokens")

    def decoding(x: float) -> int:
        return sum(a <= x <= b for a, b in spans)

    c = max(decoding(a) for a, _ in spans)
    gaps = sorted(t[i] - t[i - 1] for t in times for i in range(1, len(t)) if decoding(t[i]) == c)
    g = gaps[len(gaps) // 2]
    return {"steady_concurrency": c, "steady_gap_seconds": round(g, 4),
            "steady_decode_tokens_per_second": round(c / g, 3)}  # fmt: skip


def run_backend(spec: str, prompts: list[tuple[str, int, int]], args) -> dict:
    """One server, all prompts at once; see the module docstring for the figures.

    ``spec``: a backend name, or ``name:room`` for a device pool with room for every request densely;
    ``dualdecoder+SELECTOR`` sends every request with ``custom_params.dd_selector`` = SELECTOR.
    """
    backend, _, room = spec.partition(":")
    backend, _, selector = backend.partition("+")
    budget = args.max_total_tokens
    if room:
        budget = sum(n for _, n, _ in prompts) + len(prompts) * args.new_tokens + 512
    log = Path(tempfile.mkdtemp(prefix="dd_capacity_")) / "server.log"
    srv = start_server(log, budget, ["--attention-backend", backend], timeout=900)
    samples: list[tuple[float, dict]] = []
    done = threading.Event()
    results: list[dict] = [{} for _ in prompts]

    def sample():
        while not done.is_set():
            samples.append((time.monotonic(), scrape(srv.metrics_url)))
            time.sleep(0.2)

    def run(i: int, prompt: str, key: int):
        t0 = time.monotonic()
        text = ""
        payload = {"model": "x", "prompt": prompt, "max_tokens": args.new_tokens, "temperature": 0,
                   "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
        if selector:
            payload["custom_params"] = {"dd_selector": selector}
        times = []  # arrival of each non-empty text chunk (monotonic seconds)
        usage = None
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=payload, timeout=3600) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    data = json.loads(line[6:])
                    usage = data.get("usage") or usage
                    chunk = data["choices"][0]["text"] if data.get("choices") else ""
                    if chunk:
                        text += chunk
                        times.append(time.monotonic())
        results[i] = {"passkey": key, "answer": text[:40], "found": bool(re.match(rf"\s*{key}\b", text)),
                      "chunks": len(times), "tokens": usage["completion_tokens"] if usage else len(times), "start": t0,
                      "first_token": times[0] if times else None, "end": time.monotonic(), "times": times}  # fmt: skip

    try:
        poller = threading.Thread(target=sample, daemon=True)
        poller.start()
        t0 = time.monotonic()
        workers = [threading.Thread(target=run, args=(i, p, k)) for i, (p, _, k) in enumerate(prompts)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        wall = time.monotonic() - t0
        done.set()
        poller.join()
    finally:
        rc, alive = srv.stop()
    if rc == 0 and not alive:  # a clean stop: its log and folder go (else they stay for diagnosis)
        shutil.rmtree(log.parent, ignore_errors=True)
    else:
        print(f"{spec}: server log kept in {log}", file=sys.stderr)
    state = "DECODE_SPARSE" if backend == "dualdecoder" else "DENSE"
    key = f'dd_dualpath_requests{{state="{state}"}}'
    tokens = sum(r["tokens"] for r in results)
    first = min(r["first_token"] for r in results)
    end = max(r["end"] for r in results)
    return {
        "device_kv_budget_tokens": budget,
        "engine_start_seconds": round(srv.start_seconds, 1),
        "peak_rss_bytes": srv.peak_rss_bytes,
        "shutdown": {"exit_code": rc, "processes_left": alive},
        "found": sum(r["found"] for r in results),
        "total": len(results),
        "peak_concurrent_decoding": int(max(s.get(key, 0) for _, s in samples)),
        "peak_request_device_tokens": int(
            max(s.get("dd_sparse_request_device_tokens_max", 0) for _, s in samples)
        ),
        "peak_host_tier_used_bytes": int(max(s.get("dd_host_tier_used_bytes", 0) for _, s in samples)),
        "wall_seconds": round(wall, 2),
        "output_tokens": tokens,
        "streamed_chunks": sum(r["chunks"] for r in results),
        "output_tokens_per_second": round(tokens / wall, 3),
        "decode_tokens_per_second": round((tokens - len(results)) / (end - first), 3),
        **steady_decode([r["times"] for r in results]),
        "latency_seconds": [round(r["end"] - r["start"], 2) for r in results],
        "answers": [{"passkey": r["passkey"], "answer": r["answer"], "found": r["found"]} for r in results],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.capacity", description=__doc__)
    ap.add_argument("--out", default="bench/results/capacity_cpu.json")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-total-tokens", type=int, default=8400)
    ap.add_argument("--prompt-tokens", type=int, default=4200, help="passkey_prompt size target (~4k tokens)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--backends", default="torch_native,dualdecoder,torch_native:room",
                    help="backend names; name:room = a device pool with room for every request densely; "
                         "dualdecoder+SELECTOR = every request with custom_params.dd_selector SELECTOR")  # fmt: skip
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from dd_sglang.models.smollm2 import prepare_model

    tok = AutoTokenizer.from_pretrained(prepare_model(progress=False))
    prompts = []
    for i in range(args.requests):
        key = 10000 + (7919 * (i + 1)) % 90000
        p, n = passkey_prompt(tok, args.prompt_tokens, (i + 0.5) / args.requests, key, header=f"Case {i}. ")
        prompts.append((p, n, key))
    runs = {b: run_backend(b, prompts, args) for b in args.backends.split(",")}
    result = {
        "benchmark": "concurrent ~4k-token requests in one device KV budget, dense vs dualdecoder (CPU)",
        "command": "python -m bench.capacity " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count()},
        "device_kv_budget_tokens": args.max_total_tokens,
        "prompt_tokens": [n for _, n, _ in prompts],
        "new_tokens_per_request": args.new_tokens,
        "backends": runs,
    }
    # each sparse run over each dense baseline, for the whole run and for steady decode
    # (``dualdecoder_over_dense_same_budget``; ``dualdecoder_host_sync_over_...`` for ``dualdecoder+host_sync``)
    for spec, dd in runs.items():
        if not spec.startswith("dualdecoder") or ":" in spec:
            continue
        for prefix, metric in (("", "output_tokens_per_second"), ("steady_decode_", "steady_decode_tokens_per_second")):
            for base, name in (("torch_native", "same_budget"), ("torch_native:room", "with_room")):
                if base in runs:
                    key = f"{prefix}{spec.replace('+', '_')}_over_dense_{name}"
                    result[key] = round(dd[metric] / runs[base][metric], 3)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    for b, r in runs.items():
        print(f"{b}: {r['found']}/{r['total']} passkeys, peak {r['peak_concurrent_decoding']} decoding at once, "
              f"{r['output_tokens_per_second']} out tok/s, {r['decode_tokens_per_second']} decode tok/s, "
              f"steady {r['steady_decode_tokens_per_second']} tok/s at {r['steady_concurrency']} decoding, "
              f"wall {r['wall_seconds']} s")  # fmt: skip
    print(f"-> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
