"""The prediction's recall through the OpenAI API, as users send requests: sampled and greedy, with intervals.

Usage::

    python -m bench.recall [--contexts 4000,7900] [--requests 8] [--new-tokens 64] [--temperature 0.8]
                           [--top-p 0.95] [--url URL --metrics-url URL] [--out bench/results/recall_<host class>.json]

Each request is a ``/v1/completions`` call (``seed``, ``temperature``, ``top_p`` as an OpenAI
client sets them; ``custom_params``: ``dd_top_k`` = context / 16, the DESIGN's k = 1/16, and
``dd_selector: spec_host``, the selector that predicts, which the CPU preset does not default to) that
continues ~``context`` tokens of real prose (Python's reference documentation, a different window
per request, so no two share a prefix). Requests run one at a time against one ``dualdecoder``
server with the default preset, so the deltas of its counters belong to one request:

* recall = ``dd_prefetch_verified_hits_total`` / ``dd_prefetch_verified_lookups_total``: of the
  tokens each layer and KV head attended on every decode step (the real query's set, chosen as
  ``host_sync`` chooses it: guaranteed recall), the share the speculated query had prefetched
  one step earlier; 1 - recall was fetched synchronously;
* acceptance: the share of speculated tokens equal to the sampled one.

Per context and regime (``sampled`` at ``--temperature``/``--top-p``, and ``greedy``): the mean over
requests with a Student-t 95% interval (requests are the independent units; the (layer, head,
token) lookups inside one request are not), and the pooled ratio.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import httpx

#: A request's prompt: a chat turn asking to continue the text, then the text's window.
TEMPLATE = "<|im_start|>user\nContinue this text.\n{body}<|im_end|>\n<|im_start|>assistant\n"


def prompts(tokenizer, context: int, n: int) -> list[str]:
    """``n`` prompts of about ``context`` tokens: disjoint windows of Python's reference docs."""
    from harness.texts import python_docs

    ids = tokenizer.encode(python_docs())
    size = context - 30
    if (n + 1) * size > len(ids):
        raise ValueError(f"{n} windows of {size} tokens need {(n + 1) * size} tokens of text, have {len(ids)}")
    return [TEMPLATE.format(body=tokenizer.decode(ids[(i + 1) * size : (i + 2) * size])) for i in range(n)]


def one_request(url: str, metrics_url: str, prompt: str, top_k: int, new_tokens: int, temperature: float,
                top_p: float, seed: int) -> dict:  # fmt: skip
    """Send one completion; return its recall, acceptance and token counts from the counter deltas.

    Raises:
        RuntimeError: the server answered with an error, or the request decoded no verified step.
    """
    from harness.server import scrape

    body = {"model": "x", "prompt": prompt, "max_tokens": new_tokens, "temperature": temperature, "top_p": top_p,
            "seed": seed, "ignore_eos": True, "custom_params": {"dd_top_k": top_k, "dd_selector": "spec_host"}}  # fmt: skip
    before = scrape(metrics_url)
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=1800)
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
    time.sleep(0.3)
    after = scrape(metrics_url)
    lab = '{selector="spec_host",speculator="dual_token"}'

    def d(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    lookups = d(f"dd_prefetch_verified_lookups_total{lab}")
    if lookups <= 0:
        raise RuntimeError("the request decoded no verified sparse step (too short for the sparse path?)")
    proposed = d('dd_spec_proposed_total{speculator="dual_token"}')
    return {"recall": d(f"dd_prefetch_verified_hits_total{lab}") / lookups, "lookups": int(lookups),
            "hits": int(d(f"dd_prefetch_verified_hits_total{lab}")),
            "acceptance": d('dd_spec_accepted_total{speculator="dual_token"}') / proposed if proposed else None,
            "prompt_tokens": r.json()["usage"]["prompt_tokens"]}  # fmt: skip


def summarize(runs: list[dict]) -> dict:
    """Mean recall over requests with its 95% interval, the pooled recall and the mean acceptance."""
    from bench.stats import mean_ci

    acc = [r["acceptance"] for r in runs if r["acceptance"] is not None]
    return {"recall": mean_ci([r["recall"] for r in runs]),
            "pooled_recall": sum(r["hits"] for r in runs) / sum(r["lookups"] for r in runs),
            "acceptance": sum(acc) / len(acc) if acc else None, "requests": runs}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    import argparse

    from bench.cli import check_ranges

    ap = argparse.ArgumentParser(prog="python -m bench.recall", description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="4000,7900")
    ap.add_argument("--requests", type=int, default=8, help="requests per context and regime")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--url", default=None, help="a running dualdecoder server (with --metrics-url)")
    ap.add_argument("--metrics-url", default=None)
    ap.add_argument("--out", default=None, help="result JSON (default bench/results/recall_<host class>.json)")
    args = ap.parse_args(argv)
    check_ranges(ap, args, (("requests", 2, 1000), ("new_tokens", 4, 4096), ("temperature", 0.01, 2.0),
                            ("top_p", 0.01, 1.0)))  # fmt: skip
    if (args.url is None) != (args.metrics_url is None):
        ap.error("--url and --metrics-url go together")
    try:
        contexts = [int(x) for x in args.contexts.split(",") if x]
    except ValueError:
        ap.error(f"--contexts must be comma-separated integers, got {args.contexts!r}")
    if not contexts or any(not 1200 <= c <= 8000 for c in contexts):
        ap.error(f"--contexts must be in [1200, 8000] (sparse from 1,024 tokens; 8k context), got {args.contexts!r}")
    from transformers import AutoTokenizer

    from bench import machine
    from dd_sglang.models.smollm2 import prepare_model

    tok = AutoTokenizer.from_pretrained(prepare_model(progress=False))
    out = Path(args.out or f"bench/results/recall_{machine.host_class(machine.host().get('cpu_model'))}.json")
    command = "python -m bench.recall " + " ".join(argv if argv is not None else sys.argv[1:])
    srv, url, murl, dtype = None, args.url, args.metrics_url, None
    tmp = Path(tempfile.mkdtemp(prefix="dd_recall_"))
    cells = []
    try:
        if url is None:
            from harness.server import start_server

            srv = start_server(tmp / "server.log", 16384, ["--attention-backend", "dualdecoder"], timeout=900)
            url, murl, dtype = srv.url, srv.metrics_url, srv.dtype
        for c in contexts:
            ps = prompts(tok, c, args.requests)
            for regime, temp in (("sampled", args.temperature), ("greedy", 0.0)):
                runs = [one_request(url, murl, p, c // 16, args.new_tokens, temp, args.top_p, seed=1000 + i)
                        for i, p in enumerate(ps)]  # fmt: skip
                cell = {"context": c, "top_k": c // 16, "regime": regime, "temperature": temp,
                        "top_p": args.top_p if temp > 0 else None, **summarize(runs)}  # fmt: skip
                cells.append(cell)
                ci = cell["recall"]
                print(f"{c} {regime}: recall {ci['mean']:.3f} [{ci['ci_low']:.3f}, {ci['ci_high']:.3f}] over "
                      f"{len(runs)} requests, pooled {cell['pooled_recall']:.3f}, acceptance "
                      f"{cell['acceptance']}", flush=True)  # fmt: skip
    finally:
        if srv is not None:
            srv.stop()
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    from bench.cli import write_result

    write_result({"benchmark": "recall", "command": command, "dtype": dtype, "new_tokens": args.new_tokens,
                  "selector": "spec_host", "speculator": "dual_token", "cells": cells}, out)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
