"""Answer quality of the sparse path against dense, on real text: retrieval, NLL, greedy agreement.

Usage::

    python -m bench.fidelity [--contexts 2000,4000,7500] [--fractions 8,16,32] [--trials 20]
                             [--nll-tokens 128] [--agree-tokens 64] [--configs NAME,...|all]
                             [--dense-url URL] [--dd-url URL --dd-metrics-url URL]
                             [--set SECTION.KEY=VALUE ...] [--out bench/results/fidelity_cpu.json] [--quick]

Texts (:mod:`harness.texts`): Debian's licences, Python's reference docs, the
installed packages' descriptions. Nothing synthetic except the inserted facts.

**Configurations.** ``dense``: a ``torch_native`` server (SGLang's own
attention), or with ``--dense full_top_k`` the ``dualdecoder`` server at
``dd_top_k`` >= the context (token-identical to dense; one server and one
prefill per prompt for the whole run). Sparse (one ``dualdecoder`` server, default CPU preset with
``prefetch.hit_rate_sample: 1`` so every step's prefetch recall is counted;
per-request ``custom_params``): ``oracle`` (exact top-k of the real query);
``spec_host+dual_token`` (``spec_host`` predicting from ``dual_token``'s speculated query, verified
against the real query's set at every layer), ``spec_host_exact+dual_token`` (every host key
scored), ``recency``, ``quest_device``, ``host_sync`` (the CPU preset's: ``spec_host``'s int8 index
and re-ranking of the real query at attention time, no prediction); ``pressure`` (named only: the
DualPath policy ``pressure``, under which a request stays dense while the pool holds it).
``--configs all`` runs every selector (the names of older results, ``spec_host+ngram``,
``spec_host+none``, ``+use_prefetched``, were switches measured worse and deleted). Each sparse configuration runs at
``dd_top_k`` = context / 8, / 16, / 32 (a *cell* is context x configuration x k).

**Per cell.**

* *Retrieval*: ``--trials`` prompts per context (:func:`harness.texts.needle_prompt`):
  trial ``i`` uses text ``i mod n_texts``, a fact (an uncommon name: issue
  10's kind) or a 5-digit pass key alternately, depths spread evenly over
  5%-95%, window and answer fixed by seed ``1000 x context + i``; greedy, 12
  tokens, stop at a newline or period. Found = the answer occurs as a word in
  the completion. Accuracy with a 95% Wilson interval, and the trials dense answers that the cell
  does not (``vs_dense.lost``) and the reverse (``vs_dense.gained``). Also listed: trials the
  default configuration misses while ``oracle`` at the same k finds them.
* *NLL*: per text, a window of ``context`` tokens, then ``--nll-tokens`` real
  next tokens teacher-forced **through the decode path**: the request's output
  is forced to the text's tokens by :class:`harness.teacher_force.ForceTokensScored`,
  which also returns the model's own log-probability of each forced token
  (computed on the logits of the step that decoded it; see that class for why
  a carrier is needed). The first output token comes from the prefill and is
  not scored, so every scored token is one sparse decode step (checked:
  ``dd_sparse_decode_rows_total`` grows by steps x layers). Reported: mean NLL
  (nats/token), its ratio to dense, and the paired per-token difference with a
  t interval; teacher-forced top-1 agreement (forced token = model's argmax).
  On the dense server the same scoring is checked against SGLang's own prefill
  log-probabilities (``decode_vs_prefill_max_abs``).
* *Greedy agreement*: per text, ``--agree-tokens`` greedy tokens after the same
  window, compared with dense: identical leading tokens and matching positions.
* *Prefetch*: pooled recall / mass coverage / acceptance over the cell's
  requests (lookahead selectors), from the sidecar's counters.

**Order.** Each long prompt is prefilled as few times as possible: the dense
server runs every dense request, then the sparse server runs, per prompt,
every configuration and k back to back, so after the first request the prompt
is served from SGLang's radix cache (or reloaded from the host tier). One
server per backend for the whole run (or the URLs given).

Nothing here is a pass/fail test.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
import zlib
from collections import defaultdict
from pathlib import Path

from tqdm import tqdm

from bench.cli import write_result
from bench.stats import mean_ci, wilson
from harness.client import (
    Counters,
    forced_scores,
    generate,
    n_layers_of_model,
    parse_sets,
    prefill_logprobs,
    served,
    stop_left_running,
)
from harness.texts import available_texts, needle_prompt, text

SELECTORS = ("spec_host", "spec_host_exact", "recency", "quest_device", "oracle", "host_sync")
DEFAULT_CONFIG = "spec_host+dual_token"
#: Sparse configurations run by default: name -> custom_params (without dd_top_k).
CONFIGS = {
    "oracle": {"dd_selector": "oracle"},
    "spec_host+dual_token": {"dd_selector": "spec_host"},
    "spec_host_exact+dual_token": {"dd_selector": "spec_host_exact"},
    "recency": {"dd_selector": "recency"},
    "quest_device": {"dd_selector": "quest_device"},
    "host_sync": {"dd_selector": "host_sync"},
}  # fmt: skip
#: Configurations run only when named in ``--configs``: ``pressure`` is the DualPath policy that keeps a
#: long request dense while the device pool holds it (issue 40); one request at a time in this
#: :data:`CAP`-token pool, each should answer as dense does.
EXTRA_CONFIGS = {"pressure": {"dd_policy": "pressure"}}
CAP = 16384
#: ``--dense full_top_k``: dense answers from the dualdecoder server itself, every candidate attended
#: (token-identical to dense: tests/dualdecoder/test_dualdecoder_e2e.py), so each prompt is prefilled once in the run.
FULL_TOP_K = {"dd_top_k": 1_000_000, "dd_selector": "oracle"}
RETRIEVAL_TOKENS = 12
STOP = ["\n", "."]


def all_configs() -> dict[str, dict]:
    """Every selector (:data:`CONFIGS`)."""
    return dict(CONFIGS)


def parse_configs(arg: str | None) -> dict[str, dict]:
    """``None``: :data:`CONFIGS`; ``all``: :func:`all_configs`; else a comma list of their names.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if not arg:
        return dict(CONFIGS)
    known = {**all_configs(), **CONFIGS, **EXTRA_CONFIGS}
    if arg == "all":
        return all_configs()
    out = {}
    for name in arg.split(","):
        if name not in known:
            raise ValueError(f"--configs: unknown configuration {name!r}; known: {sorted(known)}")
        out[name] = known[name]
    return out


