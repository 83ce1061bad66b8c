"""Diagnosis of issue 10's failing input: which decode step leaves the dense path, and why.

Usage::

    python -m bench.issue10 [--dd-url URL --dd-metrics-url URL] [--out bench/results/issue10_cpu.json]
                            [--configs NAME,...] [--sweep NAME,...] [--sweep-k 512,2048] [--skip-offline]

Input: :func:`harness.texts.issue10_prompt` (Debian's Apache-2.0 then GPL-3
words, ``random.Random(2)`` window of 3,000 words, "The navigator of the
expedition was called Leopold." at 40%), greedy, 16 tokens.

**Serving part** (one ``dualdecoder`` server, default CPU preset with
``prefetch.hit_rate_sample: 1``, custom logit processors on; or the one given).
The reference is the sparse path at ``dd_top_k`` 8192 (>= the context: token-
identical to dense, as ``tests/dualdecoder/test_dualdecoder_e2e.py`` asserts). For each
configuration (selector x speculator x miss policy x top_k): the greedy answer,
whether it contains "Leopold", the first token where it leaves the reference,
and, teacher-forcing the reference tokens through the decode path
(:class:`harness.teacher_force.ForceTokensScored`), per step the model's
log-probability of the reference token and whether it was still the argmax:
the step where it is not is the step that loses the answer. For the steps that
lose it, the prefetch recall of that single step (all layers), from the
counters read around two forced requests of ``s`` and ``s + 1`` tokens.

**Offline part** (HF transformers, float32, full attention): at the losing
step, per layer and KV head, the rank of the fact's tokens (" Leopold" and the
words before it in the document) among the candidates under the real query
and under the query of the token the speculator put forward instead (prompt
lookup's proposal, :func:`dd_sglang.prefetch.speculators.ngram_propose`),
and whether they fall inside the top-k.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from bench.cli import write_result
from harness.client import Counters, forced_scores, generate, n_layers_of_model, served
from harness.texts import issue10_prompt

DEFAULT = {"dd_selector": "spec_host", "dd_speculator": "dual_token"}
REF = {"dd_top_k": 8192, "dd_selector": "oracle", "dd_speculator": "none"}
CONFIGS = {
    "default": {},
    "oracle": {"dd_selector": "oracle", "dd_speculator": "none"},
    "spec_host+dual_token+verify": {"dd_miss_policy": "verify"},
    "spec_host+ngram": {"dd_selector": "spec_host", "dd_speculator": "ngram"},
    "spec_host+ngram+verify": {"dd_selector": "spec_host", "dd_speculator": "ngram", "dd_miss_policy": "verify"},
    "spec_host+none": {"dd_selector": "spec_host", "dd_speculator": "none"},
    "recency": {"dd_selector": "recency", "dd_speculator": "none"},
    "quest_device": {"dd_selector": "quest_device", "dd_speculator": "none"},
}
TOP_K_SWEEP = "512,2048"
#: Configurations whose failure is followed by the top_k sweep (what top_k does the selector need?).
SWEPT = "spec_host+ngram"


def serve_part(args, tok, ids, n_layers, tmp) -> dict:
    out: dict = {"configs": {}}
    with served("dualdecoder", args.dd_url, args.dd_metrics_url, tmp, 16384) as ep:
        ref = generate(ep, ids, 16, custom=REF)
        ref_ids = ref["output_ids"]
        out["reference"] = {"text": ref["text"], "ids": ref_ids, "pieces": [tok.decode([t]) for t in ref_ids]}
        todo = {name: CONFIGS[name] for name in args.configs.split(",")}
        swept, sweep_k = args.sweep.split(","), [int(k) for k in args.sweep_k.split(",")]
        results = out["configs"]
        while todo:
            name = next(iter(todo))
            custom = todo.pop(name)
            with Counters(ep) as c:
                g = generate(ep, ids, 16, custom=custom)
            with Counters(ep) as cf:
                f = generate(ep, ids, len(ref_ids), custom=custom, force=ref_ids)
            scores = forced_scores(f, ref_ids)
            got = g["output_ids"]
            leave = next((i for i, (a, b) in enumerate(zip(got, ref_ids, strict=False)) if a != b), None)
            lost_steps = [j for j, (_, top) in enumerate(scores) if not top]
            results[name] = {
                "custom_params": custom, "answer": g["text"], "found": "Leopold" in g["text"],
                "leaves_reference_at": leave,
                "leaves_with": None if leave is None else tok.decode([got[leave]]),
                "forced_logprob": [round(s, 4) for s, _ in scores], "forced_not_argmax_steps": lost_steps,
                "prefetch_greedy": c.prefetch({**DEFAULT, **custom}, n_layers),
                "prefetch_forced": cf.prefetch({**DEFAULT, **custom}, n_layers),
            }  # fmt: skip
            print(f"{name:40s} {g['text']!r:60s} leaves at {leave} forced-not-argmax {lost_steps}", flush=True)
            if not results[name]["found"] and name in swept:
                for k in sweep_k:  # what top_k does this configuration need?
                    todo[f"{name} @ top_k {k}"] = {**custom, "dd_top_k": k}
        # Per-layer recall at the first losing step of each losing configuration (forced, s vs s + 1 tokens).
        for r in list(results.values()):
            if r["found"] or not r["forced_not_argmax_steps"] or "dd_top_k" in r["custom_params"]:
                continue
            s = r["forced_not_argmax_steps"][0]
            custom = {"dd_selector": "spec_host", "dd_speculator": "dual_token", **r["custom_params"]}
            with Counters(ep) as a:
                generate(ep, ids, s, custom=r["custom_params"], force=ref_ids[:s])
            with Counters(ep) as b:
                generate(ep, ids, s + 1, custom=r["custom_params"], force=ref_ids[: s + 1])
            pa, pb = a.prefetch(custom, n_layers), b.prefetch(custom, n_layers)
            hits, lookups = pb["hits"] - pa["hits"], pb["lookups"] - pa["lookups"]
            r["losing_step"] = {
                "step": s, "input_token": tok.decode([ref_ids[s - 1]]) if s else None,
                "wanted": tok.decode([ref_ids[s]]),
                "recall": round(hits / lookups, 4) if lookups else None,
                "speculation_accepted_before": pb["accepted"] - pa["accepted"],
                "speculations_checked": pb["proposed"] - pa["proposed"],
            }  # fmt: skip
    return out


def offline_part(tok, ids: list[int], ref_ids: list[int], step: int, k: int = 256) -> dict:
    """Ranks of the fact's tokens under the real and the prompt-lookup query at decode ``step`` (HF, full attention)."""
    import torch

    from bench.ceiling import QueryCapture, load_model
    from dd_sglang.prefetch.selectors import gqa_token_scores
    from dd_sglang.prefetch.speculators import SpecState, ngram_propose

    model = load_model()
    cap = QueryCapture(model)
    leo = [p for p, t in enumerate(ids) if tok.decode([t]) == " Leopold"]
    if len(leo) != 1:
        raise ValueError(f"expected one ' Leopold' token in the prompt, found {len(leo)}")
    fact_pos = [leo[0] - 2, leo[0] - 1, leo[0]]  # " was", " called", " Leopold" in the document
    seq = ids + ref_ids[:step]  # context through the losing step's input token
    history = list(seq)
    proposal = ngram_propose(history[:-1], SpecState())  # what prompt lookup proposed for this step's input
    real = seq[-1]
    cfg = model.config
    scale = (cfg.hidden_size // cfg.num_attention_heads) ** -0.5
    with torch.no_grad():
        runs = {}
        for name, tok_id in (("real", real), ("prompt_lookup", proposal)):
            if tok_id is None:
                continue
            out = model(torch.tensor([seq[:-1] + [tok_id]]), use_cache=True)
            runs[name] = (dict(cap.queries), out.past_key_values)
    cap.close()
    n_ctx = len(seq)
    hi = n_ctx - 128
    res = {"step": step, "real_input": tok.decode([real]),
           "prompt_lookup_proposal": None if proposal is None else tok.decode([proposal]),
           "fact_positions": {p: tok.decode([ids[p]]) for p in fact_pos}, "k": k, "layers": []}  # fmt: skip
    cache = runs["real"][1]
    for layer in range(cfg.num_hidden_layers):
        keys = cache.layers[layer].keys[0, :, 4:hi, :].permute(1, 0, 2).float()
        row = {"layer": layer}
        for name, (qs, _) in runs.items():
            sc = gqa_token_scores(qs[layer], keys, scale)  # [Hkv, C]
            order = sc.argsort(dim=-1, descending=True)
            rank = torch.empty_like(order)
            rank.scatter_(1, order, torch.arange(order.shape[1]).expand_as(order))
            row[name] = {tok.decode([ids[p]]): [int(rank[h, p - 4]) for h in range(sc.shape[0])] for p in fact_pos}
        res["layers"].append(row)
    res["leopold_in_real_topk_heads"] = sum(1 for r in res["layers"] for h in r["real"][" Leopold"] if h < k)
    if "prompt_lookup" in runs:
        res["leopold_in_real_not_in_lookup_topk_heads"] = sum(
            1 for r in res["layers"] for a, b in zip(r["real"][" Leopold"], r["prompt_lookup"][" Leopold"], strict=True)
            if a < k <= b)  # fmt: skip
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.issue10", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--out", default="bench/results/issue10_cpu.json")
    ap.add_argument("--dd-url", default=None)
    ap.add_argument("--dd-metrics-url", default=None)
    ap.add_argument("--skip-offline", action="store_true")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {list(CONFIGS)}")
    ap.add_argument("--sweep", default=SWEPT, help="configurations swept over --sweep-k when they lose the answer")
    ap.add_argument("--sweep-k", default=TOP_K_SWEEP)
    args = ap.parse_args(argv)
    for name in args.configs.split(","):
        if name not in CONFIGS:
            ap.error(f"--configs: unknown {name!r}; known: {list(CONFIGS)}")
    from transformers import AutoTokenizer

    from dd_sglang.models.smollm2 import prepare_model

    t0 = time.monotonic()
    tok = AutoTokenizer.from_pretrained(prepare_model(progress=False))
    ids = tok.encode(issue10_prompt())
    tmp = Path(tempfile.mkdtemp(prefix="dd_issue10_"))
    result = {"command": "python -m bench.issue10 " + " ".join(argv if argv is not None else sys.argv[1:]),
              "prompt_tokens": len(ids)}  # fmt: skip
    result.update(serve_part(args, tok, ids, n_layers_of_model(), tmp))
    if not args.skip_offline:
        losing = [r["forced_not_argmax_steps"][0] for r in result["configs"].values()
                  if not r["found"] and r["forced_not_argmax_steps"]]  # fmt: skip
        if losing:
            result["offline"] = offline_part(tok, ids, result["reference"]["ids"], min(losing))
    result["wall_seconds"] = round(time.monotonic() - t0, 1)
    write_result(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
