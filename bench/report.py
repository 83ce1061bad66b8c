"""``docs/benchmarks.md`` and its plots from the results in ``bench/results/``; Markdown tables and
PNG plots of the quality benchmarks (``bench.fidelity``, ``bench.prediction``).

Usage::

    make report      # = python -m bench.report --page docs/benchmarks.md --plots docs/img
    python -m bench.report [--fidelity bench/results/fidelity_cpu.json]
                           [--prediction bench/results/prediction_cpu.json] [--plots bench/results]

``--page PATH`` writes the whole benchmarks page (:func:`benchmarks_page`: every result directly
under ``bench/results/``, ``archive/`` left out, each with its provenance block as a row, then a
table per benchmark); ``tests/test_bench_results.py`` fails when the committed page differs from
what the results give. Without it, prints the quality tables (a file that does not exist is
skipped with a note). Either way it writes, into ``--plots`` (default: beside the JSON):
``fidelity_accuracy.png`` (retrieval accuracy vs top_k per configuration, one
panel per context, dense as a band), ``prediction_layers.png`` (recall per
layer per configuration and the ceiling, one panel per context and k, sampled
regime), ``prediction_regimes.png`` (recall by regime per configuration, with
the ceiling and recency baseline).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _ci(d: dict | None, digits: int = 3) -> str:
    if not d or d.get("mean") is None:
        return "–"
    if d.get("ci_low") is None:
        return f"{d['mean']:.{digits}f}"
    return f"{d['mean']:.{digits}f} [{d['ci_low']:.{digits}f}, {d['ci_high']:.{digits}f}]"


def _k_label(c: dict) -> str:
    return f"{c['k']} (1/{c['fraction']})"


def lost_vs_oracle(res: dict, config: str, context: int, fraction: int) -> list[int]:
    """Retrieval trials ``config`` misses while ``oracle`` at the same context and top_k finds them (trial numbers)."""
    found = {(r["config"], r["trial"]): r["found"] for r in res["records"]
             if r["part"] == "retrieval" and r["context"] == context and r["fraction"] == fraction}  # fmt: skip
    return sorted(t for (c, t), f in found.items() if c == config and not f and found.get(("oracle", t)))


def fidelity_summary(res: dict) -> str:
    """Markdown: one row per context and top_k, retrieval and NLL x dense per configuration, trials lost vs oracle."""
    configs = res["settings"]["configs"]
    head = " | ".join(f"`{c}`" for c in configs)
    others = [c for c in configs if c != "oracle"]
    lines = [f"| context | top_k | dense | {head} | lost vs `oracle`: {', '.join(f'`{c}`' for c in others)} |",
             "|---|---|---|" + "---|" * len(configs) + "---|"]  # fmt: skip
    dense = {d["context"]: d for d in res["dense"]}
    for n in res["settings"]["contexts"]:
        d = dense[n]["retrieval"]
        for f in res["settings"]["fractions"]:
            cells = {c["config"]: c for c in res["cells"] if c["context"] == n and c["fraction"] == f}
            row = [f"{n:,}", f"{n // f} (1/{f})", f"{d['found']}/{d['trials']}"]
            for c in configs:
                r, nl = cells[c]["retrieval"], cells[c]["nll"]
                row.append(f"{r['found']}/{r['trials']}, {nl['ratio_to_dense']:.3f}")
            lost = [len(lost_vs_oracle(res, c, n, f)) for c in others] if "oracle" in configs else []
            row.append(" / ".join(str(x) for x in lost) or "–")
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def fidelity_tables(res: dict) -> str:
    """Markdown: one table per context (dense first, then each configuration and k)."""
    lines = [f"Command: `{res.get('command', '?')}` ({res.get('wall_seconds', '?')} s); "
             f"default configuration `{res['settings']['default_config']}`; texts {', '.join(res['settings']['texts'])}.",
             ""]  # fmt: skip
    for d in res["dense"]:
        n = d["context"]
        r = d["retrieval"]
        lines += [f"**Context {n} tokens**", "",
                  "| configuration | top_k | retrieval (95% CI) | NLL nats/token (x dense) | NLL Δ vs dense (95% CI) "
                  "| forced top-1 | greedy agreement: leading / matching | prefetch recall | mass | acceptance |",
                  "|---|---|---|---|---|---|---|---|---|---|",
                  f"| dense | all | {r['found']}/{r['trials']} [{r['ci_low']:.2f}, {r['ci_high']:.2f}] "
                  f"| {d['nll']['mean']:.4f} (1.000) | – | {d['nll']['top1']:.3f} | – | – | – | – |"]  # fmt: skip
        for c in (c for c in res["cells"] if c["context"] == n):
            r, nl, a, p = c["retrieval"], c["nll"], c["agreement"], c["prefetch"]
            fmt = lambda v: "–" if v is None else f"{v:.3f}"  # noqa: E731
            lines.append(
                f"| {c['config']} | {_k_label(c)} | {r['found']}/{r['trials']} [{r['ci_low']:.2f}, {r['ci_high']:.2f}] "
                f"| {nl['mean']:.4f} ({nl['ratio_to_dense']:.3f}) | {_ci(nl['delta_vs_dense'], 4)} | {nl['top1']:.3f} "
                f"| {a['identical_leading_mean']:.1f} / {a['matching_fraction']:.2f} of {a['of']} "
                f"| {fmt(p['recall'])} | {fmt(p['mass_coverage_mean'])} | {fmt(p['acceptance'])} |"
            )
        lines.append("")
    lost = res.get("default_lost_vs_oracle", [])
    lines.append(f"Retrieval trials the default configuration misses while `oracle` at the same top_k finds them: "
                 f"{len(lost)}.")  # fmt: skip
    for x in lost[:20]:
        lines.append(f"- context {x['context']}, k {x['k']}, trial {x['trial']} ({x['text']}, {x['kind']}, depth "
                     f"{x['depth']}): expected {x['answer']!r}, default {x['completion']!r}, oracle "
                     f"{x['oracle_completion']!r}")  # fmt: skip
    lines.append("")
    return "\n".join(lines)


def prediction_tables(res: dict) -> str:
    """Markdown: recall / mass / acceptance per cell with the ceiling and recency baseline beside it."""
    lines = [f"Command: `{res.get('command', '?')}` ({res.get('wall_seconds', '?')} s); "
             f"{res['settings']['tokens']} output tokens per request, texts {', '.join(res['settings']['texts'])}, "
             f"{res['settings']['windows']} window(s) each; mean [95% t interval] over requests.", "",
             "| context | top_k | regime | configuration | recall | mass coverage | acceptance |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    ceil = {(c["context"], c["fraction"], c["regime"]): c for c in res.get("ceiling_cells", [])}
    seen = set()
    for c in res["cells"]:
        key = (c["context"], c["fraction"], c["regime"])
        lines.append(f"| {c['context']} | {_k_label(c)} | {c['regime']} | {c['config']} | {_ci(c['recall'])} "
                     f"| {_ci(c['mass_coverage'])} | {_ci(c['acceptance'])} |")  # fmt: skip
        nxt = res["cells"][res["cells"].index(c) + 1] if c is not res["cells"][-1] else None
        end_of_group = nxt is None or (nxt["context"], nxt["fraction"], nxt["regime"]) != key
        if end_of_group and key in ceil and key not in seen:
            seen.add(key)
            e = ceil[key]
            lines.append(f"| {c['context']} | {_k_label(c)} | {c['regime']} | *ceiling (perfect speculator, HF)* "
                         f"| {_ci(e['ceiling_recall'])} | {_ci(e['ceiling_mass'])} | {e['spec_equals_real']:.3f} |")  # fmt: skip
            lines.append(f"| {c['context']} | {_k_label(c)} | {c['regime']} | *recency (previous exact set, HF)* "
                         f"| {_ci(e['recency_recall'])} | {_ci(e['recency_mass'])} | – |")  # fmt: skip
    for key, e in ceil.items():  # ceiling-only runs (--skip-serving)
        if key not in seen:
            lines.append(f"| {e['context']} | {_k_label(e)} | {e['regime']} | *ceiling (perfect speculator, HF)* "
                         f"| {_ci(e['ceiling_recall'])} | {_ci(e['ceiling_mass'])} | {e['spec_equals_real']:.3f} |")  # fmt: skip
    lines.append("")
    return "\n".join(lines)


def plot_fidelity(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = [d["context"] for d in res["dense"]]
    fig, axes = plt.subplots(1, len(contexts), figsize=(5 * len(contexts), 4), squeeze=False)
    for ax, d in zip(axes[0], res["dense"], strict=True):
        n = d["context"]
        ax.axhspan(d["retrieval"]["ci_low"], d["retrieval"]["ci_high"], color="grey", alpha=0.2,
                   label=f"dense {d['retrieval']['accuracy']:.2f}")  # fmt: skip
        for name in res["settings"]["configs"]:
            cs = sorted((c for c in res["cells"] if c["context"] == n and c["config"] == name), key=lambda c: c["k"])
            if not cs:
                continue
            ks = [c["k"] for c in cs]
            acc = [c["retrieval"]["accuracy"] for c in cs]
            err = [[a - c["retrieval"]["ci_low"] for a, c in zip(acc, cs, strict=True)],
                   [c["retrieval"]["ci_high"] - a for a, c in zip(acc, cs, strict=True)]]  # fmt: skip
            ax.errorbar(ks, acc, yerr=err, marker="o", capsize=3, label=name)
        ax.set_xscale("log", base=2)
        ax.set_title(f"context {n} tokens")
        ax.set_xlabel("top_k (tokens per layer and KV head)")
        ax.set_ylabel("retrieval accuracy (95% Wilson CI)")
        ax.set_ylim(-0.05, 1.05)
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_prediction(res: dict, layers_path: Path, regimes_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = res["settings"]
    ceil = {(c["context"], c["fraction"], c["regime"]): c for c in res.get("ceiling_cells", [])}
    groups = [(n, f) for n in s["contexts"] for f in s["fractions"]]
    regime = "sample_t0.8" if "sample_t0.8" in s["regimes"] else s["regimes"][0]
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4), squeeze=False)
    for ax, (n, f) in zip(axes[0], groups, strict=True):
        for c in res["cells"]:
            if (c["context"], c["fraction"], c["regime"]) == (n, f, regime) and c["per_layer_recall"]:
                layers = sorted(int(x) for x in c["per_layer_recall"])
                ax.plot(layers, [c["per_layer_recall"][x if x in c["per_layer_recall"] else str(x)]["mean"]
                                 for x in layers], marker=".", label=c["config"])  # fmt: skip
        e = ceil.get((n, f, regime))
        if e:
            ax.plot(range(len(e["ceiling_recall_per_layer"])), e["ceiling_recall_per_layer"], "k--", label="ceiling (HF)")
            ax.plot(range(len(e["recency_recall_per_layer"])), e["recency_recall_per_layer"], "k:", label="recency (HF)")
        ax.set_title(f"{regime}, context {n}, k = 1/{f}")
        ax.set_xlabel("layer")
        ax.set_ylabel("prefetch recall")
        ax.set_ylim(0, 1.02)
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(layers_path, dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4), squeeze=False)
    for ax, (n, f) in zip(axes[0], groups, strict=True):
        names = list(dict.fromkeys(c["config"] for c in res["cells"])) + ["ceiling (HF)", "recency (HF)"]
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            means, errs = [], [[], []]
            for reg in s["regimes"]:
                if name == "ceiling (HF)":
                    d = ceil.get((n, f, reg), {}).get("ceiling_recall")
                elif name == "recency (HF)":
                    d = ceil.get((n, f, reg), {}).get("recency_recall")
                else:
                    d = next((c["recall"] for c in res["cells"]
                              if (c["context"], c["fraction"], c["regime"], c["config"]) == (n, f, reg, name)), None)  # fmt: skip
                m = d["mean"] if d and d.get("mean") is not None else float("nan")
                means.append(m)
                errs[0].append(m - d["ci_low"] if d and d.get("ci_low") is not None else 0)
                errs[1].append(d["ci_high"] - m if d and d.get("ci_high") is not None else 0)
            ax.bar([r + i * width for r in range(len(s["regimes"]))], means, width, yerr=errs, capsize=2, label=name)
        ax.set_xticks([r + 0.4 - width / 2 for r in range(len(s["regimes"]))], s["regimes"])
        ax.set_title(f"context {n}, k = 1/{f}")
        ax.set_ylabel("prefetch recall (95% CI)")
        ax.set_ylim(0, 1.05)
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(regimes_path, dpi=110)
    plt.close(fig)


RESULTS = Path(__file__).resolve().parent / "results"
#: Plots of the benchmarks page, relative to ``docs/``.
PAGE_PLOTS = ("img/fidelity_accuracy.png", "img/prediction_layers.png", "img/prediction_regimes.png")


def _num(v, digits: int = 2) -> str:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return str(v)
    return f"{v:,}" if isinstance(v, int) else f"{v:,.{digits}f}"


def _cmd(p: dict) -> str:
    return f"`{p['command']}`" if p.get("command") else "not recorded"


def provenance_row(name: str, res: dict) -> str:
    """One row of the page's provenance table: file, commit, date (day), host, dtype, command."""
    p = res["provenance"]
    m = p["machine"]
    host = m.get("gpu") or m.get("cpu_model") or "CPU model not recorded"
    cores = f", {m['cores']} cores" if m.get("cores") else ""
    commit = (p.get("commit") or "not recorded")[:10]
    date = (p.get("date") or "not recorded")[:10]
    return (f"| `{name}` | {commit} | {date} | `{m.get('host_class')}` ({host}{cores}) "
            f"| {m.get('dtype') or 'not recorded'} | {_cmd(p)} |")  # fmt: skip


