"""Prediction benchmark: prefetch hit rate per speculator, quality and decode speed, in serving.

Usage::

    python -m bench.prefetch [--out bench/results/prefetch_cpu.json] [--contexts 4000,7900]
                             [--new-tokens 32]

Text: real English prose available offline (the package descriptions in the
virtualenv's ``*.dist-info/METADATA`` files, concatenated in sorted order), cut
to each context length.

**Part 1, hit rate.** One ``dualdecoder`` server (16,384-token device pool,
``prefetch.hit_rate_sample: 1`` so every step is measured,
``--enable-custom-logit-processor``). For each context, critical-set size k
(1/16 and 1/32 of the context), regime and speculator, one request continues
the text with ``dd_selector`` (``--selectors``: ``spec_host``, the default, and
``spec_host_exact``, the same query scored against every host key) and
``dd_speculator`` set per request; the select worker's time per step
(``dd_step_phase_seconds_total{phase="select_ahead"}``) is recorded beside.
Regimes (DESIGN.md "Measuring the prefetch hit rate honestly"): ``greedy``;
``sample_t0.8`` (temperature 0.8, top-p 0.95, fixed seed); ``teacher_forced``
(the output is forced to the text's own next tokens by
:class:`harness.teacher_force.ForceTokens`; the speculators still guess from
the model). Figures are the server's own counters: recall =
``dd_prefetch_hits_total / dd_prefetch_lookups_total`` (per decode step, layer
and KV head: |set fixed one step earlier ∩ exact top-k of the real query| /
k), attention-mass coverage = ``dd_prefetch_mass_prefetched_total /
dd_prefetch_mass_top_k_total``, per layer from ``dd_prefetch_layer_hit_rate``,
acceptance = ``dd_spec_accepted_total / dd_spec_proposed_total``. ``none`` is
the zero-knowledge baseline (the set of step t+1 is step t's exact top-k, the
same as ``recency``).

**Part 2, quality and speed, same run.** A dense server (``torch_native``) and
a ``dualdecoder`` server with the default preset (hit-rate sampling 5%), same
device pool. Per configuration (dense; ``oracle``; ``spec_host`` with each
speculator; ``quest_device``; all at the default top_k 256): passkeys at each
context and depths 10/50/90%; greedy agreement with dense on the text
(identical leading tokens and position-wise matches over ``--new-tokens``);
decode tokens/s of one streamed greedy request (``(chunks - 1) / (last - first
chunk time)``), requests run one at a time. Nothing here is a pass/fail test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml
from tqdm import tqdm

from bench.cli import write_result
from harness.prompts import passkey_prompt
from harness.server import ROOT, scrape, start_server
from harness.texts import corpus_text

SPECULATORS = ("dual_token", "ngram", "none")
REGIMES = ("greedy", "sample_t0.8", "teacher_forced")
CAP = 16384


def _delta(after: dict, before: dict, name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b else None


def _preset(tmp: Path, hit_rate_sample: float) -> Path:
    preset = yaml.safe_load((ROOT / "configs" / "cpu-smollm2.yaml").read_text())
    preset["prefetch"]["hit_rate_sample"] = hit_rate_sample
    preset["experimental"] = {"request_overrides": True}  # requests choose their speculator (dd_speculator)
    path = tmp / f"preset_{hit_rate_sample}.yaml"
    path.write_text(yaml.safe_dump(preset))
    return path


def generate(
    url: str, ids: list[int], n_new: int, sampling: dict, custom: dict, processor: str | None = None
):
    body = {
        "input_ids": ids,
        "sampling_params": {**sampling, "max_new_tokens": n_new, "ignore_eos": True, "custom_params": custom},
    }
    if processor is not None:
        body["custom_logit_processor"] = processor
    r = httpx.post(f"{url}/generate", json=body, timeout=3600)
    r.raise_for_status()
    return r.json()


def hit_rates(
    ids_all: list[int], contexts: list[int], n_new: int, tmp: Path, selectors: list[str]
) -> list[dict]:
    """Part 1 (module docstring)."""
    from harness.teacher_force import ForceTokens

    srv = start_server(
        tmp / "hit_rate.log",
        CAP,
        [
            "--attention-backend",
            "dualdecoder",
            "--dd-config",
            str(_preset(tmp, 1.0)),
            "--enable-custom-logit-processor",
        ],
    )
    runs = []
    try:
        grid = [(n, f, r, s, sel) for n in contexts for f in (16, 32) for r in REGIMES for s in SPECULATORS
                for sel in selectors]  # fmt: skip
        for n, frac, regime, spec, sel in tqdm(grid, desc="hit rate", unit="run"):
            ids, k = ids_all[:n], n // frac
            custom = {"dd_selector": sel, "dd_speculator": spec, "dd_top_k": k}
            sampling, proc = {"temperature": 0}, None
            if regime == "sample_t0.8":
                sampling = {"temperature": 0.8, "top_p": 0.95, "sampling_seed": 1234}
            elif regime == "teacher_forced":
                custom["force_ids"] = ids_all[n : n + n_new]
                proc = ForceTokens.to_str()
            before = scrape(srv.metrics_url)
            out = generate(srv.url, ids, n_new, sampling, custom, proc)
            after = scrape(srv.metrics_url)
            if regime == "teacher_forced":
                assert out["output_ids"] == ids_all[n : n + n_new], "teacher forcing did not hold"
            lab = f'{{selector="{sel}",speculator="{spec}"}}'
            steps = _delta(after, before, 'dd_decode_steps_total{kind="sparse"}')
            lookups = _delta(after, before, f"dd_prefetch_lookups_total{lab}")
            per_layer = {}
            for layer in range(64):
                c = _delta(after, before, f'dd_prefetch_layer_hit_rate_count{{layer="{layer}"}}')
                if c:
                    s = _delta(after, before, f'dd_prefetch_layer_hit_rate_sum{{layer="{layer}"}}')
                    per_layer[layer] = round(s / c, 4)
            spec_lab = f'{{speculator="{spec}"}}'
            runs.append(
                {
                    "context_tokens": n,
                    "k": k,
                    "k_fraction": f"1/{frac}",
                    "regime": regime,
                    "selector": sel,
                    "speculator": spec,
                    "selection_seconds_per_step": _ratio(
                        _delta(after, before, 'dd_step_phase_seconds_total{phase="select_ahead"}'), steps
                    ),
                    "output_tokens": len(out["output_ids"]),
                    "hit_rate": _ratio(_delta(after, before, f"dd_prefetch_hits_total{lab}"), lookups),
                    "mass_coverage": _ratio(
                        _delta(after, before, f"dd_prefetch_mass_prefetched_total{lab}"),
                        _delta(after, before, f"dd_prefetch_mass_top_k_total{lab}"),
                    ),
                    "acceptance": _ratio(
                        _delta(after, before, f"dd_spec_accepted_total{spec_lab}"),
                        _delta(after, before, f"dd_spec_proposed_total{spec_lab}"),
                    ),
                    "lookups": int(lookups),
                    "per_layer_hit_rate": per_layer,
                }
            )
            r = runs[-1]
            tqdm.write(f"{n} 1/{frac} {regime:15s} {sel:15s} {spec:10s} hit {r['hit_rate']} "
                       f"mass {r['mass_coverage']} accept {r['acceptance']} "
                       f"select {r['selection_seconds_per_step']} s/step")  # fmt: skip
    finally:
        rc, alive = srv.stop()
    return runs, {"exit_code": rc, "processes_left": alive}


def decode_speed(url: str, ids: list[int], n_new: int, custom: dict) -> float:
    """Greedy streamed decode rate in tokens/s after the first token (one request)."""
    times = []
    body = {"model": "x", "prompt": ids, "max_tokens": n_new, "temperature": 0, "stream": True,
            "ignore_eos": True, "custom_params": custom}  # fmt: skip
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=3600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                times.append(time.monotonic())
    return round((len(times) - 1) / (times[-1] - times[0]), 3)


CONFIGS = {
    "dense": None,
    "oracle": {"dd_selector": "oracle", "dd_speculator": "none"},
    "spec_host+dual_token": {"dd_selector": "spec_host", "dd_speculator": "dual_token"},
    "spec_host+ngram": {"dd_selector": "spec_host", "dd_speculator": "ngram"},
    "spec_host+none": {"dd_selector": "spec_host", "dd_speculator": "none"},
    "spec_host_exact+dual_token": {"dd_selector": "spec_host_exact", "dd_speculator": "dual_token"},
    "quest_device": {"dd_selector": "quest_device", "dd_speculator": "none"},
}


def quality_and_speed(tok, ids_all: list[int], contexts: list[int], n_new: int, tmp: Path) -> dict:
    """Part 2 (module docstring)."""
    dense = start_server(tmp / "dense.log", CAP, ["--attention-backend", "torch_native"])
    dd = start_server(
        tmp / "dd.log", CAP, ["--attention-backend", "dualdecoder", "--dd-config", str(_preset(tmp, 0.05))]
    )
    out: dict = {name: {"passkeys": [], "agreement": [], "decode_tokens_per_second": {}} for name in CONFIGS}
    try:
        reference = {}
        for n in contexts:
            ids = ids_all[:n]
            reference[n] = generate(dense.url, ids, n_new, {"temperature": 0}, {})["output_ids"]
            for i, depth in enumerate((0.1, 0.5, 0.9)):
                key = 20000 + 7919 * (i + 1) + n
                prompt, n_tok = passkey_prompt(tok, n, depth, key)
                for name, custom in tqdm(CONFIGS.items(), desc=f"passkeys {n} @{depth}", unit="config"):
                    url = dense.url if custom is None else dd.url
                    r = httpx.post(
                        f"{url}/v1/completions",
                        json={"model": "x", "prompt": prompt, "max_tokens": 8, "temperature": 0,
                              "custom_params": custom or {}},
                        timeout=3600,
                    ).json()  # fmt: skip
                    text = r["choices"][0]["text"]
                    found = bool(re.match(rf"\s*{key}\b", text))
                    out[name]["passkeys"].append(
                        {"tokens": n_tok, "depth": depth, "found": found, "answer": text}
                    )
            for name, custom in tqdm(CONFIGS.items(), desc=f"agreement+speed {n}", unit="config"):
                url = dense.url if custom is None else dd.url
                got = generate(url, ids, n_new, {"temperature": 0}, custom or {})["output_ids"]
                same = sum(a == b for a, b in zip(got, reference[n], strict=True))
                lead = next(
                    (i for i, (a, b) in enumerate(zip(got, reference[n], strict=True)) if a != b), len(got)
                )
                out[name]["agreement"].append(
                    {
                        "context_tokens": n,
                        "identical_leading_tokens": lead,
                        "matching_positions": same,
                        "of": len(got),
                    }
                )
                out[name]["decode_tokens_per_second"][str(n)] = decode_speed(url, ids, 64, custom or {})
                tqdm.write(f"{n} {name:22s} agree {same}/{len(got)} lead {lead} "
                           f"decode {out[name]['decode_tokens_per_second'][str(n)]} tok/s")  # fmt: skip
    finally:
        rc_d, alive_d = dense.stop()
        rc, alive = dd.stop()
    for v in out.values():
        v["passkeys_found"] = f"{sum(p['found'] for p in v['passkeys'])}/{len(v['passkeys'])}"
    out["_shutdown"] = {"dense": [rc_d, alive_d], "dualdecoder": [rc, alive]}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.prefetch", description=__doc__)
    ap.add_argument("--out", default="bench/results/prefetch_cpu.json")
    ap.add_argument("--contexts", default="4000,7900")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--skip", choices=["hit_rate", "quality"], default=None, help="skip one part")
    ap.add_argument("--selectors", default="spec_host,spec_host_exact",
                    help="part 1: lookahead selectors measured side by side")
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from dd_sglang.models.smollm2 import prepare_model

    tok = AutoTokenizer.from_pretrained(prepare_model(progress=False))
    ids_all = tok.encode(corpus_text())
    contexts = [int(x) for x in args.contexts.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="dd_prefetch_"))
    result = {
        "benchmark": "prefetch hit rate per selector and speculator, quality and decode speed; CPU, SmolLM2-135M",
        "command": "python -m bench.prefetch " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count()},
        "text": "virtualenv *.dist-info/METADATA long descriptions, sorted, concatenated",
        "new_tokens": args.new_tokens,
    }
    if args.skip != "hit_rate":
        result["hit_rate_runs"], result["hit_rate_shutdown"] = hit_rates(
            ids_all, contexts, args.new_tokens, tmp, args.selectors.split(",")
        )
    if args.skip != "quality":
        result["quality_and_speed"] = quality_and_speed(tok, ids_all, contexts, args.new_tokens, tmp)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_result(result, out)
    print(f"-> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
