"""Decode step time, dense vs the sparse default, split by phase (CPU), at batch 1 and 8, 4k and 7.9k contexts.

Usage::

    python -m bench.decode_speed [--out bench/results/decode_speed_cpu.json] [--contexts 4000,7900]
                                 [--batches 1,8] [--new-tokens 48] [--rounds 3] [--warmup-tokens 8]
                                 [--select-worker] [--select-split] [--select-inline] [--torch-kernel]
                                 [--unpacked-dense]
                                 [--temperature 0.8] [--inline-transfer]
                                 [--hit-rate-sample 0.05] [--selectors host_sync]

One run, two servers up at once with room for every request densely
(``--max-total-tokens`` ``--pool-tokens``): SGLang's own dense path
(``torch_native``) and ``dualdecoder`` with the default preset. On the
``dualdecoder`` server each cell runs twice: ``dd_sparse: false`` (the same
dense path through the ``dualdecoder`` wrapper, so its phases are timed) and
the sparse default (the preset's selector: ``host_sync`` in the CPU preset, ``top_k`` 256). A cell is
``batch`` distinct passkey prompts of ~``context`` tokens sent at once, greedy,
``--new-tokens`` each (``ignore_eos``).

Side by side: every configuration of a cell runs once per round, ``--rounds``
rounds, the configurations' order rotating from round to round, so a slow
stretch of a shared machine falls on every configuration alike (an idle server
sleeps: ``sleep-on-idle``). Before the rounds every configuration decodes each
cell once for ``--warmup-tokens`` tokens, not measured: a server's first
sparse request pays one-time costs (host-tier pages touched for the first
time, the first index pages). Reported per configuration: the median over rounds;
per ratio: the median of the per-round ratios and its range.

Per cell and configuration: passkeys found (every round); decode tokens/s
(streamed tokens while every request of the cell was decoding: from the last
request's first token to the first request's last token; prefill, cached or
not, is outside that window); and, from the server's counters over the run (``dd_decode_steps_total``,
``dd_decode_step_seconds_total``, ``dd_step_phase_seconds_total``,
``dd_transfer_*``), the mean decode step split into ``plan`` (building the
step plan), ``select`` (choosing critical sets on the forward thread: cold
starts, synchronous selectors, repairs), ``assemble`` (resident gather and
attention inputs), ``exposed_wait`` (waiting for the layer copies; with
``experimental.transfer`` inline, the copies themselves), ``attention`` (dense and
sparse attention calls) and ``rest`` (the rest of the model: projections,
MLP, norms, logits, and SGLang's per-step work inside the forward). Work off
the forward thread is reported beside it: ``select_ahead`` (next-step
selection on the select worker) and ``copy`` (the copy worker's gathers).
With the selection inline (a CPU's default below 8 rows selecting ahead) ``select_ahead`` runs on the
forward thread and is part of ``rest``.
With ``--select-worker`` a third server runs the same preset with
``experimental.select: worker`` (the next step's selection on the select worker
thread instead of inline on the forward thread, a CPU's default below 8 rows) and each
cell's sparse default again there (``dualdecoder_sparse_select_worker``).
With ``--select-split`` another server runs the preset with ``experimental.select:
split`` (the select worker, and the forward thread's own operations on one
intra-op thread during sparse steps), its runs as
``dualdecoder_sparse_select_split`` and ``split_over_default_select`` the
tokens/s over the default's (``auto``: on a CPU split from
``SPLIT_MIN_ROWS`` rows a step, else inline). With ``--select-inline``
another server runs the preset with ``experimental.select: inline`` (every step
inline), as ``dualdecoder_sparse_select_inline``, and
``default_over_inline_select`` the default's tokens/s over it.
With ``--torch-kernel`` another server runs the preset with ``experimental.kernel:
torch`` (every C path off: PyTorch selection, measurement and copies), its
runs as ``dualdecoder_sparse_torch_kernel`` and ``native_over_torch_kernel``
the C kernel's tokens/s over it.
With ``--unpacked-dense`` one more ``torch_native`` server runs with the CPU
platform's prepacked bfloat16 linear layers off (``DD_SGLANG_CPU_PREPACK=0``,
:mod:`dd_sglang.platform.linear`; every other server packs them), as
``sglang_dense_unpacked``: ``packed_over_unpacked_dense`` is what packing gives
SGLang's own dense path, ``sparse_over_unpacked_dense`` the sparse default over
dense as it ran before packing.
With ``--temperature T`` (> 0) every request samples (temperature T, top-p
0.95, a fixed ``sampling_seed`` per prompt) instead of decoding greedily.
With ``--inline-transfer`` one more ``dualdecoder`` server runs the preset with
``experimental.transfer: inline`` (each layer's critical sets copied into the layer
ring before attention, instead of read in place from the host tier, a CPU's
default), its runs as ``dualdecoder_sparse_inline_transfer`` and
``in_place_over_inline`` the default's tokens/s over it.
Each sparse
breakdown also gives ``repairs`` (verified (request, layer) rows whose
prediction missed a token) and ``repaired_tokens`` (the tokens fetched
synchronously, summed over KV heads) per step.
With ``--hit-rate-sample F`` one more ``dualdecoder`` server runs the preset with
``prefetch.hit_rate_sample: F`` (the fraction of (request, step)s whose prefetch hit
rate is measured against the exact top-k, in every layer), its runs as
``dualdecoder_sparse_hit_rate_sample`` and ``hit_rate_sample_over_default`` its
tokens/s over the default's (the preset's 0.01).
With ``--baseline-tree PATH`` one more ``dualdecoder`` server, same preset and flags, runs from
another checkout of this project (``PATH``, e.g. a worktree of the commit before a change; its
``dd_sglang`` is served), each cell's dense and sparse default there as ``baseline_dense`` and
``baseline_sparse``: ``sparse_over_baseline_tree`` and ``dense_over_baseline_tree`` are this
checkout's tokens/s over that one's, measured side by side.
With ``--selectors A,B`` each named selector also runs on the ``dualdecoder``
server, per request (``custom_params.dd_selector``, the preset's speculator),
as ``dualdecoder_sparse_A``, with ``A_over_sglang_dense`` and
``A_over_sparse_default`` (its tokens/s over the default's, same server).
Ratios are sparse over dense measured in this run; absolute times on a shared
CPU are noise. Nothing here is a pass/fail test.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import yaml

from bench.cli import write_result
from bench.machine import describe, machine_state, summary
from dd_sglang.platform.linear import PREPACK_ENV
from harness.client import bench_preset, preset_dict
from harness.prompts import passkey_prompt
from harness.server import scrape, start_server

PHASES = ("plan", "select", "assemble", "attention")
TPS = "decode_tokens_per_second"


def run_batch(url: str, prompts: list[tuple[str, int]], new_tokens: int, custom: dict | None,
              temperature: float = 0.0) -> dict:  # fmt: skip
    """Send every prompt at once (streamed; greedy, or sampled at ``temperature`` with top-p 0.95 and the
    passkey as ``sampling_seed``); passkeys found and decode tokens/s."""
    results: list[dict] = [{} for _ in prompts]

    def one(i: int, prompt: str, key: int) -> None:
        body = {"model": "x", "prompt": prompt, "max_tokens": new_tokens, "temperature": temperature, "stream": True,
                "ignore_eos": True}  # fmt: skip
        if temperature > 0:
            body.update(top_p=0.95, sampling_seed=key)
        if custom:
            body["custom_params"] = custom
        times, text = [], ""
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=3600) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    times.append(time.monotonic())
                    text += json.loads(line[6:])["choices"][0]["text"]
        results[i] = {"times": times, "found": bool(re.match(rf"\s*{key}\b", text)), "answer": text[:24]}

    threads = [threading.Thread(target=one, args=(i, p, k)) for i, (p, k) in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    start = max(r["times"][0] for r in results)  # every request has its first token: all decode
    end = min(r["times"][-1] for r in results)  # until the first one finishes
    if end <= start:
        raise RuntimeError(f"a request finished before the last one's first token: no window where all "
                           f"{len(prompts)} decode; raise --new-tokens (now {new_tokens})")  # fmt: skip
    decoded = sum(sum(start < t <= end for t in r["times"]) for r in results)
    return {
        "found": sum(r["found"] for r in results),
        "total": len(results),
        TPS: decoded / (end - start),
        "answers": [r["answer"] for r in results],
    }


def _d(after: dict, before: dict, name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def breakdown(before: dict, after: dict, kind: str) -> dict:
    """Mean per-step seconds by phase between two scrapes of a dualdecoder server."""
    steps = _d(after, before, f'dd_decode_steps_total{{kind="{kind}"}}')
    if steps <= 0:
        return {"steps": 0}
    step = _d(after, before, f'dd_decode_step_seconds_total{{kind="{kind}"}}') / steps
    out = {"steps": int(steps), "step": step}
    for p in PHASES:
        out[p] = _d(after, before, f'dd_step_phase_seconds_total{{phase="{p}"}}') / steps
    out["exposed_wait"] = _d(after, before, "dd_transfer_wait_seconds_sum") / steps
    out["rest"] = step - sum(out[p] for p in PHASES) - out["exposed_wait"]
    out["select_ahead"] = _d(after, before, 'dd_step_phase_seconds_total{phase="select_ahead"}') / steps
    out["copy"] = _d(after, before, "dd_transfer_copy_seconds_sum") / steps
    out["transfer_bytes"] = _d(after, before, "dd_transfer_bytes_total") / steps
    # Per step, summed over layers (and, for tokens, KV heads): verified rows whose prediction missed, and
    # the tokens fetched for them.
    out["repairs"] = _d(after, before, 'dd_prefetch_misses_total{policy="verify"}') / steps
    out["repaired_tokens"] = _d(after, before, "dd_prefetch_repaired_tokens_total") / steps
    return out


#: (result key, numerator run, denominator run): ratios of decode tokens/s, per round.
RATIOS = (
    ("sparse_over_sglang_dense", "dualdecoder_sparse", "sglang_dense"),
    ("sparse_over_dense_same_server", "dualdecoder_sparse", "dualdecoder_dense"),
    ("select_worker_over_sglang_dense", "dualdecoder_sparse_select_worker", "sglang_dense"),
    ("select_split_over_sglang_dense", "dualdecoder_sparse_select_split", "sglang_dense"),
    ("split_over_default_select", "dualdecoder_sparse_select_split", "dualdecoder_sparse"),
    ("default_over_inline_select", "dualdecoder_sparse", "dualdecoder_sparse_select_inline"),
    ("torch_kernel_over_sglang_dense", "dualdecoder_sparse_torch_kernel", "sglang_dense"),
    ("native_over_torch_kernel", "dualdecoder_sparse", "dualdecoder_sparse_torch_kernel"),
    ("sparse_over_unpacked_dense", "dualdecoder_sparse", "sglang_dense_unpacked"),
    ("packed_over_unpacked_dense", "sglang_dense", "sglang_dense_unpacked"),
    ("in_place_over_inline", "dualdecoder_sparse", "dualdecoder_sparse_inline_transfer"),
    ("hit_rate_sample_over_default", "dualdecoder_sparse_hit_rate_sample", "dualdecoder_sparse"),
    ("sparse_over_baseline_tree", "dualdecoder_sparse", "baseline_sparse"),
    ("dense_over_baseline_tree", "dualdecoder_dense", "baseline_dense"),
)


def summarize(runs: list[dict]) -> dict:
    """One configuration of a cell over its rounds: passkeys found in every round, the median
    decode tokens/s and the per-phase median step breakdown (seconds), each round's tokens/s."""
    out = {
        "found": sum(r["found"] for r in runs),
        "total": sum(r["total"] for r in runs),
        TPS: statistics.median(r[TPS] for r in runs),
        "rounds": [r[TPS] for r in runs],
        "answers": runs[-1]["answers"],
    }
    if "breakdown" in runs[0]:
        out["breakdown"] = {
            p: statistics.median(r["breakdown"].get(p, 0.0) for r in runs) for p in runs[0]["breakdown"]
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.decode_speed", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results/decode_speed_cpu.json")
    ap.add_argument("--contexts", default="4000,7900")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per cell (medians reported)")
    ap.add_argument("--warmup-tokens", type=int, default=8,
                    help="before the rounds, every configuration decodes each cell once this many tokens, not "
                         "measured (the first sparse request of a server pays one-time costs: host-tier pages "
                         "touched for the first time); 0: no warm-up")  # fmt: skip
    ap.add_argument("--cells", default=None,
                    help="CONTEXTxBATCH,... instead of every --contexts x --batches pair, e.g. 4000x1,7900x1,4000x8")  # fmt: skip
    ap.add_argument("--pool-tokens", type=int, default=66000, help="device KV pool: every request fits densely")
    ap.add_argument("--select-worker", action="store_true",
                    help="also run the sparse default on a server with experimental.select: worker")  # fmt: skip
    ap.add_argument("--select-split", action="store_true",
                    help="also run the sparse default on a server with experimental.select: split")  # fmt: skip
    ap.add_argument("--select-inline", action="store_true",
                    help="also run the sparse default on a server with experimental.select: inline")  # fmt: skip
    ap.add_argument("--unpacked-dense", action="store_true",
                    help="also SGLang dense with the CPU platform's prepacked linear layers off "
                         "(DD_SGLANG_CPU_PREPACK=0): sglang_dense_unpacked")  # fmt: skip
    ap.add_argument("--torch-kernel", action="store_true",
                    help="also run the sparse default on a server with experimental.kernel: torch (no C kernel)")  # fmt: skip
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sample every request at this temperature (top-p 0.95, seeded); 0: greedy")  # fmt: skip
    ap.add_argument("--inline-transfer", action="store_true",
                    help="also run the sparse default on a server with experimental.transfer: inline (critical sets "
                         "copied into the ring, not read in place)")  # fmt: skip
    ap.add_argument("--hit-rate-sample", type=float, default=None, metavar="F",
                    help="also run the sparse default on a server with prefetch.hit_rate_sample: F (0..1)")  # fmt: skip
    ap.add_argument("--baseline-tree", type=Path, default=None, metavar="PATH",
                    help="also run the dualdecoder server's dense and sparse default from another checkout of "
                         "this project (e.g. the commit before a change), same preset and flags")  # fmt: skip
    ap.add_argument("--selectors", default="",
                    help="comma list of further selectors run on the dualdecoder server per request "
                         "(custom_params.dd_selector), e.g. host_sync")  # fmt: skip
    args = ap.parse_args(argv)
    from dd_sglang.prefetch.selectors import SELECTORS

    extra = [x for x in args.selectors.split(",") if x]
    if any(x not in SELECTORS for x in extra):
        ap.error(f"--selectors must name selectors of {sorted(SELECTORS)}, got {args.selectors!r}")
    ratios = RATIOS + tuple(r for x in extra for r in ((f"{x}_over_sglang_dense", f"dualdecoder_sparse_{x}", "sglang_dense"),
                                                           (f"{x}_over_sparse_default", f"dualdecoder_sparse_{x}",
                                                            "dualdecoder_sparse")))  # fmt: skip
    if not 0.0 <= args.temperature <= 2.0:
        ap.error(f"--temperature must be in [0, 2], got {args.temperature}")
    if args.hit_rate_sample is not None and not 0.0 <= args.hit_rate_sample <= 1.0:
        ap.error(f"--hit-rate-sample must be in [0, 1], got {args.hit_rate_sample}")
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.warmup_tokens < 0:
        ap.error(f"--warmup-tokens must be >= 0, got {args.warmup_tokens}")
    if args.new_tokens < 2:
        ap.error(f"--new-tokens must be >= 2 (decode tokens after the first), got {args.new_tokens}")
    from transformers import AutoTokenizer

    from dd_sglang.models.smollm2 import prepare_model

    tok = AutoTokenizer.from_pretrained(prepare_model(progress=False))
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    pairs = [(c, b) for b in batches for c in contexts]
    if args.cells:
        try:
            pairs = [(int(c), int(b)) for c, b in (x.split("x") for x in args.cells.split(","))]
        except ValueError:
            ap.error(f"--cells must look like 4000x1,7900x1,4000x8, got {args.cells!r}")
    if any(c < 1 or b < 1 for c, b in pairs):
        ap.error(f"--cells / --contexts / --batches: contexts and batches must be >= 1, got {pairs}")
    machine_before = machine_state()
    print(summary(machine_before), flush=True)
    cells = []
    for c, b in pairs:
        prompts = []
        for i in range(b):
            key = 10000 + (7919 * (i + 1) + c) % 90000
            p, _ = passkey_prompt(tok, c + 200, (i + 0.5) / b, key, header=f"Speed {c} {b} {i}. ")
            prompts.append((p, key))
        cells.append({"context": c, "batch": b, "prompts": prompts})
    tmp = Path(tempfile.mkdtemp(prefix="dd_speed_"))
    results = {f"{c['context']}x{c['batch']}": {"context": c["context"], "batch": c["batch"]} for c in cells}
    # Per server: its flags and its runs per cell (result key, custom_params, step kind timed or None).
    servers = {
        "torch_native": (["--attention-backend", "torch_native"], [("sglang_dense", None, None)]),
        "dualdecoder": (["--attention-backend", "dualdecoder", "--dd-config", str(bench_preset(tmp, None))],
                        [("dualdecoder_dense", {"dd_sparse": False}, "dense"), ("dualdecoder_sparse", {}, "sparse")]),
    }  # fmt: skip
    servers["dualdecoder"][1].extend((f"dualdecoder_sparse_{x}", {"dd_selector": x}, "sparse") for x in extra)
    if args.baseline_tree is not None:
        if not (args.baseline_tree / "dd_sglang" / "launch_server.py").is_file():
            ap.error(f"--baseline-tree must be a checkout of this project, got {str(args.baseline_tree)!r}")
        servers["baseline"] = (servers["dualdecoder"][0],
                               [("baseline_dense", {"dd_sparse": False}, "dense"), ("baseline_sparse", {}, "sparse")])  # fmt: skip
    envs = {"unpacked": {PREPACK_ENV: "0"}}  # backend -> extra environment of its launcher
    if args.unpacked_dense:
        servers["unpacked"] = (["--attention-backend", "torch_native"], [("sglang_dense_unpacked", None, None)])
    # Variant servers: the preset with one key changed, each cell's sparse default run there.
    variants = [("select_worker", "experimental.select", "worker", "dualdecoder_sparse_select_worker", args.select_worker),
                ("select_split", "experimental.select", "split", "dualdecoder_sparse_select_split", args.select_split),
                ("select_inline", "experimental.select", "inline", "dualdecoder_sparse_select_inline", args.select_inline),
                ("torch_kernel", "experimental.kernel", "torch", "dualdecoder_sparse_torch_kernel", args.torch_kernel),
                ("inline_transfer", "experimental.transfer", "inline", "dualdecoder_sparse_inline_transfer",
                 args.inline_transfer),
                ("hit_rate_sample", "prefetch.hit_rate_sample", args.hit_rate_sample, "dualdecoder_sparse_hit_rate_sample",
                 args.hit_rate_sample is not None)]  # fmt: skip
    for backend, key, value, run_key, wanted in variants:
        if wanted:
            (tmp / f"{backend}.yaml").write_text(yaml.safe_dump(preset_dict(None, sets={key: value})))
            servers[backend] = (["--attention-backend", "dualdecoder", "--dd-config", str(tmp / f"{backend}.yaml")],
                                [(run_key, {}, "sparse")])  # fmt: skip
    started: dict[str, object] = {}
    try:
        for backend, (flags, _) in servers.items():
            started[backend] = start_server(tmp / f"{backend}.log", args.pool_tokens, flags, timeout=900,
                                            env=envs.get(backend),
                                            cwd=args.baseline_tree if backend == "baseline" else None)  # fmt: skip
        order = [(backend, run) for backend, (_, runs) in servers.items() for run in runs]
        if args.warmup_tokens > 0:
            for c in cells:
                for backend, (key, custom, _) in order:
                    run_batch(started[backend].url, c["prompts"], args.warmup_tokens, custom, args.temperature)
                    print(f"warm-up {c['context']}x{c['batch']} {key}", flush=True)
        rounds: dict[str, dict[str, list[dict]]] = {k: {} for k in results}
        for i in range(args.rounds):
            for c in cells:
                cell = f"{c['context']}x{c['batch']}"
                for backend, (key, custom, kind) in order[i % len(order) :] + order[: i % len(order)]:
                    srv = started[backend]
                    before = scrape(srv.metrics_url) if kind else None
                    r = run_batch(srv.url, c["prompts"], args.new_tokens, custom, args.temperature)
                    if kind:
                        time.sleep(0.5)
                        r["breakdown"] = breakdown(before, scrape(srv.metrics_url), kind)
                    rounds[cell].setdefault(key, []).append(r)
                    print(f"round {i + 1} {cell} {key}: {r[TPS]:.2f} tok/s", flush=True)
    except BaseException:
        print(f"server logs kept in {tmp}", file=sys.stderr)
        raise
    finally:
        for srv in started.values():
            srv.stop()
    shutil.rmtree(tmp, ignore_errors=True)  # the stopped servers' logs and presets: nothing left in /tmp
    srv = started["dualdecoder"]
    for cell, by_key in rounds.items():
        for key, runs in by_key.items():
            results[cell][key] = summarize(runs)
        for name, num, den in ratios:
            if num in by_key and den in by_key:
                per = [a[TPS] / b[TPS] for a, b in zip(by_key[num], by_key[den], strict=True)]
                results[cell][name] = statistics.median(per)
                results[cell][name + "_range"] = [min(per), max(per)]
    result = {
        "benchmark": "decode step time by phase, dense vs sparse default (CPU)",
        "rounds": args.rounds,
        "warmup_tokens": args.warmup_tokens,
        "command": "python -m bench.decode_speed " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": describe(machine_before, machine_state()),
        "dtype": srv.dtype,
        "new_tokens": args.new_tokens,
        "temperature": args.temperature,
        "cells": list(results.values()),
    }
    write_result(result, args.out)
    for r in results.values():
        sp, dn = r["dualdecoder_sparse"], r["sglang_dense"]
        print(f"{r['context']} x {r['batch']}: sparse/sglang-dense {r['sparse_over_sglang_dense']:.2f}x, "
              f"sparse/dense same server {r['sparse_over_dense_same_server']:.2f}x, passkeys "
              f"{sp['found']}/{sp['total']} sparse, {dn['found']}/{dn['total']} dense (all rounds)")  # fmt: skip
        for x in extra:
            print(f"    {x}: {r[x + '_over_sglang_dense']:.2f}x sglang dense, "
                  f"{r[x + '_over_sparse_default']:.2f}x the sparse default, passkeys "
                  f"{r['dualdecoder_sparse_' + x]['found']}/{r['dualdecoder_sparse_' + x]['total']}")  # fmt: skip
        if "split_over_default_select" in r:
            print(f"    split / default selection {r['split_over_default_select']:.2f}x")
        if "default_over_inline_select" in r:
            print(f"    default / inline selection {r['default_over_inline_select']:.2f}x")
        if "in_place_over_inline" in r:
            print(f"    in place / inline transfer {r['in_place_over_inline']:.2f}x")
        for name in ("sparse_over_baseline_tree", "dense_over_baseline_tree"):
            if name in r:
                print(f"    {name} {r[name]:.2f}x")
        if "hit_rate_sample_over_default" in r:
            print(f"    hit_rate_sample {args.hit_rate_sample} / default {r['hit_rate_sample_over_default']:.2f}x")
        if "packed_over_unpacked_dense" in r:
            print(f"    packed/unpacked SGLang dense {r['packed_over_unpacked_dense']:.2f}x, "
                  f"sparse/unpacked dense {r['sparse_over_unpacked_dense']:.2f}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
