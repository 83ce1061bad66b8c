"""Throughput against concurrency: dense SGLang, the sparse default and its ceiling, in one run (issue 41).

Usage::

    python -m bench.concurrency [--levels 1,2,4,8,16] [--prompt-tokens 4200] [--new-tokens 192]
                                [--max-total-tokens 8400] [--ceiling-tokens 388]
                                [--dense-dtype auto] [--ceiling-dtype auto]
                                [--out bench/results/concurrency_HOSTCLASS.json] [--plot PATH.png]

Four servers, each with the default preset, in two groups (:data:`PHASES`): the first three up at once
(an idle one sleeps: ``sleep-on-idle``) for every level, then ``dense_room`` alone:

* ``dense_same_pool``: SGLang's own dense path (``--attention-backend torch_native``) with a device
  KV pool of ``--max-total-tokens`` tokens (8,400: two ~4k requests at a time; the others wait);
* ``sparse``: ``--attention-backend dualdecoder`` in the same pool (the default preset: long requests
  decode sparsely, their KV in the host tier), in the dtype the launcher chooses on this host;
* ``dense_room``: SGLang's dense path with a pool that holds every request of the largest level at once
  (the memory the sparse path saves, given to dense);
* ``ceiling``: SGLang's dense path, each request a ~``--ceiling-tokens`` prompt (388, the size a sparse
  row attends, 4 sink + 128 recent + 256 critical tokens: ``passkey_prompt`` builds 325 tokens, ~420
  on average with the new tokens). A sparse step does at least this step's work,
  so ``sparse`` over ``ceiling`` is the fraction of its own ceiling the sparse path reaches.

The dense servers run in the dtype that decodes fastest on this host (``--dense-dtype`` and
``--ceiling-dtype``, ``auto`` by default): ``auto`` takes the dtype ``python -m bench.dtype_cpu`` measured
decoding faster on this host class with these ISA flags (:data:`DTYPE_RESULT`): at ~4k tokens and the
batch for the two long-context servers, at ~100 tokens for the ceiling (on the 2-core AMD EPYC host
float32 for the first, 1.55x bfloat16 at eight ~4k requests, and bfloat16 for the second, 1.17x
float32). Without a matching measurement ``auto`` is the launcher's choice, and the JSON says so. It
records each server's dtype and where the choice came from (``dtype_choice``).

Each server first decodes one request of its kind, not measured (:func:`warm_up`). For each level N
of ``--levels`` and each configuration of a group (order rotated by one per level,
so a slow stretch of the machine does not fall on one configuration): the server's caches flushed, then N
distinct passkey prompts sent at once, streamed, greedy, ``--new-tokens`` each (``ignore_eos``), as
:func:`bench.capacity.run_round` does; fresh passkeys and headers per level. Recorded per run:
``output_tokens_per_second`` (all generated tokens over the wall time of the run),
``decode_tokens_per_second`` (tokens after each first one, from the first first-token to the last
answer: prefills that overlap decoding stay in) and ``steady_decode_tokens_per_second`` (the fullest
batch's decode rate, prefills left out: :func:`bench.capacity.steady_decode`), pass keys, the peak of
requests decoding at once; for ``sparse`` also the mean decode step split by phase
(:func:`bench.decode_speed.breakdown`) and the mean sparse rows per step, so each phase per row is
read off.

Ratios per level: ``sparse_over_dense_same_pool`` and ``sparse_over_dense_room`` (output tokens/s over
the run, and the same for decode tokens/s), ``ceiling_fraction`` (sparse steady decode tokens/s over
the ceiling's; and ``ceiling_fraction_decode`` with decode tokens/s). Issue 41's goals: ceiling
fraction >= 0.9 at 1 request and >= 0.8 at 8 and 16; same-pool output >= 4x at 8 and >= 6x at 16.

Output: JSON with provenance (:func:`bench.cli.write_result`) and a PNG (output and steady decode
tokens/s against concurrency, one line per configuration, and the ceiling fraction). Nothing here is a
pass/fail test; loopback only; each group's servers are stopped before the next group starts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.capacity import launch_backend, room_budget, run_round, stop_backends
from bench.cli import check_ranges, write_result
from bench.decode_speed import breakdown
from bench.machine import command_line, describe, host, machine_state, provenance, summary
from harness.client import n_layers_of_model
from harness.prompts import passkey_prompt
from harness.server import delta, flush_when_idle, scrape

#: Configurations: name -> (server, prompt kind).
CONFIGS = {
    "dense_same_pool": ("dense_same_pool", "long"),
    "sparse": ("sparse", "long"),
    "dense_room": ("dense_room", "long"),
    "ceiling": ("ceiling", "short"),
}
#: Each server's ``--attention-backend``.
BACKENDS = {"dense_same_pool": "torch_native", "sparse": "dualdecoder", "dense_room": "torch_native",
            "ceiling": "torch_native"}  # fmt: skip
#: Servers up together, one group after the other. The goals' ratios (sparse over dense_same_pool and
#: over ceiling) are measured side by side in the first group; dense_room, the largest (a float32 pool
#: for sixteen ~4k requests), runs alone after it. All four at once took ~20 of the 2-core host's 24 GB
#: and the machine evicted and re-read its page cache throughout (a first attempt: every rate ~25%
#: below the previous run's, half the CPU time in the kernel).
PHASES = (("dense_same_pool", "sparse", "ceiling"), ("dense_room",))
#: ``python -m bench.dtype_cpu``'s result, read by ``--dense-dtype auto`` and ``--ceiling-dtype auto``.
DTYPE_RESULT = Path(__file__).resolve().parent / "results" / "dtype_cpu.json"
DTYPES = ("auto", "bfloat16", "float32")
#: Issue 41's goals: the least ceiling fraction per level, and the least same-pool output ratio per level.
CEILING_GOALS = {1: 0.9, 8: 0.8, 16: 0.8}
SAME_POOL_GOALS = {8: 4.0, 16: 6.0}


def measured_dtypes(path: Path | None = None, here: dict | None = None) -> tuple[dict[str, str], str]:
    """The dtype ``bench.dtype_cpu`` measured decoding faster on this host: ``({"long": ..., "short": ...},
    source)``, ``long`` at ~4k tokens (at its ``--batch`` where it ran one, else one request), ``short``
    at ~100 tokens; ``({}, why not)`` when ``path`` is missing or was measured on another host class or
    with other ISA flags. ``path``: default ``bench/results/dtype_<host class>.json`` where it exists, else
    :data:`DTYPE_RESULT`. ``here``: this host (:func:`bench.machine.host`; given by tests)."""
    here = here or host()
    if path is None:
        own = DTYPE_RESULT.with_name(f"dtype_{here['host_class']}.json")
        path = own if own.exists() else DTYPE_RESULT
    try:
        result = json.loads(path.read_text())
        ratio, machine = result["float32_over_bfloat16"], result["provenance"]["machine"]
    except (OSError, ValueError, KeyError) as e:
        return {}, f"no bench.dtype_cpu measurement to read ({path.name}: {e.__class__.__name__})"
    same = machine.get("host_class") == here["host_class"] and sorted(machine.get("cpu_flags") or []) == sorted(
        here["cpu_flags"]
    )
    if not same:
        return {}, f"{path.name} was measured on another host ({machine.get('host_class')}, other ISA flags)"
    long_key = next((k for k in sorted(ratio) if k.startswith("decode_4k_batch")), "decode_4k")
    pick = lambda r: "float32" if r > 1 else "bfloat16"  # noqa: E731
    return ({"long": pick(ratio[long_key]), "short": pick(ratio["decode_short"])},
            f"bench/results/{path.name}: float32 over bfloat16 decode {ratio[long_key]:.2f}x ({long_key}), "
            f"{ratio['decode_short']:.2f}x (decode_short)")  # fmt: skip


def server_dtypes(args) -> tuple[dict[str, str | None], str]:
    """Each server's ``--dtype`` (None: the launcher's choice) and where the dense ones came from."""
    measured, source = measured_dtypes()
    pick = lambda flag, kind: measured.get(kind) if flag == "auto" else flag  # noqa: E731
    dtypes = {"dense_same_pool": pick(args.dense_dtype, "long"), "sparse": None,
              "dense_room": pick(args.dense_dtype, "long"), "ceiling": pick(args.ceiling_dtype, "short")}  # fmt: skip
    given = [f"--{k}-dtype {v}" for k, v in (("dense", args.dense_dtype), ("ceiling", args.ceiling_dtype))
             if v != "auto"]  # fmt: skip
    if len(given) == 2:
        return dtypes, "--dense-dtype and --ceiling-dtype as given"
    if not measured:
        source += "; auto fell back to the launcher's choice"
    return dtypes, "; ".join([source, *(f"{g} as given" for g in given)])


def level_prompts(tok, level: int, tokens: int, tag: str) -> list[tuple[str, int, int]]:
    """``level`` distinct passkey prompts ``(text, tokens, passkey)`` of ~``tokens`` tokens, depths spread
    evenly; passkeys and headers differ per ``level`` and ``tag``, so no run reuses another's prefix."""
    out = []
    for i in range(level):
        key = 10000 + (7919 * (level * 97 + i + 1 + (50 if tag == "short" else 0))) % 90000
        p, n = passkey_prompt(tok, tokens, (i + 0.5) / level, key, header=f"Run {tag}-{level}.{i}. ")
        out.append((p, n, key))
    return out


