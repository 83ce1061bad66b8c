"""Unit tests of the quality benches' pure parts (no server): intervals, set scoring, prompts, the carrier."""

from __future__ import annotations

import json
import math
import random
from types import SimpleNamespace

import pytest
import torch

from bench.capacity import backend_spec, ratios, round_prompts, steady_decode
from bench.ceiling import set_scores
from bench.stats import mean_ci, wilson
from harness.teacher_force import CARRIER_IDS, ForceTokensScored, decode_scores


def test_wilson_matches_hand_computed_values():
    # 0/20: upper bound z^2/(n + z^2) = 3.8415 / 23.8415
    lo, hi = wilson(0, 20)
    assert lo == 0.0 and hi == pytest.approx(3.841459 / 23.841459, abs=1e-6)
    lo, hi = wilson(10, 20)  # symmetric around 0.5
    assert lo == pytest.approx(1 - hi) and lo == pytest.approx(0.299298, abs=1e-5)
    with pytest.raises(ValueError, match="successes must be in"):
        wilson(21, 20)


def test_mean_ci_uses_student_t():
    d = mean_ci([1.0, 2.0, 3.0])  # sd 1, t(0.975, 2) = 4.302653
    half = 4.302653 / math.sqrt(3)
    assert d["mean"] == 2.0 and d["n"] == 3
    assert d["ci_low"] == pytest.approx(2 - half, abs=1e-4) and d["ci_high"] == pytest.approx(2 + half, abs=1e-4)
    assert mean_ci([0.5]) == {"mean": 0.5, "ci_low": None, "ci_high": None, "n": 1}
    assert mean_ci([])["mean"] is None


def test_set_scores_by_hand():
    # 2 KV heads, 5 candidates; true top-2 of head 0 = {0, 1}, of head 1 = {4, 3}.
    true = torch.tensor([[0.4, 0.3, 0.1, 0.1, 0.1], [0.05, 0.05, 0.1, 0.3, 0.5]])
    chosen = torch.tensor([[0, 2], [4, 3]])
    recall, mass = set_scores(true, chosen, 2)
    assert recall == pytest.approx(3 / 4)
    assert mass == pytest.approx((0.4 + 0.1 + 0.5 + 0.3) / (0.4 + 0.3 + 0.5 + 0.3))


def _meta_from_processed(logits: torch.Tensor, forced: int) -> dict:
    """What SGLang returns for a greedy step on already-processed logits (log_softmax of them)."""
    lp = torch.log_softmax(logits, dim=-1)
    assert int(lp.argmax()) == forced
    return {
        "output_token_logprobs": [[float(lp[forced]), forced, None]],
        "output_token_ids_logprobs": [[[float(lp[c]), c, None] for c in CARRIER_IDS]],
    }


@pytest.mark.parametrize("forced", [0, 1, 7, 31])
def test_carrier_recovers_the_models_own_logprob(forced):
    g = torch.Generator().manual_seed(forced)
    logits = torch.randn(2, 32, generator=g) * 4
    want = torch.log_softmax(logits[1], dim=-1)
    req = SimpleNamespace(output_ids=[5, 6])  # third output token
    params = [{}, {"force_ids": [5, 6, forced], "__req__": req}]
    out = ForceTokensScored()(logits.clone(), params)
    ((lp, is_argmax),) = decode_scores(_meta_from_processed(out[1], forced), [forced])
    assert lp == pytest.approx(float(want[forced]), abs=1e-5)
    assert is_argmax == (int(want.argmax()) == forced)


def test_decode_scores_rejects_unforced_output():
    meta = {"output_token_logprobs": [[-0.1, 9, None]], "output_token_ids_logprobs": [[[-3.0, 0, None]]]}
    with pytest.raises(ValueError, match="not the forced"):
        decode_scores(meta, [8])


def test_needle_prompt_size_depth_and_answer(tokenizer):
    from harness.texts import needle_prompt

    case = needle_prompt(tokenizer, "python_docs", 1000, 0.25, "fact", 3)
    assert abs(case.n_tokens - 1000) <= 10
    assert case.n_tokens == len(tokenizer.encode(case.prompt))
    body = case.prompt.split("Document:\n", 1)[1].split("\n\nQuestion:", 1)[0]
    words_before = len(body[: body.index(case.answer)].split())  # the statement sits at 25% of the words
    assert 0.2 < words_before / len(body.split()) < 0.3
    assert case.found(f" {case.answer}.") and not case.found(f" {case.answer}son")
    key = needle_prompt(tokenizer, "python_docs", 1000, 0.5, "passkey", 3)
    assert key.answer.isdigit() and len(key.answer) == 5 and key.prompt.endswith("The pass key is")


