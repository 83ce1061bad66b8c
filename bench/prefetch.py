"""Prefetch hit rate in serving: how much of step t+1's exact top-k a set fixed during step t holds.

Usage::

    python -m bench.prefetch [--out bench/results/prefetch_cpu.json] [--contexts 4000,7900]
                             [--new-tokens 32] [--selector recency]

One ``dualdecoder`` server (default preset, 16,384-token device pool). For each
context length, critical-set size k (1/16 and 1/32 of the context) and decoding
regime (greedy; sampling at temperature 0.8, top-p 0.95), one request
continues real text (the package descriptions in the virtualenv's
``*.dist-info/METADATA`` files, concatenated in sorted order and cut to the
context length) with the per-request overrides ``dd_selector`` and ``dd_top_k``.
The hit rate is read from the server's own counters (``dd_prefetch_hits_total``
/ ``dd_prefetch_lookups_total``, per layer from ``dd_prefetch_layer_hit_rate``):
per decode step, layer and KV head, |set fixed one step earlier ∩ exact top-k of
the real query| / k. The exact top-k uses DESIGN.md's GQA rule (max over the
group's softmax). Teacher-forced real text is not measured here (the server
cannot force tokens); nothing here is a pass/fail test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

import httpx

from bench.server import scrape, start_server


def corpus_text() -> str:
    """Real English prose available offline: installed packages' long descriptions."""
    import site

    texts = []
    for root in site.getsitepackages():
        for meta in sorted(Path(root).glob("*.dist-info/METADATA")):
            body = meta.read_text(errors="ignore").split("\n\n", 1)
            if len(body) == 2 and len(body[1]) > 2000:
                texts.append(body[1])
    return "\n\n".join(texts)[:200_000]  # ~50k tokens, plenty for 8k contexts


def _delta(after: dict, before: dict, name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.prefetch", description=__doc__)
    ap.add_argument("--out", default="bench/results/prefetch_cpu.json")
    ap.add_argument("--contexts", default="4000,7900")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--selector", default="recency")
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from dd_sglang.models.smollm2 import prepare_model

    tok = AutoTokenizer.from_pretrained(prepare_model(progress=False))
    ids_all = tok.encode(corpus_text())
    log = Path(tempfile.mkdtemp(prefix="dd_prefetch_")) / "server.log"
    srv = start_server(log, 16384, ["--attention-backend", "dualdecoder"])
    runs = []
    try:
        for n in [int(x) for x in args.contexts.split(",")]:
            ids = ids_all[:n]
            for frac in (16, 32):
                k = n // frac
                for regime, sampling in (
                    ("greedy", {"temperature": 0}),
                    ("sample_t0.8", {"temperature": 0.8, "top_p": 0.95, "sampling_seed": 1234}),
                ):
                    before = scrape(srv.metrics_url, "dd_prefetch")
                    r = httpx.post(
                        f"{srv.url}/generate",
                        json={
                            "input_ids": ids,
                            "sampling_params": {
                                **sampling,
                                "max_new_tokens": args.new_tokens,
                                "ignore_eos": True,
                                "custom_params": {"dd_selector": args.selector, "dd_top_k": k},
                            },
                        },
                        timeout=3600,
                    ).json()
                    after = scrape(srv.metrics_url, "dd_prefetch")
                    sel = f'{{selector="{args.selector}"}}'
                    hits = _delta(after, before, f"dd_prefetch_hits_total{sel}")
                    lookups = _delta(after, before, f"dd_prefetch_lookups_total{sel}")
                    per_layer = {}
                    for layer in range(64):
                        c = _delta(after, before, f'dd_prefetch_layer_hit_rate_count{{layer="{layer}"}}')
                        if c:
                            s = _delta(after, before, f'dd_prefetch_layer_hit_rate_sum{{layer="{layer}"}}')
                            per_layer[layer] = round(s / c, 4)
                    runs.append(
                        {
                            "context_tokens": n,
                            "k": k,
                            "k_fraction": f"1/{frac}",
                            "regime": regime,
                            "output_tokens": len(r.get("output_ids", [])),
                            "hit_rate": round(hits / lookups, 4) if lookups else None,
                            "lookups": int(lookups),
                            "per_layer_hit_rate": per_layer,
                        }
                    )
                    print(
                        runs[-1]["context_tokens"],
                        runs[-1]["k_fraction"],
                        regime,
                        runs[-1]["hit_rate"],
                        flush=True,
                    )
    finally:
        rc, alive = srv.stop()
    result = {
        "benchmark": f"prefetch hit rate of the {args.selector} selector in serving (CPU, SmolLM2-135M)",
        "command": "python -m bench.prefetch " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count()},
        "text": "virtualenv *.dist-info/METADATA long descriptions, sorted, concatenated",
        "selector": args.selector,
        "speculator": "none (step t's own query selects step t+1's set)",
        "shutdown": {"exit_code": rc, "processes_left": alive},
        "runs": runs,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"-> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