def text_window(tok_ids: list[int], n: int, extra: int, seed: int) -> int:
    """Start offset of a window of ``n + extra`` tokens of a text, fixed by ``seed``."""
    import random

    if len(tok_ids) < n + extra + 1:
        raise ValueError(f"text has {len(tok_ids)} tokens, fewer than {n + extra + 1}")
    return random.Random(seed).randrange(0, len(tok_ids) - n - extra)


def agreement(got: list[int], ref: list[int]) -> dict:
    lead = next((i for i, (a, b) in enumerate(zip(got, ref, strict=False)) if a != b), min(len(got), len(ref)))
    return {"identical_leading": lead, "matching": sum(a == b for a, b in zip(got, ref, strict=False)),
            "of": len(ref)}  # fmt: skip


def build_inputs(tok, contexts, trials, texts, nll_tokens, agree_tokens):
    """The retrieval trials and the long-text windows of the run (module docstring)."""
    trial_cases = {}
    for n in contexts:
        cases = []
        for i in range(trials):
            depth = 0.05 + 0.9 * ((i * 7) % trials) / max(1, trials - 1)
            kind = "fact" if i % 2 == 0 else "passkey"
            cases.append(needle_prompt(tok, texts[i % len(texts)], n, round(depth, 3), kind, 1000 * n + i))
        trial_cases[n] = cases
    windows = {}
    extra = max(nll_tokens, agree_tokens) + 1
    for name in texts:
        ids = tok.encode(text(name))
        for n in contexts:
            o = text_window(ids, n, extra, zlib.crc32(f"{name}:{n}".encode()))
            windows[(name, n)] = (ids[o : o + n], ids[o + n : o + n + extra])
    return trial_cases, windows