def test_prediction_variants_are_parsed_and_checked_by_the_preset_schema():
    from bench.prediction import parse_variants, variant_label

    assert parse_variants("default,d3=prefetch.depth:3,"
                          "both=prefetch.depth:3/experimental.select:inline") == {
        "default": {},
        "d3": {"prefetch.depth": 3},
        "both": {"prefetch.depth": 3, "experimental.select": "inline"},
    }  # fmt: skip
    assert variant_label("spec_host+dual_token", "d3") == "spec_host+dual_token[d3]"
    assert variant_label("recency", "default") == "recency"
    for bad, needle in [("d99=prefetch.depth:99", "prefetch.depth"),
                        ("x=experimental.select:sometimes", "experimental.select"),
                        ("x=depth:2", "SECTION.KEY=VALUE"), ("x=experimental.branches:2", "unknown key 'experimental.branches'"),
                        ("x=nokey", "not SECTION.KEY:value"), ("default=prefetch.depth:2", "bad item"),
                        ("b=", "bad item"), ("a=prefetch.depth:2,a=prefetch.depth:1", "bad item"),
                        ("x=prefetch.typo:1", "typo")]:  # fmt: skip
        with pytest.raises(ValueError, match=needle):
            parse_variants(bad)


def test_steady_decode_counts_the_fullest_batch_and_skips_prefill_stalls():
    # two waves of two requests (dense at a budget for 2): 0.1 s a token, a 5 s prefill between waves
    wave = [0.0 + 0.1 * i for i in range(11)]
    later = [6.0 + 0.1 * i for i in range(11)]
    r = steady_decode([wave, wave, later, later])
    assert r["steady_concurrency"] == 2
    assert r["steady_gap_seconds"] == pytest.approx(0.1)
    assert r["steady_decode_tokens_per_second"] == pytest.approx(20.0)
    # staggered first tokens (prefills one after another) then 4 at once, 0.2 s a step: the gaps
    # that hold a prefill (1 s) end before all 4 decode, or are rare, and the median ignores them
    staggered = [[s] + [3.0 + 0.2 * i for i in range(20)] for s in (0.0, 1.0, 2.0, 2.9)]
    r = steady_decode(staggered)
    assert r["steady_concurrency"] == 4
    assert r["steady_decode_tokens_per_second"] == pytest.approx(20.0)
    with pytest.raises(ValueError, match="two tokens"):
        steady_decode([[1.0], []])


def test_fidelity_summary_counts_trials_lost_against_oracle():
    from bench.report import fidelity_summary, lost_vs_oracle

    def rec(config, trial, found):
        return {"part": "retrieval", "context": 2000, "fraction": 8, "config": config, "trial": trial, "found": found}

    records = [rec("oracle", 0, True), rec("oracle", 1, True), rec("oracle", 2, False),
               rec("default", 0, False), rec("default", 1, True), rec("default", 2, True)]  # fmt: skip
    cell = lambda c, f, nll: {"context": 2000, "fraction": 8, "config": c,  # noqa: E731
                              "retrieval": {"found": f, "trials": 3}, "nll": {"ratio_to_dense": nll}}
    res = {"settings": {"configs": ["oracle", "default"], "contexts": [2000], "fractions": [8]},
           "dense": [{"context": 2000, "retrieval": {"found": 2, "trials": 3}}],
           "cells": [cell("oracle", 2, 1.0012), cell("default", 2, 1.0049)], "records": records}  # fmt: skip
    assert lost_vs_oracle(res, "default", 2000, 8) == [0]  # trial 2: found where oracle missed, not a loss
    assert fidelity_summary(res).splitlines()[2] == "| 2,000 | 250 (1/8) | 2/3 | 2/3, 1.001 | 2/3, 1.005 | 1 |"


def test_capacity_backend_spec_names_the_flag():
    assert backend_spec("torch_native") == ("torch_native", "", False)
    assert backend_spec("torch_native:room") == ("torch_native", "", True)
    assert backend_spec("dualdecoder+host_sync") == ("dualdecoder", "host_sync", False)
    for bad in ("", ":room", "torch_native:big"):
        with pytest.raises(ValueError, match="--backends"):
            backend_spec(bad)


