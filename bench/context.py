"""Decode cost against context length: dense SGLang and the sparse path side by side, 2k to 32k (issue 54).

Usage::

    python -m bench.context [--lengths 2000,4000,8000,16000,32000] [--batch-lengths 2000,4000,8000,16000]
                            [--batch 8] [--new-tokens 64] [--dense-dtype auto]
                            [--out bench/results/context_HOSTCLASS.json] [--plot PATH.png]

Two servers up at once, both on the long-context preset ``cpu-smollm2-32k`` (dynamic NTK RoPE x4 on the embedded
SmolLM2-135M: 32,768 positions; ``configs/cpu-smollm2-32k.yaml``), one after the other per cell:

* ``dense``: SGLang's own ``torch_native`` attention, in the dtype that decodes fastest on this host
  (``--dense-dtype auto``: :func:`bench.concurrency.measured_dtypes`, i.e. ``bench.dtype_cpu``'s result
  for this host class and ISA flags, at ~4k tokens; else the launcher's choice, and the JSON says so),
  with a device pool that holds the largest cell densely;
* ``sparse``: ``--attention-backend dualdecoder`` on the preset as shipped (the CPU default:
  ``host_sync``, ``top_k`` 256, pool ``server.max_total_tokens``), in the launcher's dtype.

Cells: one request at each of ``--lengths`` and ``--batch`` requests at once at each of
``--batch-lengths`` (passkey prompts of ~that many tokens, distinct headers so no cell reuses another's
prefix, greedy, ``--new-tokens`` each with ``ignore_eos``, streamed; :func:`bench.capacity.run_round`).
Each server first decodes one short request, not measured. Per cell and server: the caches flushed,
then the cell's requests; recorded: pass keys found, ``decode_tokens_per_second`` (tokens after each
first one over the time from the first first-token to the last answer), the steady decode rate and
``steady_gap_seconds`` (the median time between two tokens of a request while the most requests decode:
the step time a user sees, prefills left out: :func:`bench.capacity.steady_decode`); for ``sparse`` also
the mean decode step split by phase from the backend's counters (``plan``, ``select``, ``assemble``
(the gather of the critical set), ``attention``, ``rest``: :func:`bench.decode_speed.breakdown`).

Each cell keeps its prompts' tokens as the tokenizer counts them (``prompt_tokens``) and as each server
reported them in its usage (``prompt_tokens_reported``, per server; recorded since the 2026-12-07 run).
Ratios per cell: sparse over dense steady decode tokens/s; across cells, the sparse step at the longest
single-request length over the one at 4k (``steady_gap_seconds``), and dense's the same way. Issue 54's
goals: the sparse step at 32k <= 1.25x its cost at 4k; at 32k, one request decodes >= 8x dense.

Output: JSON with provenance and a PNG (decode tokens/s against context length, one request and the
batch, dense and sparse; the sparse step's phases per length). Nothing here is a pass/fail test.
Expect ~25 min on a 2-core host: a 32k-token prefill takes ~2.5 min per server.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from bench.capacity import run_round, stop_backends
from bench.cli import check_ranges, write_result
from bench.concurrency import _sparse_phases, level_prompts, measured_dtypes
from bench.machine import command_line, describe, host, machine_state, provenance, summary
from harness.client import n_layers_of_model
from harness.server import flush_when_idle, launch_server, scrape

#: The long-context preset both servers run (``configs/cpu-smollm2-32k.yaml``).
PRESET = "cpu-smollm2-32k"
SERVERS = {"dense": "torch_native", "sparse": "dualdecoder"}
#: Issue 54's goals: the sparse step at the longest length over its step at 4k at most this; and one
#: request at 32k decoding at least this many times dense.
STEP_GROWTH_GOAL = 1.25
SPEEDUP_GOAL_32K = 8.0
PHASES = ("step", "plan", "select", "assemble", "attention", "rest")


def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(prog="python -m bench.context", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--lengths", default="2000,4000,8000,16000,32000", help="one request at each (prompt tokens)")
    ap.add_argument("--batch-lengths", default="2000,4000,8000,16000", help="--batch requests at once at each")
    ap.add_argument("--batch", type=int, default=8, help="requests at once in the batch cells")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dense-dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                    help="dtype of the dense server (auto: the faster one bench.dtype_cpu measured on this host)")
    ap.add_argument("--sample-interval", type=float, default=1.0, help="seconds between sidecar scrapes")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/context_HOSTCLASS.json)")
    ap.add_argument("--plot", default=None, help="PNG path (default: the JSON's path with .png)")
    args = ap.parse_args(argv)
    try:
        args.single = [int(x) for x in args.lengths.split(",") if x]
        args.batched = [int(x) for x in args.batch_lengths.split(",") if x]
    except ValueError:
        ap.error(f"--lengths/--batch-lengths must be comma-separated integers, got {args.lengths!r}, "
                 f"{args.batch_lengths!r}")  # fmt: skip
    if not args.single or any(not 512 <= n <= 32000 for n in args.single + args.batched):
        ap.error("--lengths and --batch-lengths must be in [512, 32000] (the preset's 32,768 positions, less "
                 "the new tokens and the chat template)")  # fmt: skip
    check_ranges(ap, args, (("batch", 2, 64), ("new_tokens", 8, 1024), ("sample_interval", 0.05, 10)))
    return args


def dense_pool(cells: list[tuple[int, int]], new_tokens: int) -> int:
    """Device pool (tokens) that holds the largest cell densely: requests x (prompt + new + 256) + 512."""
    return max(n * (length + new_tokens + 256) for n, length in cells) + 512


def run_cell(servers: dict, requests: int, length: int, prompts, order: list[str], args) -> dict:
    """One cell (``requests`` at ~``length`` tokens) on each server of ``order``."""
    out = {}
    for name in order:
        srv = servers[name]
        flush_when_idle(srv)
        before = scrape(srv.metrics_url)
        run = run_round(SERVERS[name], srv, prompts, args)
        run.pop("latency_seconds", None)
        if name == "sparse":
            b = _sparse_phases(before, scrape(srv.metrics_url), args.layers)
            run["breakdown"] = {k: b[k] for k in (*PHASES, "steps") if k in b}
        out[name] = run
        print(f"{requests} x {length}: {name} {run['found']}/{run['total']} found, decode "
              f"{run['decode_tokens_per_second']} tok/s, steady gap {run['steady_gap_seconds']} s",
              file=sys.stderr, flush=True)  # fmt: skip
    d, s = out["dense"], out["sparse"]
    ratio = lambda k: round(s[k] / d[k], 3) if d[k] else None  # noqa: E731
    return {"requests": requests, "target_tokens": length, "prompt_tokens": [n for _, n, _ in prompts],
            "prompt_tokens_reported": {name: run.get("prompt_tokens_reported") for name, run in out.items()},
            "order": order, "runs": out,
            "sparse_over_dense": ratio("steady_decode_tokens_per_second"),
            "sparse_over_dense_decode": ratio("decode_tokens_per_second")}  # fmt: skip


def goals(cells: list[dict]) -> dict:
    """Issue 54's goals against the single-request cells: measured value, goal, met."""
    single = {c["target_tokens"]: c for c in cells if c["requests"] == 1}
    out = {}
    longest = max(single)
    if 4000 in single and longest > 4000:
        for name in SERVERS:
            growth = single[longest]["runs"][name]["steady_gap_seconds"] / single[4000]["runs"][name]["steady_gap_seconds"]
            out[f"{name}_step_{longest}_over_4000"] = round(growth, 3)
        got = out[f"sparse_step_{longest}_over_4000"]
        out["sparse_step_growth"] = {"goal": STEP_GROWTH_GOAL, "measured": got, "met": got <= STEP_GROWTH_GOAL}
    if 32000 in single:
        got = single[32000]["sparse_over_dense"]
        out["speedup_at_32000"] = {"goal": SPEEDUP_GOAL_32K, "measured": got, "met": got is not None and got >= SPEEDUP_GOAL_32K}
    return out