def run(args) -> dict:
    from transformers import AutoTokenizer

    from dd_sglang.models.smollm2 import prepare_model

    tok = AutoTokenizer.from_pretrained(prepare_model(progress=False))
    n_layers = n_layers_of_model()
    contexts = [int(x) for x in args.contexts.split(",")]
    fractions = [int(x) for x in args.fractions.split(",")]
    texts = args.texts.split(",") if args.texts else available_texts()
    configs = parse_configs(args.configs)
    t_build = time.monotonic()
    trial_cases, windows = build_inputs(tok, contexts, args.trials, texts, args.nll_tokens, args.agree_tokens)
    tmp = Path(tempfile.mkdtemp(prefix="dd_fidelity_"))
    timing: dict = {"build_inputs_s": round(time.monotonic() - t_build, 1)}
    dense: dict = {"retrieval": {}, "nll": {}, "agreement": {}}
    records: list[dict] = []

    # ---- dense: every dense request, one server (or the dualdecoder one at full top_k, --dense full_top_k)
    t0 = time.monotonic()
    full = args.dense == "full_top_k"
    dcustom = FULL_TOP_K if full else None
    url = args.dd_url if full else args.dense_url
    with served("dualdecoder" if full else "torch_native", url, args.dd_metrics_url if full else None, tmp, CAP,
                keep=full, sets=args.set if full else None) as ep:  # fmt: skip
        timing["dense_server_start_s"] = ep.start_seconds
        for n in contexts:
            for i, case in enumerate(tqdm(trial_cases[n], desc=f"dense retrieval {n}", unit="trial")):
                r = generate(ep, tok.encode(case.prompt), RETRIEVAL_TOKENS, custom=dcustom, stop=STOP)
                dense["retrieval"][(n, i)] = {"completion": r["text"], "found": case.found(r["text"]),
                                              "seconds": round(r["seconds"], 2)}  # fmt: skip
            for name in texts:
                prompt, cont = windows[(name, n)]
                force = cont[: args.nll_tokens + 1]
                r = generate(ep, prompt, len(force), custom=dcustom, force=force)
                scores = forced_scores(r, force)[1:]
                ref = prefill_logprobs(ep, prompt + force, len(prompt) + 1)
                diff = max(abs(a - b) for (a, _), b in zip(scores, ref, strict=True))
                dense["nll"][(name, n)] = {"lp": [s for s, _ in scores], "top1": [t for _, t in scores],
                                           "decode_vs_prefill_max_abs": round(diff, 5),
                                           "seconds": round(r["seconds"], 2)}  # fmt: skip
                g = generate(ep, prompt, args.agree_tokens, custom=dcustom)
                dense["agreement"][(name, n)] = g["output_ids"]
    timing["dense_phase_s"] = round(time.monotonic() - t0, 1)

    # ---- sparse: per prompt, every configuration and k
    t0 = time.monotonic()
    cell_seconds: dict = defaultdict(float)
    with served("dualdecoder", args.dd_url or (ep.url if full else None), args.dd_metrics_url or
                (ep.metrics_url if full else None), tmp, CAP, sets=args.set) as ep:  # fmt: skip
        timing["dd_server_start_s"] = ep.start_seconds
        grid = [(name, custom, f) for name, custom in configs.items() for f in fractions]
        for n in contexts:
            for i, case in enumerate(tqdm(trial_cases[n], desc=f"sparse retrieval {n}", unit="trial")):
                ids = tok.encode(case.prompt)
                for name, custom, f in grid:
                    k = n // f
                    with Counters(ep) as c:
                        r = generate(ep, ids, RETRIEVAL_TOKENS, custom={**custom, "dd_top_k": k}, stop=STOP)
                    cell_seconds[(n, name, f)] += r["seconds"]
                    records.append({"part": "retrieval", "context": n, "config": name, "k": k, "fraction": f,
                                    "trial": i, "text": case.text, "kind": case.kind, "depth": case.depth,
                                    "answer": case.answer, "prompt_tokens": case.n_tokens,
                                    "completion": r["text"], "found": case.found(r["text"]),
                                    "prefetch": c.prefetch(custom, n_layers), "seconds": round(r["seconds"], 2)})  # fmt: skip
            for tname in tqdm(texts, desc=f"sparse nll+agreement {n}", unit="text"):
                prompt, cont = windows[(tname, n)]
                force = cont[: args.nll_tokens + 1]
                for name, custom, f in grid:
                    k = n // f
                    with Counters(ep) as c:
                        r = generate(ep, prompt, len(force), custom={**custom, "dd_top_k": k}, force=force)
                    scores = forced_scores(r, force)[1:]
                    cell_seconds[(n, name, f)] += r["seconds"]
                    records.append({"part": "nll", "context": n, "config": name, "k": k, "fraction": f,
                                    "text": tname, "lp": [s for s, _ in scores], "top1": [t for _, t in scores],
                                    "steps": len(force) - 1, "prefetch": c.prefetch(custom, n_layers),
                                    "seconds": round(r["seconds"], 2)})  # fmt: skip
                    with Counters(ep) as c:
                        g = generate(ep, prompt, args.agree_tokens, custom={**custom, "dd_top_k": k})
                    cell_seconds[(n, name, f)] += g["seconds"]
                    records.append({"part": "agreement", "context": n, "config": name, "k": k, "fraction": f,
                                    "text": tname, **agreement(g["output_ids"], dense["agreement"][(tname, n)]),
                                    "steps": args.agree_tokens - 1, "prefetch": c.prefetch(custom, n_layers),
                                    "seconds": round(g["seconds"], 2)})  # fmt: skip
    timing["sparse_phase_s"] = round(time.monotonic() - t0, 1)
    if not any(tmp.iterdir()):  # servers started here leave their logs there; else it is empty
        tmp.rmdir()
    return summarize(args, contexts, fractions, texts, configs, trial_cases, dense, records, cell_seconds,
                     timing, n_layers)  # fmt: skip