def test_capacity_rounds_get_fresh_prompts():
    tok = SimpleNamespace(encode=str.split)  # one token per word
    args = SimpleNamespace(requests=3, prompt_tokens=300)
    r0, r1 = round_prompts(tok, 0, args), round_prompts(tok, 1, args)
    keys = [k for _, _, k in r0 + r1]
    assert len(set(keys)) == 6  # a fresh passkey per request and round
    assert r0[0][2] == 10000 + 7919 % 90000  # round 0 = the single-pass run's prompts
    assert all(str(k) in p for p, _, k in r0 + r1)
    opening = len("<|im_start|>user\nCase 1.0. ")
    # no two prompts open alike: nothing is served from the radix cache of another round
    assert len({p[:opening] for p, _, _ in r0 + r1}) == 6


def test_capacity_ratios_are_per_round_medians():
    def rnd(steady, out):
        return {"steady_decode_tokens_per_second": steady, "output_tokens_per_second": out}

    runs = {
        "torch_native": {"rounds": [rnd(10, 5), rnd(12, 6), rnd(8, 4)]},
        "dualdecoder": {"rounds": [rnd(40, 10), rnd(60, 12), rnd(30, 12)]},
    }
    r = ratios(runs)
    # per round steady 4.0, 5.0, 3.75 -> median 4.0; whole run 2.0, 2.0, 3.0 -> 2.0
    assert r["steady_decode_dualdecoder_over_dense_same_budget_rounds"] == [4.0, 5.0, 3.75]
    assert r["steady_decode_dualdecoder_over_dense_same_budget"] == 4.0
    assert r["dualdecoder_over_dense_same_budget"] == 2.0
    assert "dualdecoder_over_dense_with_room" not in r
    single = ratios({"torch_native": rnd(10, 5), "dualdecoder": rnd(35, 10), "torch_native:room": rnd(20, 8)})
    assert single["steady_decode_dualdecoder_over_dense_same_budget"] == 3.5
    assert single["dualdecoder_over_dense_with_room"] == 1.25


def test_fidelity_refuses_a_bad_preset_key_before_starting_a_server(capsys):
    """``bench.fidelity --set`` is checked against the preset schema first (no server, exit 2), naming the key."""
    from bench import fidelity

    for bad, msg in (("prefetch.rerank=0.5", "key 'prefetch.rerank': Input should be greater than or equal to 1"),
                     ("prefetch.bogus=1", "unknown key 'prefetch.bogus'"),
                     ("prefetch.kernel=torch", "unknown key 'prefetch.kernel'"),
                     ("experimental.kernel=cuda", "key 'experimental.kernel'"),
                     ("nonsense", "--set takes SECTION.KEY=VALUE"), ("rerank=4", "--set takes SECTION.KEY=VALUE")):  # fmt: skip
        with pytest.raises(SystemExit) as ex:
            fidelity.main(["--quick", "--set", bad, "--out", "/dev/null"])
        assert ex.value.code == 2 and msg in capsys.readouterr().err


def test_set_overrides_are_dotted_preset_keys_on_the_bench_preset():
    """``--set SECTION.KEY=VALUE`` (``harness.client.parse_sets``): YAML values, applied to the benchmarks' preset,
    which lets requests set the experiment switches they compare."""
    from dd_sglang.config import parse_config
    from harness.client import parse_sets, preset_dict

    sets = parse_sets(["prefetch.rerank=4", "experimental.kernel=torch", "experimental.n_keep=8"])
    assert sets == {"prefetch.rerank": 4, "experimental.kernel": "torch", "experimental.n_keep": 8}
    cfg = parse_config(preset_dict(sets=sets))
    assert (cfg.prefetch.rerank, cfg.experimental.kernel, cfg.experimental.n_keep) == (4, "torch", 8)
    base = parse_config(preset_dict())
    assert base.prefetch.hit_rate_sample == 1.0
    with pytest.raises(ValueError, match="each key once"):
        parse_sets(["prefetch.rerank=4", "prefetch.rerank=2"])


def test_bench_ruler_downloads_nothing(monkeypatch):
    """bench.ruler's tasks are generated offline: none is an essay task (whose haystack is a Hugging Face
    dataset), and lm-eval's import-time ``nltk.download("punkt_tab")`` is skipped without a connection."""
    import urllib.request

    import nltk

    from bench.ruler import TASKS, no_nltk_downloads

    assert not {"niah_single_2", "niah_single_3", "niah_multikey_1"} & set(TASKS)

    def no_network(*args, **kwargs):
        raise AssertionError(f"bench.ruler reached the network: {args[:1]}")

    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    monkeypatch.setattr(nltk, "download", nltk.download)  # restored after the test
    no_nltk_downloads()
    assert nltk.download("punkt_tab") is False