def plot(result: dict, path: Path) -> None:
    """PNG: steady decode tokens/s against context length (one request, the batch; dense and sparse) and
    the sparse step's phases (ms) per single-request length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = result["cells"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    ax = axes[0]
    for n in sorted({c["requests"] for c in cells}):
        row = [c for c in cells if c["requests"] == n]
        xs = [c["target_tokens"] for c in row]
        for name, style in (("dense", "--"), ("sparse", "-")):
            ax.plot(xs, [c["runs"][name]["steady_decode_tokens_per_second"] for c in row], style, marker="o",
                    label=f"{name}, {n} request{'s' if n > 1 else ''}")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_title("decode tokens/s (steady, prefills left out)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax = axes[1]
    row = [c for c in cells if c["requests"] == 1]
    xs = [str(c["target_tokens"]) for c in row]
    bottom = [0.0] * len(row)
    for phase in ("plan", "select", "assemble", "attention", "rest"):
        vals = [1000 * c["runs"]["sparse"].get("breakdown", {}).get(phase, 0.0) for c in row]
        ax.bar(xs, vals, bottom=bottom, label=phase)
        bottom = [a + b for a, b in zip(bottom, vals, strict=True)]
    ax.set_xlabel("prompt tokens (one request)")
    ax.set_ylabel("ms per decode step")
    ax.set_title("the sparse step by phase")
    ax.legend(fontsize=8)
    fig.suptitle(f"{result['preset']}, {result['new_tokens']} new tokens per request ({result['host_class']}, "
                 f"{result['dtype']})")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from dd_sglang.models.smollm2 import prepare_model
    from dd_sglang.platform.dtype import default_dtype

    command = "python -m bench.context " + " ".join(argv) if argv is not None else command_line()
    measured, dtype_choice = measured_dtypes()
    dense_dtype = measured.get("long") if args.dense_dtype == "auto" else args.dense_dtype
    if args.dense_dtype != "auto":
        dtype_choice = "--dense-dtype as given"
    elif not measured:
        dtype_choice += "; auto fell back to the launcher's choice"
    dtypes = {"dense": dense_dtype or default_dtype(), "sparse": default_dtype()}
    summary_dtype = ", ".join(f"{k} {v}" for k, v in dtypes.items())
    prov = provenance(command, summary_dtype)
    before = machine_state()
    print(summary(before), file=sys.stderr, flush=True)
    tok = AutoTokenizer.from_pretrained(prepare_model(progress=False))
    args.layers = n_layers_of_model()
    plan = [(1, n) for n in args.single] + [(args.batch, n) for n in args.batched]
    prompts = {(r, n): level_prompts(tok, r, n, f"ctx{n}") for r, n in plan}
    warm = level_prompts(tok, 1, 2000, "warm")
    from dd_sglang.config import load_config

    pools = {"dense": dense_pool(plan, args.new_tokens), "sparse": load_config(PRESET).server.max_total_tokens}
    servers, logs, shutdowns, cells = {}, {}, {}, []
    try:
        for name, backend in SERVERS.items():  # launched together: start-up is mostly imports
            log = Path(tempfile.mkdtemp(prefix="dd_context_")) / "server.log"
            extra = ["--dd-config", PRESET, "--attention-backend", backend]
            if name == "dense":
                extra += ["--dtype", dtypes["dense"]]
            servers[name] = launch_server(log, pools[name], extra)
            logs[name] = log
        for srv in servers.values():
            srv.wait_ready(900)
        for name, srv in servers.items():
            run_round(SERVERS[name], srv, warm, argparse.Namespace(**{**vars(args), "new_tokens": 16}))
        for i, (r, n) in enumerate(plan):
            order = ["dense", "sparse"] if i % 2 == 0 else ["sparse", "dense"]
            cells.append(run_cell(servers, r, n, prompts[(r, n)], order, args))
    finally:
        shutdowns = stop_backends(servers, logs)
    result = {
        "benchmark": "decode cost against context length: dense SGLang and the sparse path (CPU)",
        "command": command,
        "provenance": prov,
        "machine": describe(before, machine_state()),
        "host_class": host(summary_dtype)["host_class"],
        "dtype": summary_dtype,
        "dtype_choice": dtype_choice,
        "preset": PRESET,
        "new_tokens": args.new_tokens,
        "servers": {name: {"attention_backend": SERVERS[name], "dtype": dtypes[name],
                           "device_kv_budget_tokens": pools[name],
                           "shutdown": shutdowns.get(name)} for name in SERVERS},  # fmt: skip
        "cells": cells,
        "goals": goals(cells),
    }
    out = Path(args.out or f"bench/results/context_{result['host_class']}.json")
    write_result(result, out)
    plot(result, Path(args.plot) if args.plot else out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
