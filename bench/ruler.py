"""RULER through lm-eval: dense, the sparse default and exact selection side by side, with 95% intervals.

Usage::

    python -m bench.ruler [--lengths 2048,4096,7680] [--samples 50] [--configs dense,default,host_sync,oracle]
                          [--task niah_single_1] [--floor] [--url URL] [--concurrency 4]
                          [--out bench/results/ruler_<host class>.json] [--plot PNG] [--extend RESULT]

RULER's synthetic tasks (Hsieh et al., 2024, "RULER: What's the Real Context Size of Your
Long-Context Language Models?") as lm-eval 0.4.13 implements them: the haystacks and needles of
``niah_single_1`` (a repeated noise sentence with one pass key) are generated offline with the
embedded model's own tokenizer (``tokenizer=`` its converted folder), so nothing is downloaded.
Every sample goes to one ``dualdecoder`` server (started here, or ``--url``) as an OpenAI
``/v1/completions`` request, greedy, ``--max-gen-toks`` tokens, once per configuration: the same
request with the configuration's ``custom_params``:

* ``dense``: ``{"dd_sparse": false}``, SGLang's dense decode on the same server;
* ``default``: the preset's sparse path (``spec_host`` + ``dual_token``, verified);
* ``spec_host``: the same selector named explicitly;
* ``host_sync`` and ``oracle``: exact selection at attention time (the int8 host index with exact
  re-ranking; every key scored);
* ``top_k_512`` ... ``top_k_8192``: the default with a larger critical set (``dd_top_k``).

The configurations of one sample are sent back to back (:class:`FanOutCompletions`, an lm-eval
``LM``; samples run ``--concurrency`` at a time), so the prompt is prefilled once and the other
configurations find it in SGLang's prefix cache: on 2 cores prefill is most of a 7.5k sample's
cost. lm-eval then evaluates each configuration on its own (one ``simple_evaluate`` per
configuration, answered from those responses). lm-eval scores each sample (``string_match_all``: every expected value in the answer) and the
per-sample scores of its ``--log_samples`` output make the figures here: per (length,
configuration), the share answered with a Wilson 95% interval, and against ``host_sync`` on the
same samples the samples each answered and the other did not. One length per lm-eval run
(``--limit`` takes the first N rows of the whole generated set). ``--floor`` adds one dense run of
``niah_multikey_2`` and ``ruler_vt`` at 4,096 tokens, where the 135M model sits at its floor: to
show it, not to judge the sparse path. ``--extend RESULT`` grows an earlier result to ``--samples``
per cell: it keeps that run's answers and runs only the generated set's next samples (lm-eval's
``samples`` indices), so a long cell need not be run again from its first sample.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

#: Configurations: ``custom_params`` per name (module docstring).
CONFIGS = {
    "dense": {"dd_sparse": False},
    "default": {},
    "spec_host": {"dd_selector": "spec_host"},
    "host_sync": {"dd_selector": "host_sync"},
    "oracle": {"dd_selector": "oracle"},
    "top_k_512": {"dd_top_k": 512},
    "top_k_1024": {"dd_top_k": 1024},
    "top_k_4096": {"dd_top_k": 4096},
    "top_k_8192": {"dd_top_k": 8192},
}
#: Tasks whose data lm-eval generates offline (DESIGN.md: the essay and QA tasks download text;
#: ``niah_single_2`` and ``niah_multikey_1`` are essay tasks, ``prepare_niah.get_haystack("essay")``
#: loads a Hugging Face dataset).
TASKS = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "ruler_vt", "ruler_cwe", "ruler_fwe")
#: Floor tasks run once, dense, at this length (``--floor``).
FLOOR_TASKS, FLOOR_LENGTH = ("niah_multikey_2", "ruler_vt"), 4096


class FanOutCompletions:
    """An lm-eval ``LM`` (``generate_until`` only) that sends each request once per configuration.

    For every request not answered yet it posts ``/v1/completions`` (greedy, ``max_tokens``, the
    request's ``until`` as ``stop``) under every configuration of ``configs``, back to back, and keeps
    the texts; it answers lm-eval with the texts of :attr:`current` (set before each
    ``simple_evaluate``). Requests run ``concurrency`` at a time.

    Raises:
        RuntimeError: the server answered a request with an HTTP error (its body quoted).
    """

    def __init__(self, url: str, configs: dict[str, dict], max_tokens: int, concurrency: int):
        from lm_eval.api.model import LM

        self.url, self.configs, self.max_tokens, self.concurrency = url, configs, max_tokens, concurrency
        self.answers: dict[tuple[str, str], str] = {}
        #: The prompt tokens the server reported per (configuration, context): the prompt was not cut.
        self.prompt_tokens: dict[tuple[str, str], int] = {}
        self.current = next(iter(configs))
        self.lm = type("DDFanOut", (LM,), {"generate_until": lambda lm, reqs, disable_tqdm=False: self.generate(reqs),
                                            "loglikelihood": _no_loglikelihood,
                                            "loglikelihood_rolling": _no_loglikelihood})()  # fmt: skip

    def _post(self, client, context: str, stop: list[str] | None) -> None:
        for name, custom in self.configs.items():
            if (name, context) in self.answers:
                continue
            body = {"model": "smollm2", "prompt": context, "max_tokens": self.max_tokens, "temperature": 0,
                    **({"stop": stop} if stop else {}), **({"custom_params": custom} if custom else {})}  # fmt: skip
            r = client.post(f"{self.url}/v1/completions", json=body, timeout=1800)
            if r.status_code != 200:
                raise RuntimeError(f"{name}: HTTP {r.status_code}: {r.text[:300]}")
            data = r.json()
            self.answers[(name, context)] = data["choices"][0]["text"]
            self.prompt_tokens[(name, context)] = data["usage"]["prompt_tokens"]

    def generate(self, requests) -> list[str]:
        """lm-eval's ``generate_until``: the texts of :attr:`current` for ``requests``."""
        from concurrent.futures import ThreadPoolExecutor

        import httpx

        args = [(req.args[0], list(req.args[1].get("until") or [])) for req in requests]
        with httpx.Client() as client, ThreadPoolExecutor(self.concurrency) as pool:
            for f in [pool.submit(self._post, client, ctx, stop) for ctx, stop in args]:
                f.result()
        return [self.answers[(self.current, ctx)] for ctx, _ in args]


def no_nltk_downloads() -> None:
    """Keep lm-eval's RULER module from downloading at run time: importing it
    (``lm_eval/tasks/ruler/prepare_niah.py``) calls ``nltk.download("punkt_tab")`` when that
    tokenizer is not installed, which reaches the network. Only the essay tasks, which
    :data:`TASKS` leaves out, split sentences with it, so ``nltk.download`` here returns False
    (NLTK's own return for a failed download) and logs what it skipped. Called before every
    import of ``lm_eval.tasks.ruler``."""
    import nltk

    def skipped(info_or_id=None, *args, **kwargs) -> bool:
        logging.getLogger(__name__).info("nltk.download(%r) skipped: bench.ruler downloads nothing", info_or_id)
        return False

    nltk.download = skipped


def niah_single_1_spec(samples: int) -> dict:
    """lm-eval's ``niah_single_1`` task config with its data generated for ``samples`` samples only.

    lm-eval 0.4.13's own ``niah_utils.niah_single_1`` generates 500 samples per length whatever
    ``limit`` says (tokenizing each ~length-token prompt: most of a two-sample run's time). This
    is that task's YAML (``lm_eval/tasks/ruler/niah_single_1.yaml``, read by lm-eval's loader)
    with ``custom_dataset`` calling the same generator (``prepare_niah.generate_samples``) with
    that task's arguments and ``num_samples=samples``: the generator draws sample after sample
    from Python's global random, which ``simple_evaluate`` seeds first (``random_seed``), so these
    are the first ``samples`` of lm-eval's 500 (``tests/test_bench_quality_units.py`` checks it).
    A dict spec, as ``simple_evaluate`` takes it.
    """
    no_nltk_downloads()
    from lm_eval.tasks._yaml_loader import load_yaml
    from lm_eval.tasks.ruler import niah_utils as nu

    def dataset(**kwargs):
        lengths = kwargs.pop("max_seq_lengths", nu.DEFAULT_SEQ_LENGTHS)
        tok = nu.get_tokenizer(nu.resolve_tokenizer_name(kwargs))
        return nu.download_dataset(
            nu.generate_samples(nu.get_haystack(type_haystack="repeat"), max_seq_length=n, template=nu.TEMPLATE,
                                type_haystack="repeat", type_needle_k="words", type_needle_v="numbers",
                                num_samples=samples, TOKENIZER=tok)  # fmt: skip
            for n in lengths
        )

    cfg = load_yaml(Path(nu.__file__).with_name("niah_single_1.yaml"), resolve_func=True)
    cfg["custom_dataset"] = dataset
    return cfg


def _ruler_dir() -> Path:
    """lm-eval's RULER task folder: the one a ``TaskManager`` here indexes (every task of :data:`TASKS`
    is there; lm-eval's default index reads all of its ~28,000 task YAML files, ~7 s a call here)."""
    no_nltk_downloads()
    from lm_eval.tasks.ruler import common_utils

    return Path(common_utils.__file__).parent


def _no_loglikelihood(lm, requests, disable_tqdm=False):
    raise NotImplementedError("bench.ruler runs generation tasks only")


def run_task(lm: FanOutCompletions, tokenizer: str, task: str, length: int, samples: int, config: str,
             max_gen_toks: int, ids: list[int] | None = None) -> list[dict]:  # fmt: skip
    """One lm-eval evaluation of ``task`` at ``length`` tokens, answered with configuration ``config``:
    the first ``samples`` of the generated set (lm-eval's ``limit``), or the samples ``ids`` (its
    ``samples`` indices: ``--doc-ids``, or ``--extend``'s next samples).

    Returns one record per sample: ``{"doc_id", "score", "answer", "target"}`` (score in [0, 1],
    lm-eval's own ``process_results`` value for that length; ``doc_id`` the sample's index in the
    generated set, as lm-eval 0.4.13 logs it for ``samples`` indices too).

    Raises:
        RuntimeError: lm-eval returned no sample of ``task``.
    """
    no_nltk_downloads()
    import lm_eval
    from lm_eval.tasks import TaskManager

    lm.current = config
    pick = {"samples": {task: ids}} if ids else {"limit": samples}
    out = lm_eval.simple_evaluate(
        model=lm.lm,
        tasks=[niah_single_1_spec(max(ids) + 1 if ids else samples) if task == "niah_single_1" else task],
        task_manager=TaskManager(include_path=_ruler_dir(), include_defaults=False,
                                 metadata={"max_seq_lengths": [length], "tokenizer": tokenizer,
                                           "pretrained": tokenizer}),  # fmt: skip
        **pick,
        gen_kwargs={"max_gen_toks": max_gen_toks},
        log_samples=True,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )
    rows = (out or {}).get("samples", {}).get(task) or []
    if not rows:
        raise RuntimeError(f"lm-eval returned no samples of {task} at {length} tokens")
    recs = []
    for s in rows:
        resp = s.get("filtered_resps") or s.get("resps") or [""]
        while isinstance(resp, list):
            resp = resp[0] if resp else ""
        recs.append({"doc_id": s["doc_id"], "score": float(s[str(length)]), "answer": str(resp)[:120],
                     "target": s.get("target")})  # fmt: skip
    return sorted(recs, key=lambda r: r["doc_id"])


def _paired(recs: list[dict], other: list[dict], only_other: str) -> dict:
    """On the samples both ``recs`` and ``other`` hold: how many only ``recs`` answered (``only_this``),
    only ``other`` (key ``only_other``), and how many were paired."""
    ref = {r["doc_id"]: r["score"] >= 1.0 for r in other}
    mine = {r["doc_id"]: r["score"] >= 1.0 for r in recs}
    both = set(ref) & set(mine)
    return {"only_this": sum(mine[d] and not ref[d] for d in both),
            only_other: sum(ref[d] and not mine[d] for d in both), "paired": len(both)}  # fmt: skip


def summarize(recs: list[dict], reference: list[dict] | None, dense: list[dict] | None = None) -> dict:
    """Share answered with its Wilson 95% interval and, against ``reference`` (the same samples under
    ``host_sync``), how many samples only this configuration / only the reference answered; the same
    against ``dense`` (``vs_dense``: ``only_this``, ``only_dense``, ``paired``)."""
    from bench.stats import wilson

    right = sum(r["score"] >= 1.0 for r in recs)
    lo, hi = wilson(right, len(recs))
    out = {"n": len(recs), "right": right, "score": right / len(recs), "ci95": [round(lo, 4), round(hi, 4)],
           "mean_score": sum(r["score"] for r in recs) / len(recs)}  # fmt: skip
    if reference is not None:
        out["vs_host_sync"] = _paired(recs, reference, "only_host_sync")
    if dense is not None:
        out["vs_dense"] = _paired(recs, dense, "only_dense")
    return out


def plot(result: dict, path: Path) -> None:
    """Grouped bars: per length, each configuration's share answered with its 95% interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = result["cells"]
    lengths = sorted({c["length"] for c in cells})
    configs = list(dict.fromkeys(c["config"] for c in cells))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(len(configs), 1)
    for j, name in enumerate(configs):
        xs, ys, err = [], [], [[], []]
        for i, length in enumerate(lengths):
            c = next((c for c in cells if c["config"] == name and c["length"] == length), None)
            if c is None:
                continue
            xs.append(i + (j - (len(configs) - 1) / 2) * width)
            ys.append(c["score"])
            err[0].append(c["score"] - c["ci95"][0])
            err[1].append(c["ci95"][1] - c["score"])
        ax.bar(xs, ys, width, yerr=err, capsize=3, label=name)
    ax.set_xticks(range(len(lengths)), [f"{n} tokens" for n in lengths])
    ax.set_ylabel(f"{result['task']}: share answered (95% CI)")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=8, ncol=len(configs))
    ax.set_title(f"RULER {result['task']} through lm-eval, {result['samples']} samples per cell")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def load_prior(path: Path, args, lengths: list[int], configs: list[str]) -> dict:
    """The result ``--extend`` names, checked to hold the cells this run extends.

    Every (length, configuration) asked must hold the same number of per-sample records, numbered
    0 .. n-1, with n below ``args.samples``, from a run of the same task, preset and ``max_gen_toks``.

    Raises:
        ValueError: the file is missing or unreadable, or a check above fails (the message names it).
    """
    import json

    try:
        prior = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot read {path}: {err}") from None
    for key in ("task", "preset", "max_gen_toks"):
        if prior.get(key) != getattr(args, key):
            raise ValueError(f"{path} has {key} {prior.get(key)!r}, this run {getattr(args, key)!r}")
    counts = set()
    for length in lengths:
        for name in configs:
            recs = prior.get("per_sample", {}).get(str(length), {}).get(name)
            if recs is None:
                raise ValueError(f"{path} holds no per-sample answers for length {length}, configuration {name}")
            if [r["doc_id"] for r in recs] != list(range(len(recs))):
                raise ValueError(f"{path}: samples of length {length}, {name} are not numbered 0..{len(recs) - 1}")
            counts.add(len(recs))
    if len(counts) != 1:
        raise ValueError(f"{path}: its cells hold different sample counts {sorted(counts)}")
    if (n := counts.pop()) >= args.samples:
        raise ValueError(f"{path} already holds {n} samples per cell; --samples must exceed it, got {args.samples}")
    return prior


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.ruler", description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="2048,4096,7680", help="comma list of RULER sequence lengths (tokens)")
    ap.add_argument("--samples", type=int, default=50, help="samples per (length, configuration): lm-eval --limit")
    ap.add_argument("--configs", default="dense,default,host_sync,oracle",
                    help=f"comma list of configurations: {', '.join(CONFIGS)}")  # fmt: skip
    ap.add_argument("--task", default="niah_single_1", help=f"RULER task generated offline: {', '.join(TASKS)}")
    ap.add_argument("--floor", action="store_true", help=f"also run {', '.join(FLOOR_TASKS)} once, dense, at {FLOOR_LENGTH}")
    ap.add_argument("--url", default=None, help="a running dualdecoder server (default: start one here)")
    ap.add_argument("--preset", default="cpu-smollm2",
                    help="the started server's preset in configs/ (cpu-smollm2-32k: lengths to 32,000; its "
                         "pool is that preset's server.max_total_tokens)")  # fmt: skip
    ap.add_argument("--concurrency", type=int, default=4, help="lm-eval num_concurrent")
    ap.add_argument("--dtype", default=None, choices=("bfloat16", "float32"),
                    help="the started server's --dtype (default: the launcher's choice for this CPU); every "
                         "configuration runs on that one server")  # fmt: skip
    ap.add_argument("--max-gen-toks", type=int, default=48, help="tokens generated per sample (the task's 128, cut)")
    ap.add_argument("--out", default=None, help="result JSON (default bench/results/ruler_<host class>.json)")
    ap.add_argument("--plot", default=None, help="PNG (default: the JSON's path with .png)")
    ap.add_argument("--doc-ids", default=None, metavar="I,J,...",
                    help="run only these samples of the generated set (indices from 0; instead of the first "
                         "--samples), e.g. the ones an earlier run's configurations answered differently")  # fmt: skip
    ap.add_argument("--extend", default=None, metavar="RESULT",
                    help="a result of this bench holding every (length, configuration) asked with fewer than "
                         "--samples samples: run only the samples it lacks (the generated set's next ones) and "
                         "write the merged result (--out defaults to RESULT)")  # fmt: skip
    args = ap.parse_args(argv)
    from bench.cli import check_ranges

    check_ranges(ap, args, (("samples", 1, 100_000), ("concurrency", 1, 64), ("max_gen_toks", 1, 1024)))
    try:
        lengths = [int(x) for x in args.lengths.split(",") if x]
    except ValueError:
        ap.error(f"--lengths must be comma-separated integers, got {args.lengths!r}")
    from dd_sglang.config import ConfigError, load_config

    try:
        preset = load_config(args.preset)
    except ConfigError as err:
        ap.error(f"--preset: {err}")
    context = preset.server.context_length or 8192
    if not lengths or any(not 256 <= n <= context for n in lengths):
        ap.error(f"--lengths must be in [256, {context}] (the context of preset {args.preset}), got {args.lengths!r}")
    configs = [x for x in args.configs.split(",") if x]
    if not configs or any(c not in CONFIGS for c in configs):
        ap.error(f"--configs must name configurations of {list(CONFIGS)}, got {args.configs!r}")
    if args.task not in TASKS:
        ap.error(f"--task must be one of {list(TASKS)}, got {args.task!r}")
    ids = None
    if args.doc_ids is not None:
        try:
            ids = sorted({int(x) for x in args.doc_ids.split(",") if x})
        except ValueError:
            ap.error(f"--doc-ids must be comma-separated integers, got {args.doc_ids!r}")
        if not ids or ids[0] < 0 or ids[-1] >= 500 or args.extend:
            ap.error(f"--doc-ids must name samples in [0, 500) (lm-eval generates 500), without --extend; got {args.doc_ids!r}")
        args.samples = len(ids)
    prior = None
    if args.extend:
        try:
            prior = load_prior(Path(args.extend), args, lengths, configs)
        except ValueError as err:
            ap.error(f"--extend: {err}")
    from bench import machine
    from dd_sglang.models.smollm2 import prepare_model

    out = Path(args.out or args.extend or f"bench/results/ruler_{machine.host_class(machine.host().get('cpu_model'))}.json")
    tokenizer = str(prepare_model(progress=False))
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    command = "python -m bench.ruler " + " ".join(argv if argv is not None else sys.argv[1:])
    srv, tmp, dtype = None, None, None
    url = args.url
    t0 = time.monotonic()
    try:
        if url is None:
            from harness.client import COMMON_FLAGS, bench_preset
            from harness.server import start_server

            tmp = Path(tempfile.mkdtemp(prefix="dd_ruler_"))
            # The preset (--preset), every step's prefetch hit rate measured.
            flags = ["--attention-backend", "dualdecoder", "--dd-config", str(bench_preset(tmp, None, base=args.preset)),
                     *COMMON_FLAGS, *(["--dtype", args.dtype] if args.dtype else [])]  # fmt: skip
            srv = start_server(tmp / "server.log", preset.server.max_total_tokens, flags, timeout=900)
            url, dtype = srv.url, srv.dtype
        cells, samples = [], {}
        lm = FanOutCompletions(url, {name: CONFIGS[name] for name in configs}, args.max_gen_toks, args.concurrency)
        for length in lengths:
            per = {}
            old = prior["per_sample"][str(length)] if prior else {}
            first = len(next(iter(old.values()))) if old else 0
            picked = list(range(first, args.samples)) if first else ids
            for name in configs:
                t1 = time.monotonic()
                per[name] = list(old.get(name, [])) + run_task(lm, tokenizer, args.task, length, args.samples - first,
                                                               name, args.max_gen_toks, picked)  # fmt: skip
                print(f"{args.task} {length} {name}: {sum(r['score'] >= 1 for r in per[name])}/{len(per[name])} "
                      f"({time.monotonic() - t1:.0f} s)", flush=True)  # fmt: skip
            for name in configs:
                reported = [n for (c, _), n in lm.prompt_tokens.items() if c == name]
                before = next((c.get("prompt_tokens_reported") for c in (prior or {}).get("cells", [])
                               if c["length"] == length and c["config"] == name), None)  # fmt: skip
                reported += before or []
                cells.append({"length": length, "config": name, "custom_params": CONFIGS[name],
                              "prompt_tokens_reported": [min(reported), max(reported)] if reported else None,
                              **summarize(per[name], per.get("host_sync") if name != "host_sync" else None,
                                          per.get("dense") if name != "dense" else None)})  # fmt: skip
            lm.prompt_tokens.clear()
            samples[str(length)] = per
        floor = []
        if args.floor:
            dense = FanOutCompletions(url, {"dense": CONFIGS["dense"]}, args.max_gen_toks, args.concurrency)
            for task in FLOOR_TASKS:
                recs = run_task(dense, tokenizer, task, FLOOR_LENGTH, min(args.samples, 20), "dense", args.max_gen_toks)
                floor.append({"task": task, "length": FLOOR_LENGTH, "config": "dense", **summarize(recs, None)})
                print(f"floor {task} {FLOOR_LENGTH} dense: {floor[-1]['right']}/{floor[-1]['n']}", flush=True)
    finally:
        if srv is not None:
            srv.stop()
        if tmp is not None:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    from bench.cli import write_result

    result = {"benchmark": "ruler", "preset": args.preset, "task": args.task, "samples": args.samples, **({"doc_ids": ids} if ids else {}), "max_gen_toks": args.max_gen_toks,
              "command": command, "dtype": dtype, "lm_eval": "0.4.13, greedy /v1/completions (bench.ruler.FanOutCompletions)",
              "seconds": round(time.monotonic() - t0, 1), "cells": cells, "floor": floor,
              "per_sample": samples}  # fmt: skip
    if prior:
        result["extends"] = {"command": prior["command"], "seconds": prior.get("seconds"),
                             "samples": prior["samples"], "provenance": prior.get("provenance"),
                             "note": "the first samples of every cell are this earlier run's (its answers kept "
                                     "as recorded); this run answered the rest on one new server"}  # fmt: skip
    write_result(result, out)
    plot(result, Path(args.plot) if args.plot else out.with_suffix(".png"))
    for c in cells:
        vs, vd = c.get("vs_host_sync"), c.get("vs_dense")
        extra = f", only this {vs['only_this']} / only host_sync {vs['only_host_sync']}" if vs else ""
        extra += f", only this {vd['only_this']} / only dense {vd['only_dense']}" if vd else ""
        print(f"{c['length']:>5} {c['config']:<15} {c['right']}/{c['n']} = {c['score']:.2f} "
              f"[{c['ci95'][0]:.2f}, {c['ci95'][1]:.2f}]{extra}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