def test_ruler_spec_generates_the_first_samples_of_lm_evals_own_task(model_path, monkeypatch):
    """bench.ruler's niah_single_1 calls lm-eval's generator with that task's own arguments but
    ``num_samples``, and its samples are lm-eval's first ones, field for field. (lm-eval's 500 cost
    ~20 s here: its call is cut to 2 samples too, and the arguments of both calls compared.)"""
    import nltk

    from bench.ruler import niah_single_1_spec, no_nltk_downloads

    monkeypatch.setattr(nltk, "download", nltk.download)  # restored after the test
    no_nltk_downloads()
    from lm_eval.tasks.ruler import niah_utils

    real, calls = niah_utils.generate_samples, []

    def recording(haystack, **kw):
        calls.append(dict(kw))
        return real(haystack, **{**kw, "num_samples": 2})

    monkeypatch.setattr(niah_utils, "generate_samples", recording)
    meta = {"max_seq_lengths": [384], "tokenizer": str(model_path), "pretrained": str(model_path)}
    # The generator draws from Python's global random, which simple_evaluate seeds (random_seed=0).
    random.seed(0)
    ours = niah_single_1_spec(2)["custom_dataset"](**dict(meta))["test"]
    random.seed(0)
    theirs = niah_utils.niah_single_1(**dict(meta))["test"]
    assert len(ours) == len(theirs) == 2
    assert [ours[i] for i in range(2)] == [theirs[i] for i in range(2)]
    mine, lm_evals = ({k: v for k, v in c.items() if k not in ("num_samples", "TOKENIZER")} for c in calls)
    assert mine == lm_evals and calls[0]["num_samples"] == 2 and calls[1]["num_samples"] == 500
    assert niah_single_1_spec(2)["task"] == "niah_single_1"


def _run(out: float, decode: float, steady: float) -> dict:
    return {"output_tokens_per_second": out, "decode_tokens_per_second": decode,
            "steady_decode_tokens_per_second": steady}  # fmt: skip


def test_concurrency_ratios_and_goals_by_hand():
    from bench.concurrency import goals, level_ratios

    runs = {"sparse": _run(48.0, 57.4, 60.0), "dense_same_pool": _run(16.0, 19.5, 20.0),
            "dense_room": _run(24.0, 35.0, 36.0), "ceiling": _run(90.0, 120.0, 125.0)}  # fmt: skip
    r = level_ratios(runs)
    assert r["sparse_over_dense_same_pool"] == 3.0 and r["sparse_over_dense_room"] == 2.0
    assert r["sparse_over_dense_same_pool_decode"] == pytest.approx(2.944, abs=1e-3)
    assert r["ceiling_fraction"] == 0.48 and r["ceiling_fraction_decode"] == pytest.approx(0.478, abs=1e-3)
    g = goals([{"requests": 8, "ratios": r}, {"requests": 3, "ratios": r}])
    assert g == {"ceiling_fraction_at_8": {"goal": 0.8, "measured": 0.48, "met": False},
                 "same_pool_output_at_8": {"goal": 4.0, "measured": 3.0, "met": False}}  # fmt: skip


@pytest.mark.parametrize("argv,needle", [
    (["--levels", "1,0"], "--levels must name distinct integers in [1, 64]"),
    (["--levels", "2,2"], "--levels must name distinct integers in [1, 64]"),
    (["--levels", "a"], "--levels must be comma-separated integers"),
    (["--new-tokens", "1"], "--new-tokens must be in [2, 4096], got 1"),
    (["--ceiling-tokens", "199"], "--ceiling-tokens must be in [200, 4096], got 199"),
    (["--dense-dtype", "float16"], "argument --dense-dtype: invalid choice: 'float16'"),
])  # fmt: skip
def test_concurrency_refuses_bad_flags_before_starting_a_server(argv, needle, capsys):
    from bench.concurrency import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2 and needle in capsys.readouterr().err