def _sparse_phases(before: dict, after: dict, layers: int) -> dict:
    """The sparse server's mean decode step by phase over a run (seconds), with the mean sparse requests
    per step (``rows_per_step``: ``dd_sparse_decode_rows_total``, counted per (request, layer), over
    ``layers`` and the steps) and each phase per such row (``per_row``)."""
    b = breakdown(before, after, "sparse")
    if not b.get("steps"):
        return b
    rows = delta(after, before, "dd_sparse_decode_rows_total") / b["steps"] / layers
    b["rows_per_step"] = round(rows, 3)
    phases = ("step", "plan", "select", "assemble", "attention", "exposed_wait", "rest", "select_ahead")
    b["per_row"] = {p: b[p] / rows for p in phases} if rows > 0 else {}
    return b


#: Tokens of each server's warm-up request (:func:`warm_up`).
WARMUP_TOKENS = 16


def warm_up(servers: dict, prompts: dict, args) -> None:
    """Before a group's first level: each server of ``servers`` decodes one request of its kind
    (``prompts``: ``{"long": [...], "short": [...]}``, one prompt each) for :data:`WARMUP_TOKENS`
    tokens, not measured, the servers one after the other, so start-up tails and first-request costs
    (a sparse server's first host-tier pages) stay out of the levels. A run without it measured the
    first configuration, dense in the 8,400-token pool at one ~4k request, at 6.3 tokens/s; a later
    check (two float32 dense servers up) measured ~10 with either pool size."""
    warm = argparse.Namespace(**{**vars(args), "new_tokens": WARMUP_TOKENS})
    for name, (srv, _) in servers.items():
        server, kind = CONFIGS[name]
        run_round(BACKENDS[server], srv, prompts[kind], warm)
        flush_when_idle(srv)


