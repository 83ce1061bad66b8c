"""The ``pressure`` path policy end to end, on the package's ``dualdecoder`` server.

No server of its own: the policy is chosen per request (``custom_params.dd_policy: pressure``), so
these tests share ``dd_server`` (the preset's ``always`` policy, a 4,200-token device pool that holds
two ~2k requests densely, not three) and compare with the session's dense ``server``. Checked:

* low load: a long request under ``pressure`` stays dense and answers token for token as dense
  SGLang does, alone and beside a second one (the pool holds both);
* under load: 4 such requests, more than the pool holds densely, are all admitted at once, some
  offloaded with reason ``pressure``, each still finds its pass key;
* aborts during that load leave the device and host accounting at the idle baseline.
"""

from __future__ import annotations

import re
import threading

import httpx
import pytest

from bench.prompts import passkey_prompt
from bench.server import delta, flush_when_idle, scrape, wait_idle

from .conftest import CAP
from .fanout import assert_back_at_baseline, run_at_once_sampled

pytestmark = pytest.mark.server
PROMPT_TARGET = 2100  # passkey_prompt size target: ~1,980 tokens (past min_sparse_len 1,024)
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


def admitted(samples: dict[str, float]) -> int:
    return int(sum(v for k, v in samples.items() if k.startswith("dd_dualpath_requests{") and "FINISHED" not in k))


@pytest.fixture(scope="module")
def prompts(tokenizer):
    """4 distinct ~2k passkey prompts with their keys."""
    keys = [61000 + 7919 * i for i in range(4)]
    return [(passkey_prompt(tokenizer, PROMPT_TARGET, d, k, header=f"Pressure {i}. ")[0], k)
            for i, (d, k) in enumerate(zip((0.2, 0.4, 0.6, 0.8), keys, strict=True))]  # fmt: skip


def test_low_load_pressure_requests_stay_dense_and_match_dense_tokens(dd_server, server, prompts):
    """One alone, then two at once (the pool holds both densely): no path change, no sparse row,
    and each answer equals the dense server's, token for token (caches flushed first: a prefix cached
    on one server only would split the prefill differently)."""
    flush_when_idle(dd_server)
    flush_when_idle(server)
    before = scrape(dd_server.metrics_url)
    for prompt, _ in prompts[:1]:
        got = complete(dd_server, prompt, 32, PRESSURE)
        want = complete(server, prompt, 32)
        assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
    results: list[dict | None] = [None, None]

    def run(i):
        results[i] = complete(dd_server, prompts[2 + i][0], 24, PRESSURE, ignore_eos=True)

    workers = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    for body in results:
        assert body is not None and body["usage"]["completion_tokens"] == 24
    after = scrape(dd_server.metrics_url)
    assert path_changes(after) == path_changes(before), "a low-load pressure request changed path"
    assert delta(after, before, "dd_sparse_decode_rows_total") == 0
    assert delta(after, before, "dd_pressure_offloads_total") == 0


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