def test_concurrency_dense_dtype_from_the_measurement_of_this_host(tmp_path):
    """``--dense-dtype auto``: the dtype bench.dtype_cpu measured decoding faster, only for the host it ran on."""
    from bench.concurrency import measured_dtypes

    here = {"host_class": "amd_epyc_cpu", "cpu_flags": ["avx512_bf16", "avx512f"]}
    result = {"float32_over_bfloat16": {"decode_4k": 1.69, "decode_4k_batch_8": 0.9, "decode_short": 0.86},
              "provenance": {"machine": {"host_class": "amd_epyc_cpu", "cpu_flags": ["avx512f", "avx512_bf16"]}}}  # fmt: skip
    path = tmp_path / "dtype_cpu.json"
    path.write_text(json.dumps(result))
    dtypes, source = measured_dtypes(path, here)
    assert dtypes == {"long": "bfloat16", "short": "bfloat16"}  # the batch's ratio decides, not one request's
    assert "0.90x (decode_4k_batch_8)" in source
    result["float32_over_bfloat16"]["decode_4k_batch_8"] = 1.55
    path.write_text(json.dumps(result))
    assert measured_dtypes(path, here)[0] == {"long": "float32", "short": "bfloat16"}
    other = {"host_class": "amd_epyc_cpu", "cpu_flags": ["avx512f"]}  # no native bf16: not the same host
    assert measured_dtypes(path, other)[0] == {}
    assert measured_dtypes(tmp_path / "missing.json", here) == ({}, "no bench.dtype_cpu measurement to read "
                                                                    "(missing.json: FileNotFoundError)")  # fmt: skip


def test_concurrency_server_dtypes_say_where_each_came_from(monkeypatch):
    """The sparse server keeps the launcher's dtype; a dtype given on the command line wins over the
    measurement, and the JSON's ``dtype_choice`` says which flag was given."""
    import bench.concurrency as bc

    monkeypatch.setattr(bc, "measured_dtypes", lambda: ({"long": "float32", "short": "bfloat16"}, "measured"))
    dtypes, source = bc.server_dtypes(bc.parse_args(["--ceiling-dtype", "float32"]))
    assert dtypes == {"dense_same_pool": "float32", "sparse": None, "dense_room": "float32", "ceiling": "float32"}
    assert source == "measured; --ceiling-dtype float32 as given"
    monkeypatch.setattr(bc, "measured_dtypes", lambda: ({}, "no measurement"))
    dtypes, source = bc.server_dtypes(bc.parse_args([]))
    assert set(dtypes.values()) == {None} and source == "no measurement; auto fell back to the launcher's choice"


def test_context_goals_and_pool_by_hand():
    """``bench.context``: the step growth reads the single-request cells' steady gaps (32k over 4k),
    the speed-up the 32k cell's sparse over dense steady rate; the dense pool holds the largest cell."""
    from bench.context import dense_pool, goals

    def cell(n, length, dense_gap, sparse_gap):
        runs = {name: {"steady_gap_seconds": g, "steady_decode_tokens_per_second": n / g}
                for name, g in (("dense", dense_gap), ("sparse", sparse_gap))}  # fmt: skip
        return {"requests": n, "target_tokens": length, "runs": runs, "sparse_over_dense": round(dense_gap / sparse_gap, 3)}

    cells = [cell(1, 4000, 0.08, 0.07), cell(1, 32000, 0.64, 0.091), cell(8, 4000, 0.3, 0.1)]
    g = goals(cells)
    assert g["sparse_step_32000_over_4000"] == 1.3 and g["dense_step_32000_over_4000"] == 8.0
    assert g["sparse_step_growth"] == {"goal": 1.25, "measured": 1.3, "met": False}
    assert g["speedup_at_32000"] == {"goal": 8.0, "measured": 7.033, "met": False}
    assert dense_pool([(1, 32000), (8, 16000)], 64) == 8 * (16000 + 64 + 256) + 512


def test_ruler_extension_runs_the_next_samples_of_the_same_generated_set(model_path):
    """``--extend`` / ``--doc-ids``: samples picked by index (lm-eval's ``samples`` indices; ``--extend``
    picks the next ones, ``first`` .. ``first + n - 1``) are those samples of a run of the first 4
    (lm-eval's ``limit``), prompts and targets field for field, and their doc ids are their places in the set."""
    from lm_eval.api.model import LM

    from bench.ruler import run_task

    prompts = {}

    class Recording:
        current = "dense"

        def __init__(self):
            def generate(lm, reqs, disable_tqdm=False):
                prompts.setdefault(self.key, []).extend(r.args[0] for r in reqs)
                return ["" for _ in reqs]

            self.lm = type("Rec", (LM,), {"generate_until": generate, "loglikelihood": None,
                                          "loglikelihood_rolling": None})()  # fmt: skip

    rec = Recording()
    rec.key = "all"
    whole = run_task(rec, str(model_path), "niah_single_1", 384, 4, "dense", 8)
    rec.key = "picked"  # --doc-ids 1,3 (each lm-eval call costs seconds: two calls in all)
    picked = run_task(rec, str(model_path), "niah_single_1", 384, 2, "dense", 8, ids=[1, 3])
    assert [r["doc_id"] for r in whole] == [0, 1, 2, 3] and [r["doc_id"] for r in picked] == [1, 3]
    assert [r["target"] for r in picked] == [whole[1]["target"], whole[3]["target"]]
    assert prompts["picked"] == [prompts["all"][1], prompts["all"][3]]
    assert len(set(map(str, (r["target"] for r in whole)))) == 4  # distinct needles: the comparison can fail