def run_level(level: int, servers: dict, prompts: dict, order: list[str], args) -> dict:
    """Every configuration of ``order`` at ``level`` requests at once (module docstring)."""
    out = {}
    for name in order:
        server, kind = CONFIGS[name]
        srv = servers[server][0]
        flush_when_idle(srv)
        before = scrape(srv.metrics_url)
        run = run_round(BACKENDS[server], srv, prompts[kind], args)
        run.pop("latency_seconds", None)
        if server == "sparse":
            run["breakdown"] = _sparse_phases(before, scrape(srv.metrics_url), args.layers)
        out[name] = run
        print(f"level {level} {name}: {run['found']}/{run['total']} found, out {run['output_tokens_per_second']} "
              f"tok/s, decode {run['decode_tokens_per_second']}, steady {run['steady_decode_tokens_per_second']} "
              f"at {run['steady_concurrency']}", file=sys.stderr, flush=True)  # fmt: skip
    return out


def level_ratios(runs: dict) -> dict:
    """Ratios of one level's runs (module docstring), 3 decimals."""
    sp, same, room, ceil = (runs[k] for k in ("sparse", "dense_same_pool", "dense_room", "ceiling"))
    r = lambda a, b, k: round(a[k] / b[k], 3) if b[k] else None  # noqa: E731
    return {
        "sparse_over_dense_same_pool": r(sp, same, "output_tokens_per_second"),
        "sparse_over_dense_room": r(sp, room, "output_tokens_per_second"),
        "sparse_over_dense_same_pool_decode": r(sp, same, "decode_tokens_per_second"),
        "sparse_over_dense_room_decode": r(sp, room, "decode_tokens_per_second"),
        "ceiling_fraction": r(sp, ceil, "steady_decode_tokens_per_second"),
        "ceiling_fraction_decode": r(sp, ceil, "decode_tokens_per_second"),
    }


