"""The ``pressure`` path policy end to end, on the package's ``dualdecoder`` server.

No server of its own: the policy is chosen per request (``custom_params.dd_policy: pressure``), so
these tests share ``dd_server`` (the preset's ``always`` policy, a 4,200-token device pool that holds
two ~2k requests densely, not three) and compare with the session's dense ``server``. Checked:

* low load: long requests under ``pressure`` stay dense and answer token for token as dense SGLang
  does: one ~2k request alone, then three ~1.25k ones at once (the pool holds all three; issue 40's
  "one to three ~4k requests in a 16,000-token pool", at this server's scale);
* under load: 4 such requests, more than the pool holds densely, are all admitted at once, some
  offloaded with reason ``pressure``, each still finds its pass key;
* aborts during that load leave the device and host accounting at the idle baseline.
"""

from __future__ import annotations

import re
import threading

import httpx
import pytest

from harness.prompts import passkey_prompt
from harness.server import delta, flush_when_idle, scrape, wait_idle

from .conftest import CAP
from .fanout import assert_back_at_baseline, run_at_once, run_at_once_sampled

pytestmark = pytest.mark.server
PROMPT_TARGET = 2100  # passkey_prompt size target: ~1,980 tokens (past min_sparse_len 1,024)
LOW_LOAD_TARGET = 1360  # passkey_prompt size target: ~1,250 tokens
LOW_LOAD_TOKENS = 24
PRESSURE = {"dd_policy": "pressure"}
SPARSE_PRESSURE = 'dd_dualpath_path_changes_total{reason="pressure"}'
CHANGES = ("length", "pressure", "request")


def complete(srv, prompt: str, max_tokens: int, custom: dict | None = None, **body) -> dict:
    payload = {"model": "x", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **body}
    if custom is not None:
        payload["custom_params"] = custom
    r = httpx.post(f"{srv.url}/v1/completions", json=payload, timeout=900)
    assert r.status_code == 200, r.text
    return r.json()


def path_changes(samples: dict[str, float]) -> dict[str, float]:
    return {r: samples.get(f'dd_dualpath_path_changes_total{{reason="{r}"}}', 0.0) for r in CHANGES}


def at_once(srv, prompts: list[tuple[str, int]], custom: dict | None) -> list[dict | None]:
    """Each prompt as its own greedy request (``LOW_LOAD_TOKENS``, ``ignore_eos``), all sent at once."""
    return run_at_once([lambda p=p: complete(srv, p, LOW_LOAD_TOKENS, custom, ignore_eos=True) for p, _ in prompts])


def offloads(samples: dict[str, float]) -> dict[str, float]:
    """``dd_pressure_offloads_total`` per trigger (its label sets exist at 0 from start-up)."""
    out = {k: v for k, v in samples.items() if k.startswith("dd_pressure_offloads_total{")}
    assert out, "no dd_pressure_offloads_total series on the sidecar"
    return out


def admitted(samples: dict[str, float]) -> int:
    return int(sum(v for k, v in samples.items() if k.startswith("dd_dualpath_requests{") and "FINISHED" not in k))


@pytest.fixture(scope="module")
def low_load_prompts(tokenizer):
    """3 distinct ~1.25k passkey prompts (past ``min_sparse_len`` 1,024; the pool holds all three)."""
    return [passkey_prompt(tokenizer, LOW_LOAD_TARGET, d, 52000 + 613 * i, header=f"Low load {i}. ")
            for i, d in enumerate((0.25, 0.5, 0.75))]  # fmt: skip


@pytest.fixture(scope="module")
def prompts(tokenizer):
    """4 distinct ~2k passkey prompts with their keys."""
    keys = [61000 + 7919 * i for i in range(4)]
    return [(passkey_prompt(tokenizer, PROMPT_TARGET, d, k, header=f"Pressure {i}. ")[0], k)
            for i, (d, k) in enumerate(zip((0.2, 0.4, 0.6, 0.8), keys, strict=True))]  # fmt: skip