def test_ruler_extend_refuses_a_result_it_cannot_grow(tmp_path, capsys):
    from bench.ruler import main

    prior = {"task": "niah_single_1", "preset": "cpu-smollm2", "max_gen_toks": 24, "samples": 2, "command": "c",
             "per_sample": {"4096": {"dense": [{"doc_id": 0, "score": 1.0}, {"doc_id": 1, "score": 0.0}],
                                     "default": [{"doc_id": 0, "score": 1.0}]}}}  # fmt: skip
    path = tmp_path / "r.json"
    path.write_text(json.dumps(prior))
    cases = [(["--configs", "dense,default"], "different sample counts [1, 2]"),
             (["--configs", "dense", "--samples", "2"], "already holds 2 samples per cell"),
             (["--configs", "dense,spec_host"], "no per-sample answers for length 4096, configuration spec_host"),
             (["--configs", "dense", "--max-gen-toks", "48"], "has max_gen_toks 24, this run 48"),
             (["--configs", "dense", "--doc-ids", "1,2"], "without --extend")]  # fmt: skip
    for extra, needle in cases:
        with pytest.raises(SystemExit) as e:
            main(["--lengths", "4096", "--max-gen-toks", "24", "--samples", "5", "--extend", str(path), *extra])
        assert e.value.code == 2 and needle in capsys.readouterr().err, extra


def test_select_recall_emulation_reranking_everything_is_the_exact_top_k():
    """``bench.select_recall``'s emulated arms: when every candidate is re-ranked exactly (m = C), the
    pipeline returns the exact top-k of the float keys whatever the index's bits (its approximate
    normaliser then covers nothing), computed here as a plain softmax over all candidates."""
    from bench.select_recall import _emulated

    g = torch.Generator().manual_seed(3)
    q, keys = torch.randn(3, 3, 64, generator=g), torch.randn(300, 3, 64, generator=g)
    a = torch.einsum("hgd,chd->hgc", q, keys) / 8
    ref = (a - a.logsumexp(-1, keepdim=True)).amax(1).topk(32).indices
    for bits in (2, 4, 8):
        got = _emulated(q, keys, bits, 300, 32)
        assert [sorted(x) for x in got.tolist()] == [sorted(x) for x in ref.tolist()]


def test_select_recall_emulation_at_8_bits_chooses_what_the_c_kernel_chooses():
    """At 8 bits the emulation (plain PyTorch in the bench) and the CPU preset's C kernel choose the
    same 32 of 1,000 candidates per KV head on random keys with a shared offset (64 re-ranked)."""
    from bench.select_recall import _emulated
    from dd_sglang.kernels import native
    from dd_sglang.prefetch.index import QuantKeyIndex
    from dd_sglang.prefetch.scoring import row_blocks

    if not native.available():
        pytest.skip(f"no CPU selection kernel here: {native.unavailable_reason()}")
    g = torch.Generator().manual_seed(5)
    n, hkv, d = 1024, 3, 64
    host_k = (torch.randn(1, n, hkv, d, generator=g) + torch.randn(1, 1, hkv, d, generator=g)).to(torch.bfloat16)
    q = torch.randn(1, 1, hkv * 3, d, generator=g)
    idx = QuantKeyIndex(host_k, native=True)
    slots = torch.arange(n)
    idx.update(slots, 0, n)
    rows = row_blocks([slots], [0], [n], [torch.arange(0)])
    got = native.spec_host_select(q, *rows.tokens, idx.q8, idx.scale, host_k, 32, 64, d**-0.5)[0][0, 0]
    mine = _emulated(q[0, 0].view(hkv, 3, d), host_k[0].float(), 8, 64, 32)
    assert [sorted(x) for x in got.tolist()] == [sorted(x) for x in mine.tolist()]