def _pool_prefetch(recs: list[dict]) -> dict:
    lookups = sum(r["prefetch"]["lookups"] for r in recs)
    hits = sum(r["prefetch"]["hits"] for r in recs)
    proposed = sum(r["prefetch"]["proposed"] for r in recs)
    accepted = sum(r["prefetch"]["accepted"] for r in recs)
    mass = [r["prefetch"]["mass_coverage"] for r in recs if r["prefetch"]["mass_coverage"] is not None]
    return {"recall": round(hits / lookups, 4) if lookups else None,
            "mass_coverage_mean": round(sum(mass) / len(mass), 4) if mass else None,
            "acceptance": round(accepted / proposed, 4) if proposed else None,
            "lookahead_misses": sum(r["prefetch"]["lookahead_misses"] for r in recs),
            "repaired_tokens": sum(r["prefetch"]["repaired_tokens"] for r in recs)}  # fmt: skip


def summarize(args, contexts, fractions, texts, configs, trial_cases, dense, records, cell_seconds, timing,
              n_layers) -> dict:  # fmt: skip
    """Per-cell figures (module docstring) from the raw records."""
    cells = []
    dense_cells = []
    for n in contexts:
        found = sum(dense["retrieval"][(n, i)]["found"] for i in range(len(trial_cases[n])))
        lo, hi = wilson(found, len(trial_cases[n]))
        d_lp = [x for t in texts for x in dense["nll"][(t, n)]["lp"]]
        d_top1 = [x for t in texts for x in dense["nll"][(t, n)]["top1"]]
        dense_cells.append({
            "context": n, "config": "dense",
            "retrieval": {"found": found, "trials": len(trial_cases[n]), "accuracy": round(found / len(trial_cases[n]), 4),
                          "ci_low": round(lo, 4), "ci_high": round(hi, 4)},
            "nll": {"tokens": len(d_lp), "mean": round(-sum(d_lp) / len(d_lp), 5),
                    "top1": round(sum(d_top1) / len(d_top1), 4),
                    "decode_vs_prefill_max_abs": max(dense["nll"][(t, n)]["decode_vs_prefill_max_abs"] for t in texts)},
        })  # fmt: skip
        d_nll = -sum(d_lp) / len(d_lp)
        for name in configs:
            for f in fractions:
                mine = [r for r in records if r["context"] == n and r["config"] == name and r["fraction"] == f]
                ret = [r for r in mine if r["part"] == "retrieval"]
                nll = [r for r in mine if r["part"] == "nll"]
                agr = [r for r in mine if r["part"] == "agreement"]
                nf = sum(r["found"] for r in ret)
                vs_dense = {"lost": [r["trial"] for r in ret if dense["retrieval"][(n, r["trial"])]["found"] and not r["found"]],
                            "gained": [r["trial"] for r in ret if r["found"] and not dense["retrieval"][(n, r["trial"])]["found"]]}  # fmt: skip
                lo, hi = wilson(nf, len(ret))
                lp = [x for t in texts for r in nll if r["text"] == t for x in r["lp"]]
                top1 = [x for r in nll for x in r["top1"]]
                diffs = [-(a - b) for t in texts for r in nll if r["text"] == t
                         for a, b in zip(r["lp"], dense["nll"][(t, n)]["lp"], strict=True)]  # fmt: skip
                nll_mean = -sum(lp) / len(lp)
                steps = sum(r["steps"] for r in nll)
                rows = sum(r["prefetch"]["sparse_rows"] for r in nll)
                cells.append({
                    "context": n, "config": name, "k": n // f, "fraction": f,
                    "retrieval": {"found": nf, "trials": len(ret), "accuracy": round(nf / len(ret), 4),
                                  "ci_low": round(lo, 4), "ci_high": round(hi, 4), "vs_dense": vs_dense,
                                  "same_as_dense": not vs_dense["lost"] and not vs_dense["gained"]},
                    "nll": {"tokens": len(lp), "mean": round(nll_mean, 5), "ratio_to_dense": round(nll_mean / d_nll, 5),
                            "delta_vs_dense": mean_ci(diffs), "top1": round(sum(top1) / len(top1), 4),
                            "sparse_rows": rows, "expected_sparse_rows": steps * n_layers,
                            "all_steps_sparse": rows == steps * n_layers},
                    "agreement": {"identical_leading_mean": round(sum(r["identical_leading"] for r in agr) / len(agr), 2),
                                  "identical_leading_min": min(r["identical_leading"] for r in agr),
                                  "matching_fraction": round(sum(r["matching"] for r in agr) / sum(r["of"] for r in agr), 4),
                                  "of": agr[0]["of"], "texts": len(agr)},
                    "prefetch": _pool_prefetch(mine),
                    "seconds": round(cell_seconds[(n, name, f)], 1),
                })  # fmt: skip
    # Trials the default misses while oracle at the same k finds them (issue 10's first "done when").
    lost = []
    for r in records:
        if r["part"] == "retrieval" and r["config"] == DEFAULT_CONFIG and not r["found"]:
            o = next((x for x in records if x["part"] == "retrieval" and x["config"] == "oracle"
                      and x["context"] == r["context"] and x["fraction"] == r["fraction"]
                      and x["trial"] == r["trial"]), None)  # fmt: skip
            if o is not None and o["found"]:
                lost.append({k: r[k] for k in ("context", "fraction", "k", "trial", "text", "kind", "depth",
                                                "answer", "completion")} | {"oracle_completion": o["completion"]})  # fmt: skip
    dense_trials = [{"context": n, "trial": i, **{k: v for k, v in dense["retrieval"][(n, i)].items()},
                     "text": c.text, "kind": c.kind, "depth": c.depth, "answer": c.answer, "prompt_tokens": c.n_tokens}
                    for n in contexts for i, c in enumerate(trial_cases[n])]  # fmt: skip
    return {
        "benchmark": "fidelity of the sparse path against dense: retrieval, teacher-forced NLL through the "
                     "decode path, greedy agreement; CPU, SmolLM2-135M",
        "settings": {"contexts": contexts, "fractions": fractions, "trials": args.trials, "texts": texts,
                     "nll_tokens": args.nll_tokens, "agree_tokens": args.agree_tokens,
                     "retrieval_tokens": RETRIEVAL_TOKENS, "dense": args.dense, "configs": configs, "default_config": DEFAULT_CONFIG,
                     "prefetch_hit_rate_sample": 1.0, "set": args.set, "quick": args.quick},
        "dense": dense_cells,
        "cells": cells,
        "default_lost_vs_oracle": lost,
        "dense_trials": dense_trials,
        "records": [{k: v for k, v in r.items() if k not in ("lp", "top1")} for r in records],
        "timing": timing,
    }  # fmt: skip