def goals(levels: list[dict]) -> dict:
    """Issue 41's goals against the run: per goal, the measured value and whether it is met."""
    by = {lv["requests"]: lv for lv in levels}
    out = {}
    for n, want in CEILING_GOALS.items():
        if n in by:
            got = by[n]["ratios"]["ceiling_fraction"]
            out[f"ceiling_fraction_at_{n}"] = {"goal": want, "measured": got, "met": got is not None and got >= want}
    for n, want in SAME_POOL_GOALS.items():
        if n in by:
            got = by[n]["ratios"]["sparse_over_dense_same_pool"]
            out[f"same_pool_output_at_{n}"] = {"goal": want, "measured": got, "met": got is not None and got >= want}
    return out


def plot(result: dict, path: Path) -> None:
    """PNG: output tokens/s over the run and steady decode tokens/s (the fullest batch, prefills left out)
    against concurrent requests, per configuration, and the sparse path's ceiling fraction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = result["levels"]
    xs = [lv["requests"] for lv in levels]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, key, title in ((axes[0], "output_tokens_per_second", "output tokens/s over the run"),
                           (axes[1], "steady_decode_tokens_per_second", "tokens/s while decoding (prefills left out)")):  # fmt: skip
        for name in CONFIGS:
            ax.plot(xs, [lv["runs"][name][key] for lv in levels], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("concurrent requests")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend()
    ax = axes[2]
    ax.plot(xs, [lv["ratios"]["ceiling_fraction"] for lv in levels], marker="o", label="sparse / ceiling (steady)")
    for n, want in CEILING_GOALS.items():
        if n in xs:
            ax.scatter([n], [want], marker="_", s=400, color="red")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_ylim(0, max(1.1, 1.1 * max(lv["ratios"]["ceiling_fraction"] or 0 for lv in levels)))
    ax.set_xlabel("concurrent requests")
    ax.set_title("fraction of the ceiling (red: issue 41's goals)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.suptitle(f"~{result['prompt_tokens']:,}-token requests, {result['new_tokens']} new tokens each "
                 f"({result['host_class']}, {result['dtype']})")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(prog="python -m bench.concurrency", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--levels", default="1,2,4,8,16", help="concurrent requests per run, comma-separated")
    ap.add_argument("--prompt-tokens", type=int, default=4200, help="passkey_prompt size target of a long request (4200 builds 3,997 tokens)")
    ap.add_argument("--ceiling-tokens", type=int, default=388, help="prompt size of a ceiling request")
    ap.add_argument("--new-tokens", type=int, default=192)
    ap.add_argument("--max-total-tokens", type=int, default=8400, help="device KV pool of dense_same_pool and sparse")
    ap.add_argument("--sample-interval", type=float, default=1.0, help="seconds between sidecar scrapes")
    ap.add_argument("--dense-dtype", default="auto", choices=DTYPES,
                    help="dtype of dense_same_pool and dense_room (auto: the faster one bench.dtype_cpu measured here)")
    ap.add_argument("--ceiling-dtype", default="auto", choices=DTYPES,
                    help="dtype of the ceiling server (auto: as --dense-dtype, for ~100-token contexts)")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/concurrency_HOSTCLASS.json)")
    ap.add_argument("--plot", default=None, help="PNG path (default: the JSON's path with .png)")
    args = ap.parse_args(argv)
    try:
        args.level_list = [int(x) for x in args.levels.split(",")]
    except ValueError:
        ap.error(f"--levels must be comma-separated integers, got {args.levels!r}")
    if not args.level_list or any(not 1 <= n <= 64 for n in args.level_list) or len(set(args.level_list)) != len(
        args.level_list
    ):
        ap.error(f"--levels must name distinct integers in [1, 64], got {args.levels!r}")
    check_ranges(ap, args, (("prompt_tokens", 512, 32768), ("ceiling_tokens", 200, 4096), ("new_tokens", 2, 4096),
                            ("max_total_tokens", 1024, 10_000_000), ("sample_interval", 0.05, 10)))  # fmt: skip
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from dd_sglang.models.smollm2 import prepare_model
    from dd_sglang.platform.dtype import default_dtype

    command = "python -m bench.concurrency " + " ".join(argv) if argv is not None else command_line()
    dtype = default_dtype()  # the sparse server's: the launcher's choice on this host
    dtypes, dtype_choice = server_dtypes(args)
    label = {name: d or dtype for name, d in dtypes.items()}
    summary_dtype = ", ".join(f"{name} {d}" for name, d in label.items())
    prov = provenance(command, summary_dtype)  # taken before the run: its commit and date
    before = machine_state()
    print(summary(before), file=sys.stderr, flush=True)
    print(f"dtypes: {summary_dtype} ({dtype_choice})", file=sys.stderr, flush=True)
    tok = AutoTokenizer.from_pretrained(prepare_model(progress=False))
    args.layers = n_layers_of_model()
    prompts = {n: {"long": level_prompts(tok, n, args.prompt_tokens, "long"),
                   "short": level_prompts(tok, n, args.ceiling_tokens, "short")} for n in args.level_list}  # fmt: skip
    warm_prompts = {"long": level_prompts(tok, 1, args.prompt_tokens, "warm"),
                    "short": level_prompts(tok, 1, args.ceiling_tokens, "warm")}  # fmt: skip
    room = max(room_budget(p["long"], args.new_tokens) for p in prompts.values())
    short_room = max(room_budget(p["short"], args.new_tokens) for p in prompts.values())
    tokens = {"dense_same_pool": args.max_total_tokens, "sparse": args.max_total_tokens, "dense_room": room,
              "ceiling": short_room}  # fmt: skip
    budgets = {name: (BACKENDS[name], tokens[name]) for name in BACKENDS}
    runs, orders, shutdowns = {n: {} for n in args.level_list}, {n: [] for n in args.level_list}, {}
    for phase in PHASES:
        servers = {}
        try:
            for name in phase:  # launched together: start-up is mostly imports
                servers[name] = launch_backend(*budgets[name], dtype=dtypes[name])
            for srv, _ in servers.values():
                srv.wait_ready(900)
            warm_up(servers, warm_prompts, args)
            for i, n in enumerate(args.level_list):
                order = list(phase[i % len(phase) :] + phase[: i % len(phase)])
                runs[n].update(run_level(n, servers, prompts[n], order, args))
                orders[n] += order
        finally:
            shutdowns.update(stop_backends({n: srv for n, (srv, _) in servers.items()},
                                           {n: log for n, (_, log) in servers.items()}))  # fmt: skip
    levels = [{"requests": n, "order": orders[n], "runs": runs[n], "ratios": level_ratios(runs[n])}
              for n in args.level_list]  # fmt: skip
    for lv in levels:
        print(f"level {lv['requests']}: {lv['ratios']}", file=sys.stderr, flush=True)
    result = {
        "benchmark": "throughput against concurrency: dense SGLang, the sparse default and its ceiling (CPU)",
        "command": command,
        "provenance": prov,
        "machine": describe(before, machine_state()),
        "host_class": host(dtype)["host_class"],
        "dtype": summary_dtype,
        "dtype_choice": dtype_choice,
        "prompt_tokens": args.prompt_tokens,
        "ceiling_prompt_tokens": args.ceiling_tokens,
        "new_tokens": args.new_tokens,
        "servers": {name: {"attention_backend": b, "device_kv_budget_tokens": t, "dtype": label[name],
                           "shutdown": shutdowns.get(name)} for name, (b, t) in budgets.items()},  # fmt: skip
        "levels": levels,
        "goals": goals(levels),
    }
    out = Path(args.out or f"bench/results/concurrency_{result['host_class']}.json")
    write_result(result, out)
    plot(result, Path(args.plot) if args.plot else out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