def decode_speed_table(res: dict) -> str:
    """Markdown: per context x batch, sparse default over SGLang dense and over the same server's
    dense path, the median step (ms), pass keys."""
    lines = ["| context x batch | sparse / SGLang dense | sparse / same server dense | decode tokens/s: SGLang dense, same server dense, sparse | median step ms: same server dense → sparse | pass keys: SGLang dense, sparse |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for c in res["cells"]:
        sd, dd, sp = c["sglang_dense"], c["dualdecoder_dense"], c["dualdecoder_sparse"]
        ms = lambda b: _num(1e3 * b["breakdown"]["step"], 0) if b.get("breakdown") else "–"  # noqa: E731
        lines.append(f"| {c['context']:,} x {c['batch']} | {c['sparse_over_sglang_dense']:.2f}x "
                     f"| {c['sparse_over_dense_same_server']:.2f}x | {_num(sd['decode_tokens_per_second'], 1)}, "
                     f"{_num(dd['decode_tokens_per_second'], 1)}, {_num(sp['decode_tokens_per_second'], 1)} | {ms(dd)} → {ms(sp)} "
                     f"| {sd['found']}/{sd['total']}, {sp['found']}/{sp['total']} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def capacity_table(res: dict) -> str:
    """Markdown: per backend, pass keys, peak concurrent decoding requests, output and steady
    decode tokens/s, in one device KV budget."""
    lines = ["| backend | pass keys | peak concurrent decoding | output tokens/s | steady decode tokens/s |",
             "|---|---|---|---|---|"]  # fmt: skip
    for name, b in res["backends"].items():
        lines.append(f"| `{name}` | {b['found']}/{b['total']} | {b['peak_concurrent_decoding']} "
                     f"| {_num(b['output_tokens_per_second'])} | {_num(b['steady_decode_tokens_per_second'])} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def concurrency_table(res: dict) -> str:
    """Markdown: per level of concurrent requests, output and decode tokens/s of each configuration,
    the sparse path's ratios and its fraction of the ceiling, and its step per sparse row."""
    names = ("dense_same_pool", "dense_room", "sparse", "ceiling")
    lines = ["| requests | output tok/s: " + ", ".join(names) + " | decode tok/s: " + ", ".join(names)
             + " | sparse / dense same pool (output) | sparse / dense room (output) | sparse / ceiling (steady) "
             "| sparse step ms (per row) | pass keys, sparse |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for lv in res["levels"]:
        runs, r = lv["runs"], lv["ratios"]
        b = runs["sparse"].get("breakdown") or {}
        step = (f"{_num(1e3 * b['step'], 0)} ({_num(1e3 * b['per_row']['step'], 1)})"
                if b.get("per_row") else "–")  # fmt: skip
        lines.append(f"| {lv['requests']} | {', '.join(_num(runs[n]['output_tokens_per_second'], 1) for n in names)} "
                     f"| {', '.join(_num(runs[n]['decode_tokens_per_second'], 1) for n in names)} "
                     f"| {_num(r['sparse_over_dense_same_pool'])}x | {_num(r['sparse_over_dense_room'])}x "
                     f"| {_num(r['ceiling_fraction'])} | {step} "
                     f"| {runs['sparse']['found']}/{runs['sparse']['total']} |")  # fmt: skip
    dtypes = ", ".join(f"{n} {s['dtype']}" for n, s in res["servers"].items())
    lines += ["", f"Servers' dtypes: {dtypes} ({res['dtype_choice']})."]
    goals = res.get("goals") or {}
    if goals:
        lines += ["", "Issue 41's goals: " + "; ".join(
            f"{k.replace('_', ' ')} >= {g['goal']}: {_num(g['measured'])} ({'met' if g['met'] else 'not met'})"
            for k, g in goals.items()) + "."]  # fmt: skip
    return "\n".join(lines) + "\n"


def _flatten(d: dict, prefix: str = "", depth: int = 0) -> list[tuple[str, object]]:
    out = []
    for k, v in d.items():
        if k in ("provenance", "command", "benchmark", "bench", "what"):
            continue
        if isinstance(v, dict) and depth < 2:
            out += _flatten(v, f"{prefix}{k}.", depth + 1)
        elif not isinstance(v, list | dict):
            out.append((f"{prefix}{k}", v))
    return out


def figures_table(res: dict, limit: int = 40) -> str:
    """Markdown: the result's scalar figures (nested mappings flattened to two levels, lists left
    out: the JSON has them), at most ``limit`` rows."""
    rows = _flatten(res)
    lines = ["| figure | value |", "|---|---|"] + [f"| `{k}` | {_num(v, 3)} |" for k, v in rows[:limit]]
    if len(rows) > limit:
        lines.append(f"| ... | {len(rows) - limit} more in the JSON |")
    return "\n".join(lines) + "\n"


def list_tables(res: dict, max_rows: int = 16, max_cols: int = 8) -> str:
    """Markdown: one table per top-level list of mappings (``cells``, ``runs``), their scalar
    fields as columns (at most ``max_cols``), at most ``max_rows`` rows each."""
    out = []
    for key, v in res.items():
        if not (isinstance(v, list) and v and all(isinstance(x, dict) for x in v)):
            continue
        cols = [k for k, x in v[0].items() if not isinstance(x, list | dict)][:max_cols]
        if not cols:
            continue
        out += [f"`{key}`:", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        out += ["| " + " | ".join(_num(x.get(c), 3) for c in cols) + " |" for x in v[:max_rows]]
        out.append("")
    return "\n".join(out)


def _title(name: str, res: dict) -> str:
    return res.get("benchmark") or res.get("bench") or res.get("what") or name


def ruler_table(res: dict) -> str:
    """``bench.ruler``: per length and configuration, the share answered with its Wilson 95% interval and,
    on the same samples, how many only it / only ``host_sync`` answered and only it / only ``dense``; then
    the floor tasks."""
    rows = ["| length (tokens) | configuration | answered | 95% CI | only this / only host_sync | only this / only dense |",
            "|---|---|---|---|---|---|"]  # fmt: skip
    for c in res["cells"]:
        vs, vd = c.get("vs_host_sync"), c.get("vs_dense")
        paired = f"{vs['only_this']} / {vs['only_host_sync']}" if vs else "-"
        dense = f"{vd['only_this']} / {vd['only_dense']}" if vd else "-"
        rows.append(f"| {c['length']:,} | {c['config']} | {c['right']}/{c['n']} = {c['score']:.2f} | "
                    f"[{c['ci95'][0]:.2f}, {c['ci95'][1]:.2f}] | {paired} | {dense} |")  # fmt: skip
    for f in res.get("floor") or []:
        rows.append(f"| {f['length']:,} | {f['config']} ({f['task']}, floor) | {f['right']}/{f['n']} = {f['score']:.2f} | "
                    f"[{f['ci95'][0]:.2f}, {f['ci95'][1]:.2f}] | - | - |")  # fmt: skip
    return "\n".join(rows) + "\n"


def context_table(res: dict) -> str:
    """``bench.context``: per cell (requests x prompt tokens), dense and sparse steady decode tokens/s,
    their ratio, the step a user sees (ms between two tokens of a request), the sparse step's phases
    (ms, the backend's counters), pass keys found; then issue 54's goals."""
    rows = ["| requests | prompt tokens | dense tok/s | sparse tok/s | sparse / dense | dense step ms | sparse step ms "
            "| select | assemble | attention | rest | pass keys dense / sparse |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for c in res["cells"]:
        d, sp = c["runs"]["dense"], c["runs"]["sparse"]
        b = sp.get("breakdown") or {}
        phase = {k: _num(1000 * b[k], 1) if k in b else "-" for k in ("select", "assemble", "attention", "rest")}
        rows.append(f"| {c['requests']} | {max(c['prompt_tokens']):,} | {_num(d['steady_decode_tokens_per_second'])} | "
                    f"{_num(sp['steady_decode_tokens_per_second'])} | {_num(c['sparse_over_dense'])}x | "
                    f"{_num(1000 * d['steady_gap_seconds'], 1)} | {_num(1000 * sp['steady_gap_seconds'], 1)} | "
                    f"{phase['select']} | {phase['assemble']} | {phase['attention']} | {phase['rest']} | "
                    f"{d['found']}/{d['total']} / {sp['found']}/{sp['total']} |")  # fmt: skip
    out = "\n".join(rows) + "\n"
    g = res.get("goals") or {}
    lines = [f"- {k}: measured {v['measured']}, goal {v['goal']}: {'met' if v['met'] else 'missed'}"
             for k, v in g.items() if isinstance(v, dict)]  # fmt: skip
    lines += [f"- {k}: {v}" for k, v in g.items() if not isinstance(v, dict)]
    return out + ("\n" + "\n".join(lines) + "\n" if lines else "")


def passkey_table(res: dict) -> str:
    """``bench.passkey``: per server configuration (``--server-args`` label or backend) and prompt length,
    pass keys found over prompts, with the prompt tokens the server reported."""
    rows = ["| configuration | target tokens | prompt tokens | found |", "|---|---|---|---|"]
    for name, run in res["backends"].items():
        for n in sorted({r["target_tokens"] for r in run["rows"]}):
            cell = [r for r in run["rows"] if r["target_tokens"] == n]
            rows.append(f"| {name} | {n:,} | {max(r['prompt_tokens'] for r in cell):,} | "
                        f"{sum(r['found'] for r in cell)}/{len(cell)} |")  # fmt: skip
    return "\n".join(rows) + "\n"


def recall_table(res: dict) -> str:
    """``bench.recall``: per context and regime, the prediction's recall (mean over requests, 95% CI),
    pooled, and the speculation's acceptance."""
    rows = ["| context | top_k | regime | recall (mean over requests) | 95% CI | pooled | acceptance | requests |",
            "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for c in res["cells"]:
        r = c["recall"]
        acc = "-" if c["acceptance"] is None else f"{c['acceptance']:.2f}"
        rows.append(f"| {c['context']:,} | {c['top_k']} | {c['regime']} | {r['mean']:.3f} | [{r['ci_low']:.3f}, "
                    f"{r['ci_high']:.3f}] | {c['pooled_recall']:.3f} | {acc} | {r['n']} |")  # fmt: skip
    return "\n".join(rows) + "\n"


def select_recall_table(res: dict) -> str:
    """``bench.select_recall``: per context and selection, the recall of the exact top-k (95% CI), its
    ratio to the full scan's, the worst layer's mean and the index bytes read; the exact bound scan's
    blocks read per context."""
    rows = ["| context | selection | recall of the exact top-k | 95% CI | of the full scan's | worst layer | "
            "index read |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in res["runs"]:
        for name, v in r["methods"].items():
            rc = v["recall_vs_exact"]
            rows.append(f"| {r['tokens']:,} | {name.replace('two_level', 'two-level,')} | {rc['mean']:.4f} | "
                        f"[{rc['ci95'][0]:.4f}, {rc['ci95'][1]:.4f}] | {v['of_full_scan']:.3f} | "
                        f"{min(v['per_layer']):.3f} | {v['index_read']:.2f} |")  # fmt: skip
        rows.append(f"| {r['tokens']:,} | exact scan in Quest-bound order | - | - | - | - | "
                    f"{r['exact_bound_scan_blocks_read']:.3f} of the blocks |")  # fmt: skip
    yarn = f" YaRN factor {res['yarn']:g}." if res.get("yarn") else ""
    return f"k {res['runs'][0]['k']}, rerank {res['runs'][0]['rerank']:g}.{yarn}\n\n" + "\n".join(rows) + "\n"


def select_shapes_table(res: dict) -> str:
    """``bench.select_shapes``: per model shape, context and selection, the selection's ms per step,
    the index read, the candidates scored and the bandwidth floor."""
    rows = ["| model shape | context | selection | select ms / step | index read | scored per row | floor ms |",
            "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in res["runs"]:
        for name, v in r["methods"].items():
            rows.append(f"| {r['shape']} | {r['tokens']:,} | {name.replace('two_level', 'two-level,')} | "
                        f"{v['select_ms_per_step']} | {v['index_fraction']:.3f} | {v['candidates_scored_per_row']:,} | "
                        f"{v['floor_ms_at_read_bandwidth']} |")  # fmt: skip
    return (f"One request, {res['threads']} threads, read bandwidth {res['read_bandwidth_gbs']} GB/s, "
            f"{res['layers_measured']} layers timed per shape:\n\n" + "\n".join(rows) + "\n")


def benchmarks_page(results: Path = RESULTS, plots: Path | None = None) -> str:
    """The whole of ``docs/benchmarks.md`` from the JSON files directly under ``results`` (sorted
    by name); with ``plots``, also writes the quality plots there (:data:`PAGE_PLOTS`' names)."""
    files = sorted(results.glob("*.json"))
    res = {f.name: json.loads(f.read_text()) for f in files}
    out = ["# Benchmarks", "",
           "<!-- Generated by `make report` (python -m bench.report --page docs/benchmarks.md --plots docs/img)",
           "     from bench/results/*.json; tests/test_bench_results.py fails when they differ. Do not edit. -->", "",
           "Every result below is a JSON file in `bench/results/` with a `provenance` block (commit, date, command,",
           "versions, one machine block); results kept for history only are in `bench/results/archive/` and are",
           "not cited. CPUs of one machine kind differ several-fold in dense attention speed: compare figures",
           "only within one result (one run, one host). Where a field was not recorded at run time the block",
           "says so in its `provenance_note`.", "",
           "## Results and their provenance", "",
           "| result | commit | date | host | dtype | command |", "|---|---|---|---|---|---|"]  # fmt: skip
    out += [provenance_row(n, r) for n, r in res.items()] + [""]
    for name, r in res.items():
        out += [f"## {_title(name, r)}", "", f"`bench/results/{name}`, host `{r['provenance']['machine'].get('host_class')}`.", ""]
        if name.startswith("decode_speed"):
            out.append(decode_speed_table(r))
        elif name.startswith("capacity"):
            out += [f"Device KV budget: {r['device_kv_budget_tokens']:,} tokens, {len(r['prompt_tokens'][0])} requests "
                    f"of ~{r['prompt_tokens'][0][0]:,} tokens, {r['new_tokens_per_request']} new tokens each, "
                    f"{r.get('rounds', 1)} round(s).", "", capacity_table(r)]  # fmt: skip
        elif name.startswith("concurrency"):
            out += [f"~{r['prompt_tokens']:,}-token requests (ceiling: ~{r['ceiling_prompt_tokens']} tokens), "
                    f"{r['new_tokens']} new tokens each, streamed, greedy; "
                    f"each server's dtype below; device KV pool of "
                    f"dense same pool and sparse {r['servers']['sparse']['device_kv_budget_tokens']:,} tokens, "
                    f"dense room {r['servers']['dense_room']['device_kv_budget_tokens']:,}:", "",
                    concurrency_table(r)]  # fmt: skip
            png = Path(name).with_suffix(".png").name
            if (results / png).exists():
                out += [f"![throughput against concurrency](../bench/results/{png})", ""]
        elif name.startswith("ruler"):
            out += [f"RULER `{r['task']}` through lm-eval, {r['samples']} samples per cell, greedy, "
                    f"{r['max_gen_toks']} tokens:", "", ruler_table(r)]  # fmt: skip
            png = Path(name).with_suffix(".png").name
            if (results / png).exists():
                out += [f"![RULER {r['task']}](../bench/results/{png})", ""]
        elif name.startswith("context"):
            out += [f"Preset `{r['preset']}`, {r['new_tokens']} new tokens per request, greedy, streamed; dense "
                    f"{r['servers']['dense']['dtype']} ({r['dtype_choice']}), pool "
                    f"{r['servers']['dense']['device_kv_budget_tokens']:,} tokens; sparse {r['servers']['sparse']['dtype']}, "
                    f"pool {r['servers']['sparse']['device_kv_budget_tokens']:,}. Step ms: the median time between two "
                    "tokens of a request while the most requests decode (what a user sees); select ... rest: the "
                    "sparse backend's mean decode step by phase from its own counters (ms; their sum, the "
                    "backend's step, differs from the median gap):", "", context_table(r)]  # fmt: skip
            png = Path(name).with_suffix(".png").name
            if (results / png).exists():
                out += [f"![decode cost against context length](../bench/results/{png})", ""]
        elif name.startswith("passkey"):
            out.append(passkey_table(r))
        elif name.startswith("select_recall"):
            out.append(select_recall_table(r))
        elif name.startswith("select_shapes"):
            out.append(select_shapes_table(r))
        elif name.startswith("recall"):
            out += ["The speculated query's recall of the set each layer attended (host_sync's set for the real "
                    "query), per request:", "", recall_table(r)]  # fmt: skip
        elif name.startswith("fidelity"):
            out += ["Retrieval found / trials and teacher-forced NLL relative to dense, per configuration:", "",
                    fidelity_summary(r)]  # fmt: skip
            if plots:
                plot_fidelity(r, plots / Path(PAGE_PLOTS[0]).name)
            out += [f"![retrieval accuracy against top_k]({PAGE_PLOTS[0]})", ""]
        elif name.startswith("prediction"):
            out.append(prediction_tables(r))
            if r["cells"] or r.get("ceiling_cells"):
                if plots:
                    plot_prediction(r, plots / Path(PAGE_PLOTS[1]).name, plots / Path(PAGE_PLOTS[2]).name)
                out += [f"![prefetch recall per layer]({PAGE_PLOTS[1]})", "",
                        f"![prefetch recall by regime]({PAGE_PLOTS[2]})", ""]  # fmt: skip
        else:
            out.append(figures_table(r))
            tables = list_tables(r)
            if tables:
                out.append(tables)
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--fidelity", default="bench/results/fidelity_cpu.json")
    ap.add_argument("--prediction", default="bench/results/prediction_cpu.json")
    ap.add_argument("--plots", default=None, help="folder for the PNGs (default: beside each JSON)")
    ap.add_argument("--page", default=None, help="write the whole benchmarks page here (docs/benchmarks.md)")
    args = ap.parse_args(argv)
    if args.page:
        plots = Path(args.plots or Path(args.page).parent / "img")
        plots.mkdir(parents=True, exist_ok=True)
        Path(args.page).write_text(benchmarks_page(RESULTS, plots))
        print(f"-> {args.page}, plots in {plots}")
        return 0
    fid, pred = Path(args.fidelity), Path(args.prediction)
    if args.plots:
        Path(args.plots).mkdir(parents=True, exist_ok=True)
    if fid.exists():
        res = json.loads(fid.read_text())
        print("### Fidelity (bench.fidelity)\n")
        print("Retrieval found / trials, NLL x dense, per configuration:\n")
        print(fidelity_summary(res))
        print(fidelity_tables(res))
        folder = Path(args.plots) if args.plots else fid.parent
        plot_fidelity(res, folder / "fidelity_accuracy.png")
    else:
        print(f"({fid} not found: no fidelity table)\n")
    if pred.exists():
        res = json.loads(pred.read_text())
        print("### Prefetch prediction (bench.prediction)\n")
        print(prediction_tables(res))
        folder = Path(args.plots) if args.plots else pred.parent
        if res["cells"] or res.get("ceiling_cells"):
            plot_prediction(res, folder / "prediction_layers.png", folder / "prediction_regimes.png")
    else:
        print(f"({pred} not found: no prediction table)\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
