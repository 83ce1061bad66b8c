"""``bench.soak`` without a server (its growth fit, flags and process roles) and the launcher's
bound on the oneDNN caches (issue 44)."""

from __future__ import annotations

import pytest

from bench import soak
from dd_sglang.platform import ONEDNN_CACHE_CAPACITY, ONEDNN_CACHE_ENVS, bounded_cache_env
from harness.server import ROLES

MiB = 1024**2


def test_bounded_cache_env_sets_both_caps_and_keeps_the_users():
    assert bounded_cache_env({}) == dict.fromkeys(ONEDNN_CACHE_ENVS, str(ONEDNN_CACHE_CAPACITY))
    assert bounded_cache_env({"LRU_CACHE_CAPACITY": "1024"}) == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "256"}
    assert bounded_cache_env(dict.fromkeys(ONEDNN_CACHE_ENVS, "8")) == {}


def _row(n: int, scheduler_mib: float) -> dict:
    rss = dict.fromkeys(ROLES, 100 * MiB) | {"scheduler": int(scheduler_mib * MiB)}
    return {"requests": n, "rss": rss, "rss_anon": rss}


def test_growth_fits_after_the_warmup_only():
    # 1.5 MiB a request for the first 500, then 0.02 MiB a request
    rows = [_row(n, 1000 + 1.5 * min(n, 500) + 0.02 * max(0, n - 500)) for n in range(0, 2001, 100)]
    g = soak.growth(rows, 500)["rss"]
    assert g["scheduler"] == pytest.approx(20.0, abs=0.1) and g["total"] == pytest.approx(20.0, abs=0.1)
    assert g["launcher"] == 0.0
    assert soak.growth(rows[:3], 500)["rss"]["total"] is None  # no sample from 500 on


def test_fit_slope():
    assert soak.fit_slope([0, 1, 2], [1, 3, 5]) == pytest.approx(2.0)
    assert soak.fit_slope([1], [1]) is None and soak.fit_slope([2, 2], [1, 3]) is None


@pytest.mark.parametrize("argv, needle", [
    (["--requests", "0"], "--requests must be in"),
    (["--clients", "100"], "--clients must be in"),
    (["--words", "900", "500"], "--words must be MIN MAX"),
    (["--env", "NOVALUE"], "--env must be NAME=VALUE"),
    (["--backend", "sparse"], "--backend"),
    (["--tokens", "6000", "100"], "--tokens must be MIN MAX"),
    (["--tokens", "100", "6000"], "--max-total-tokens - --new-tokens = 5984"),
])  # fmt: skip
def test_bad_flags_are_named(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        soak.parse_args(argv)
    assert exc.value.code == 2 and needle in capsys.readouterr().err


def test_defaults_follow_the_issue():
    a = soak.parse_args([])
    assert (a.backend, a.requests, a.clients, a.max_total_tokens, a.chunked_prefill_size, a.host_tier_mb) == (
        "dualdecoder", 2000, 4, 6000, 256, 300)
    assert tuple(a.words) == (500, 900) and str(a.out).startswith("bench/results/soak_dualdecoder_")
    assert a.plot == a.out.with_suffix(".png")


def test_prompt_words_stay_in_range():
    import random

    words = [f"w{i}" for i in range(5000)]
    rng = random.Random(0)
    for _ in range(50):
        assert 500 <= len(soak.prompt_words(rng, words, 500, 900).split()) <= 900


def test_prompt_tokens_are_uniform_lengths_of_consecutive_ids():
    """Issue 52's mix: lengths uniform in the range (new lengths almost every request), ids cut in order."""
    import random

    ids = list(range(20_000))
    rng = random.Random(0)
    lens = []
    for _ in range(200):
        p = soak.prompt_tokens(rng, ids, 100, 6000)
        assert 100 <= len(p) <= 6000 and p == list(range(p[0], p[0] + len(p)))
        lens.append(len(p))
    assert len(set(lens)) >= 190