def test_low_load_pressure_requests_stay_dense_and_match_dense_tokens(dd_server, server, prompts, low_load_prompts):
    """One ~2k request alone, then three ~1.25k ones at once (the pool holds all three densely): no
    path change, no sparse row, no pressure offload, and each answer equals the dense server's for the same
    prompts sent at once, token for token (caches flushed first: a prefix cached on one server only would split the
    prefill differently)."""
    n = [m for _, m in low_load_prompts]
    assert min(n) > 1024 and 3 * (max(n) + LOW_LOAD_TOKENS) <= CAP, ("three must fit the pool densely", n)
    flush_when_idle(dd_server)
    flush_when_idle(server)
    before = scrape(dd_server.metrics_url)
    got = complete(dd_server, prompts[0][0], 32, PRESSURE)
    want = complete(server, prompts[0][0], 32)
    assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    flush_when_idle(dd_server)
    flush_when_idle(server)
    results = at_once(dd_server, low_load_prompts, PRESSURE)
    after = scrape(dd_server.metrics_url)
    for body, want in zip(results, at_once(server, low_load_prompts, None), strict=True):
        assert body["usage"]["completion_tokens"] == want["usage"]["completion_tokens"] == LOW_LOAD_TOKENS
        assert body["choices"][0]["text"] == want["choices"][0]["text"]
    assert path_changes(after) == path_changes(before), "a low-load pressure request changed path"
    assert delta(after, before, "dd_sparse_decode_rows_total") == 0
    assert offloads(after) == offloads(before)


def test_under_load_all_are_admitted_and_some_go_sparse_for_pressure(dd_server, prompts):
    """4 ~2k pressure requests (max_tokens 64, ignore_eos) in a pool that holds 2 densely: all 4 are
    admitted at once (sampled from the sidecar), 2 to 4 change path with reason ``pressure`` (the
    first two fill the pool; the next one's admission makes every long request there sparse, itself
    included after its prefill, depending on when each arrives), none for ``length``,
    every answer starts with its pass key, and accounting is back at the idle baseline after."""
    base = flush_when_idle(dd_server)
    assert base["dd_device_kv_used_bytes"] == 0 and base["dd_host_tier_used_bytes"] == 0
    results, samples = run_at_once_sampled(
        dd_server, [lambda p=p: complete(dd_server, p, 64, PRESSURE, ignore_eos=True) for p, _ in prompts]
    )
    for (_, key), body in zip(prompts, results, strict=True):
        assert body is not None and body["usage"]["completion_tokens"] == 64
        assert re.match(rf"\s*{key}\b", body["choices"][0]["text"]), (key, body["choices"][0]["text"])
    n = [body["usage"]["prompt_tokens"] for body in results]
    assert 2 * (max(n) + 64) <= CAP < 3 * min(n), ("the pool must hold exactly 2 dense requests", n)
    after = wait_idle(dd_server)
    changes = {r: after_n - before_n for (r, after_n), before_n in
               zip(path_changes(after).items(), path_changes(base).values(), strict=True)}  # fmt: skip
    assert 2 <= changes["pressure"] <= 4 and changes["length"] == 0, changes
    assert delta(after, base, 'dd_pressure_offloads_total{trigger="admission"}') >= 2
    assert max(admitted(s) for s in samples) == 4, "the 4 requests were never admitted at once"
    assert_back_at_baseline(dd_server, after, base)


def test_aborts_during_pressure_offloads_leave_accounting_at_baseline(dd_server, prompts):
    """2 pressure requests streamed and closed after 3 tokens while 2 more arrive (their admission
    offloads running ones): every stream ends, and the device and host tiers return to baseline."""
    base = flush_when_idle(dd_server)
    codes: list[int] = []

    def aborted(i):
        with httpx.stream("POST", f"{dd_server.url}/v1/completions", timeout=600,
                          json={"model": "x", "prompt": prompts[i][0], "max_tokens": 400, "temperature": 0,
                                "stream": True, "ignore_eos": True, "custom_params": PRESSURE}) as r:  # fmt: skip
            for n, _ in enumerate((ln for ln in r.iter_lines() if ln.startswith("data: {")), 1):
                if n >= 3:
                    break  # client disconnects mid-stream; SGLang aborts the request
        codes.append(-1)

    def normal(i):
        codes.append(complete(dd_server, prompts[i][0], 32, PRESSURE, ignore_eos=True)["usage"]["completion_tokens"])

    threads = [threading.Thread(target=aborted, args=(0,)), threading.Thread(target=aborted, args=(1,)),
               threading.Thread(target=normal, args=(2,)), threading.Thread(target=normal, args=(3,))]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(codes) == [-1, -1, 32, 32]
    assert_back_at_baseline(dd_server, wait_idle(dd_server), base)