QUICK = {"contexts": "1200", "fractions": "8", "trials": 2, "nll_tokens": 8, "agree_tokens": 8,
         "texts": "python_docs", "configs": "oracle,spec_host+dual_token"}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fidelity", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--out", default="bench/results/fidelity_cpu.json")
    ap.add_argument("--contexts", default="2000,4000,7500", help="prompt tokens, comma-separated")
    ap.add_argument("--fractions", default="8,16,32", help="k = context / F for each F")
    ap.add_argument("--trials", type=int, default=20, help="retrieval trials per context")
    ap.add_argument("--nll-tokens", type=int, default=128, help="teacher-forced scored tokens per text")
    ap.add_argument("--agree-tokens", type=int, default=64, help="greedy tokens compared with dense per text")
    ap.add_argument("--texts", default=None, help="comma list of harness.texts.TEXTS (default: all available)")
    ap.add_argument("--configs", default=None, help="comma list of configuration names, or 'all'")
    ap.add_argument("--dense-url", default=None, help="a running torch_native server (with "
                    "--enable-custom-logit-processor --disable-overlap-schedule: teacher forcing needs both) "
                    "instead of starting one")  # fmt: skip
    ap.add_argument("--dd-url", default=None, help="a running dualdecoder server (same flag) instead of starting one")  # fmt: skip
    ap.add_argument("--dd-metrics-url", default=None, help="its sidecar (needed with --dd-url)")
    ap.add_argument("--dense", choices=["torch_native", "full_top_k"], default="torch_native",
                    help="dense reference: a torch_native server, or the dualdecoder server at dd_top_k >= context "
                         "(one server for the whole run; each prompt prefilled once)")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help=f"tiny run for the test suite: {QUICK}")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="a preset key of the dualdecoder server this run starts (repeatable), e.g. "
                         "prefetch.rerank=4 or experimental.kernel=torch; a YAML value")  # fmt: skip
    args = ap.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            if ap.get_default(k) == getattr(args, k):
                setattr(args, k, v)
    if args.dd_url and not args.dd_metrics_url:
        ap.error("--dd-url needs --dd-metrics-url (the prefetch counters come from the sidecar)")
    if args.set and args.dd_url:
        ap.error("--set sets the server this run starts; it cannot change --dd-url's")
    try:  # refused before any server starts, with the preset schema's own message
        args.set = parse_sets(args.set) or None
    except ValueError as err:
        ap.error(str(err))
    t0 = time.monotonic()
    result = {
        "command": "python -m bench.fidelity " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count()},
    }
    try:
        result.update(run(args))
    finally:
        stop_left_running()
    result["wall_seconds"] = round(time.monotonic() - t0, 1)
    write_result(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
