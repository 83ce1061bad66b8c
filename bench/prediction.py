"""Prefetch prediction quality in serving, per layer and regime, against the perfect-speculator ceiling.

Usage::

    python -m bench.prediction [--contexts 4000,7900] [--fractions 16,32] [--tokens 128]
                               [--texts licenses,python_docs,package_docs] [--windows 2]
                               [--configs spec_host+dual_token,recency]
                               [--regimes greedy,sample_t0.8,teacher_forced]
                               [--variants default,d3=prefetch.depth:3]
                               [--dd-url URL --dd-metrics-url URL] [--skip-ceiling]
                               [--out bench/results/prediction_cpu.json] [--quick]

**Serving part** (a ``dualdecoder`` server, default CPU preset with
``prefetch.hit_rate_sample: 1``, ``--enable-custom-logit-processor``; or the
one given). For each context, k = context / F, regime, configuration, and
each text window (``--windows`` per text at seeded offsets), one request of
``--tokens`` output tokens continues the text; requests run one at a time and
the sidecar's counters are read around each, so every figure is per request:
recall = ``dd_prefetch_hits_total / dd_prefetch_lookups_total`` (|set fixed one
step earlier ∩ exact top-k of the real query| / k, every step, layer and KV
head), attention-mass coverage = ``dd_prefetch_mass_prefetched_total /
dd_prefetch_mass_top_k_total``, per-layer recall = the per-layer histogram's
``sum / count``, acceptance = ``dd_spec_accepted_total / dd_spec_proposed_total``.
Regimes (DESIGN.md): ``greedy``; ``sample_t0.8`` (temperature 0.8, top-p 0.95,
seed per request); ``teacher_forced`` (output forced to the text's next tokens by
:class:`harness.teacher_force.ForceTokensScored`); ``replay_t0.8`` (a paired form of
``sample_t0.8``: one continuation per window is sampled at T 0.8 / top-p 0.95 on the
first variant's dense path, ``dd_sparse: false``, then teacher-forced through every
configuration and variant, so they predict the same token sequence and differ
only in their prediction; the ceiling scores the same sequence). A cell (context x k x regime x
configuration) reports the mean over its requests with a 95% Student-t
interval (n = texts x windows).

**Variants** (``--variants``): the serving part runs once per server variant, one
after another in the same run: ``default`` is the preset; ``NAME=SECTION.KEY:value/SECTION.KEY:value``
sets those preset keys (as ``--set SECTION.KEY=value`` does elsewhere, :func:`harness.client.parse_sets`:
validated by the preset schema before any server starts), and the variant's cells carry the configuration
name ``config[NAME]``. Recall is a count, not a time, so variants need not run at once.

**Ceiling part** (same run, after the server part; :mod:`bench.ceiling`, HF
transformers on the same converted model, float32): for the same windows,
regimes and k, the recall and mass coverage of the set chosen from the query
of the argmax after the true context (a perfect speculator), and of the
previous step's exact set (``recency``), per layer. The per-layer mass
coverage of the *served* configurations is not exported by the server (only
the pooled counters), so per-layer mass appears for the ceiling only.

Nothing here is a pass/fail test.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import tempfile
import time
import zlib
from pathlib import Path

from tqdm import tqdm

from bench.cli import write_result
from bench.fidelity import parse_configs
from bench.stats import mean_ci
from harness.client import Counters, generate, n_layers_of_model, served
from harness.texts import available_texts, text

REGIMES = ("greedy", "sample_t0.8", "teacher_forced", "replay_t0.8")
CAP = 16384
SAMPLING = {"temperature": 0.8, "top_p": 0.95}


def windows_of(tok, texts: list[str], contexts: list[int], n_windows: int, extra: int) -> dict:
    """``{(text, context, w): (prompt ids, continuation ids)}`` at offsets seeded by (text, context, w)."""
    out = {}
    for name in texts:
        ids = tok.encode(text(name))
        for n in contexts:
            if len(ids) < n + extra + 1:
                raise ValueError(f"text {name!r} has {len(ids)} tokens, fewer than {n + extra + 1}")
            for w in range(n_windows):
                o = random.Random(zlib.crc32(f"{name}:{n}:{w}".encode())).randrange(0, len(ids) - n - extra)
                out[(name, n, w)] = (ids[o : o + n], ids[o + n : o + n + extra])
    return out


def parse_variants(arg: str) -> dict[str, dict]:
    """``--variants``: ``{name: {"SECTION.KEY": value}}`` (module docstring), ``default`` first if named.

    Raises:
        ValueError: a malformed item, a repeated name, or keys the preset schema refuses (the
            message names ``--variants`` and the schema's complaint).
    """
    from harness.client import parse_sets

    out: dict[str, dict] = {}
    for item in arg.split(","):
        name, _, spec = item.partition("=")
        if not name or name in out or (name == "default") == bool(spec):
            raise ValueError(f"--variants: bad item {item!r} (default, or NAME=SECTION.KEY:value/...; names unique)")
        items = []
        for kv in spec.split("/") if spec else []:
            key, sep, value = kv.partition(":")
            if not sep:
                raise ValueError(f"--variants: {kv!r} in {item!r} is not SECTION.KEY:value")
            items.append(f"{key}={value}")
        out[name] = parse_sets(items, f"--variants {name}")
    return out


def variant_label(config: str, variant: str) -> str:
    """A configuration's name in a variant's cells: ``config`` for ``default``, else ``config[variant]``."""
    return config if variant == "default" else f"{config}[{variant}]"


def _seed(tname: str, n: int, w: int) -> int:
    return zlib.crc32(f"{tname}:{n}:{w}".encode()) % 100000


def sample_replays(ep, wins, tokens: int) -> dict:
    """``{window: ids}``: ``tokens`` tokens sampled at :data:`SAMPLING` (the window's seed) on the dense path."""
    out = {}
    for (tname, n, w), (prompt, _) in tqdm(sorted(wins.items()), desc="replays", unit="window"):
        sampling = {**SAMPLING, "sampling_seed": _seed(tname, n, w)}
        out[(tname, n, w)] = generate(ep, prompt, tokens, sampling, {"dd_sparse": False})["output_ids"]
    return out


def serve_part(args, tok, wins, contexts, fractions, configs, regimes, n_layers, tmp) -> tuple[list, dict, dict]:
    runs, start, replays = [], {}, {}
    for variant, keys in args.variant_keys.items():
        with served("dualdecoder", args.dd_url, args.dd_metrics_url, tmp, CAP, sets=keys) as ep:
            if "replay_t0.8" in regimes and not replays:
                replays = sample_replays(ep, wins, args.tokens)
            labelled = {variant_label(n, variant): c for n, c in configs.items()}
            runs += _serve_variant(args, ep, wins, fractions, labelled, regimes, n_layers, replays)
            start[variant] = ep.start_seconds
    return runs, {"dd_server_start_s": start}, replays


def _serve_variant(args, ep, wins, fractions, configs, regimes, n_layers, replays) -> list:
    runs = []
    grid = [(f, reg, name, custom) for f in fractions for reg in regimes for name, custom in configs.items()]
    for (tname, n, w), (prompt, cont) in tqdm(sorted(wins.items()), desc="serving", unit="window"):
        for f, reg, name, custom in grid:
            k = n // f
            c_params = {**custom, "dd_top_k": k}
            sampling, force = None, None
            if reg == "sample_t0.8":
                sampling = {**SAMPLING, "sampling_seed": _seed(tname, n, w)}
            elif reg == "teacher_forced":
                force = cont[: args.tokens]
            elif reg == "replay_t0.8":
                force = replays[(tname, n, w)]
            with Counters(ep) as c:
                r = generate(ep, prompt, args.tokens, sampling, c_params, force=force)
            if force is not None and r["output_ids"] != force:
                raise RuntimeError("teacher forcing did not hold (is --enable-custom-logit-processor on?)")
            runs.append({"context": n, "k": k, "fraction": f, "regime": reg, "config": name, "text": tname,
                         "window": w, "output_tokens": len(r["output_ids"]), **c.prefetch(custom, n_layers),
                         "seconds": round(r["seconds"], 2)})  # fmt: skip
    return runs


def ceiling_part(args, wins, contexts, fractions, regimes, replays) -> list:
    import torch

    from bench.ceiling import ceiling_run, load_model

    torch.manual_seed(0)
    model = load_model()
    out = []
    for (tname, n, w), (prompt, cont) in tqdm(sorted(wins.items()), desc="ceiling", unit="window"):
        ks = [n // f for f in fractions]
        for reg in regimes:
            t0 = time.monotonic()
            if reg == "replay_t0.8":  # the replayed sequence, forced as the text's is
                res = ceiling_run(model, prompt, replays[(tname, n, w)], args.tokens - 2, "teacher_forced", ks)
            else:
                res = ceiling_run(model, prompt, cont, args.tokens - 2, reg, ks, seed=_seed(tname, n, w))
            for f, k in zip(fractions, ks, strict=True):
                out.append({"context": n, "k": k, "fraction": f, "regime": reg, "text": tname, "window": w,
                            "steps": args.tokens - 2, **res[k], "seconds": round(time.monotonic() - t0, 1)})  # fmt: skip
    return out


def _layer_mean(vals: list[float]) -> float:
    return sum(vals) / len(vals)


def summarize(runs, ceil, contexts, fractions, regimes, configs, n_layers) -> dict:
    cells, ceiling_cells = [], []
    for n in contexts:
        for f in fractions:
            for reg in regimes:
                for name in configs:
                    mine = [r for r in runs if (r["context"], r["fraction"], r["regime"], r["config"]) == (n, f, reg, name)]
                    if not mine:
                        continue
                    per_layer = {}
                    for layer in range(n_layers):
                        vals = [r["per_layer_recall"][layer] for r in mine if layer in r["per_layer_recall"]]
                        if vals:
                            per_layer[layer] = mean_ci(vals)
                    cells.append({
                        "context": n, "k": n // f, "fraction": f, "regime": reg, "config": name,
                        "requests": len(mine), "output_tokens": sum(r["output_tokens"] for r in mine),
                        "recall": mean_ci([r["recall"] for r in mine if r["recall"] is not None]),
                        "mass_coverage": mean_ci([r["mass_coverage"] for r in mine if r["mass_coverage"] is not None]),
                        "acceptance": mean_ci([r["acceptance"] for r in mine if r["acceptance"] is not None]),
                        "per_layer_recall": per_layer,
                        "seconds_per_request": round(sum(r["seconds"] for r in mine) / len(mine), 1),
                    })  # fmt: skip
                mine = [c for c in ceil if (c["context"], c["fraction"], c["regime"]) == (n, f, reg)]
                if mine:
                    row = {"context": n, "k": n // f, "fraction": f, "regime": reg, "requests": len(mine)}
                    for m in ("ceiling_recall", "ceiling_mass", "recency_recall", "recency_mass"):
                        row[m] = mean_ci([_layer_mean(c[m]) for c in mine])
                        row[f"{m}_per_layer"] = [round(sum(c[m][i] for c in mine) / len(mine), 5)
                                                 for i in range(len(mine[0][m]))]  # fmt: skip
                    row["spec_equals_real"] = round(sum(c["spec_equals_real"] for c in mine) / len(mine), 4)
                    ceiling_cells.append(row)
    return {"cells": cells, "ceiling_cells": ceiling_cells}


#: ``--quick``: one window, 8 tokens, two regimes (``teacher_forced`` is left out: ``replay_t0.8`` takes
#: the same forced path through the server and through :func:`bench.ceiling.ceiling_run`; ``sample_t0.8``
#: too: ``replay_t0.8`` samples its sequence at the same temperature, and the suite's sampled sparse decode
#: is checked elsewhere, ``tests/dualdecoder/test_attention_trace_e2e.py``). Each regime costs the suite
#: ~13 CPU s on 2 cores, half of it the float32 ceiling run.
QUICK = {"contexts": "1200", "fractions": "8", "tokens": 8, "windows": 1, "texts": "python_docs",
         "configs": "spec_host+dual_token,recency", "regimes": "greedy,replay_t0.8"}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.prediction", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--out", default="bench/results/prediction_cpu.json")
    ap.add_argument("--contexts", default="4000,7900")
    ap.add_argument("--fractions", default="16,32", help="k = context / F for each F")
    ap.add_argument("--tokens", type=int, default=128, help="output tokens per request")
    ap.add_argument("--windows", type=int, default=2, help="text windows per text and context")
    ap.add_argument("--texts", default=None, help="comma list of harness.texts.TEXTS (default: all available)")
    ap.add_argument("--configs", default="spec_host+dual_token,recency")
    ap.add_argument("--regimes", default=",".join(REGIMES))
    ap.add_argument("--variants", default="default", help="server variants (module docstring)")
    ap.add_argument("--dd-url", default=None)
    ap.add_argument("--dd-metrics-url", default=None)
    ap.add_argument("--skip-ceiling", action="store_true")
    ap.add_argument("--skip-serving", action="store_true")
    ap.add_argument("--quick", action="store_true", help=f"tiny run for the test suite: {QUICK}")
    args = ap.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            if ap.get_default(k) == getattr(args, k):
                setattr(args, k, v)
    if args.dd_url and not args.dd_metrics_url:
        ap.error("--dd-url needs --dd-metrics-url")
    if args.tokens < 4:
        ap.error("--tokens must be >= 4 (the first decode step has nothing prefetched)")
    try:
        args.variant_keys = parse_variants(args.variants)
    except ValueError as err:
        ap.error(str(err))
    if args.dd_url and list(args.variant_keys) != ["default"]:
        ap.error("--variants other than default start their own servers: not with --dd-url")
    regimes = args.regimes.split(",")
    for r in regimes:
        if r not in REGIMES:
            ap.error(f"--regimes: {r!r} is not one of {list(REGIMES)}")

    from transformers import AutoTokenizer

    from dd_sglang.models.smollm2 import prepare_model

    t0 = time.monotonic()
    tok = AutoTokenizer.from_pretrained(prepare_model(progress=False))
    n_layers = n_layers_of_model()
    contexts = [int(x) for x in args.contexts.split(",")]
    fractions = [int(x) for x in args.fractions.split(",")]
    texts = args.texts.split(",") if args.texts else available_texts()
    configs = parse_configs(args.configs)
    wins = windows_of(tok, texts, contexts, args.windows, args.tokens + 1)
    tmp = Path(tempfile.mkdtemp(prefix="dd_prediction_"))
    timing: dict = {}
    runs, ceil, replays = [], [], {}
    if "replay_t0.8" in regimes and args.skip_serving:
        ap.error("--regimes replay_t0.8 samples its sequences on the server: not with --skip-serving")
    if not args.skip_serving:
        t1 = time.monotonic()
        runs, info, replays = serve_part(args, tok, wins, contexts, fractions, configs, regimes, n_layers, tmp)
        timing.update(info, serving_s=round(time.monotonic() - t1, 1))
    if not args.skip_ceiling:
        t1 = time.monotonic()
        ceil = ceiling_part(args, wins, contexts, fractions, regimes, replays)
        timing["ceiling_s"] = round(time.monotonic() - t1, 1)
    result = {
        "benchmark": "prefetch recall / attention-mass coverage per layer and regime in serving, with the "
                     "perfect-speculator ceiling and the recency baseline offline; CPU, SmolLM2-135M",
        "command": "python -m bench.prediction " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count()},
        "settings": {"contexts": contexts, "fractions": fractions, "tokens": args.tokens, "windows": args.windows,
                     "texts": texts, "configs": configs, "regimes": regimes, "variants": args.variant_keys, "sampling": SAMPLING,
                     "prefetch_hit_rate_sample": 1.0, "quick": args.quick},
        **summarize(runs, ceil, contexts, fractions, regimes,
                    [variant_label(n, v) for v in args.variant_keys for n in configs], n_layers),  # fmt: skip
        "runs": runs,
        "ceiling_runs": ceil,
        "replays": {f"{t}:{n}:{w}": ids for (t, n, w), ids in replays.items()},
        "timing": timing,
    }  # fmt: skip
    result["wall_seconds"] = round(time.monotonic() - t0, 1)
    write_result(result, args.out)
    if tmp.is_dir() and not any(tmp.iterdir()):  # servers of their own leave their logs there; else nothing
        tmp.rmdir()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
