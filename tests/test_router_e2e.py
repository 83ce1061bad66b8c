"""End to end: two ``dualdecoder`` workers behind SGLang's gateway ``smg`` (``python -m dd_sglang.launch_router``).

One router for this module: two workers (started at once) with device pools
of :data:`CAP` tokens, small enough that two unrelated ~1.5k-token prompts push
a finished ~1.5k-token turn out of a worker's device tier, large enough for a
~3.2k-token second turn to prefill (turns of 1.5k tokens, not 3k: the same
checks at half the prefill work). ``smg`` routes with ``cache_aware``: over
HTTP workers it matches each request's text against an approximate tree of
the text it routed to each worker, so a session's second turn, whose text
extends the first's, returns to the first turn's worker even though that
worker's device no longer holds it; the worker's host tier reloads it
(``REBUILD``) and SGLang reports those tokens as cached.

Which worker served a request is read from each worker's own counter of
finished requests (``sglang:num_requests_total`` on its sidecar); the
requests here are sequential.
"""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest
import yaml

from dd_sglang.launch_router import healthy_workers
from harness.client import post_chat
from harness.gateway import served_by, start_gateway
from harness.prompts import FILLER, INSTRUCTION, passkey_prompt
from harness.server import ROOT, scrape
from tests.servers import stop_behind

pytestmark = pytest.mark.server
CAP = 3584  # device KV pool per worker (tokens)
HOST_TIER_BYTES = 512 * 1024**2  # per worker: 11,650 float32 tokens (the CPU default without bf16)
TURN_TOKENS = 1500  # ~tokens per user turn (above min_sparse_len 1024: turn 1 decodes sparsely)
PASSKEY = 48213
ANSWER = "The pass key is "  # the trailing space: the model then answers with the digits (without it, " the pass key..." in float32)


@pytest.fixture(scope="module")
def gateway(model_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("router")
    preset = yaml.safe_load((ROOT / "configs" / "cpu-smollm2.yaml").read_text())
    preset["sparse"]["host_tier_bytes"] = HOST_TIER_BYTES
    (tmp / "preset.yaml").write_text(yaml.safe_dump(preset))
    worker_args = ["--attention-backend", "dualdecoder", "--enable-cache-report", "--max-total-tokens", str(CAP),
                   "--dd-config", str(tmp / "preset.yaml")]  # fmt: skip
    try:
        gw = start_gateway(tmp / "router.log", worker_args, workers=2)
    except RuntimeError as err:
        pytest.fail(str(err))
    yield gw

    def stop():
        rc, alive = gw.stop()
        return None if rc == 0 and not alive else f"rc={rc} alive={alive}\n{gw.log_tail()}"

    stop_behind("router gateway", stop)


def chat(url: str, messages: list[dict], max_tokens: int, timeout: float = 600.0) -> dict:
    """A greedy chat completion that continues the final (assistant) message."""
    r = post_chat(url, messages, max_tokens, timeout)
    assert r.status_code == 200, r.text
    return r.json()


def filler(tokenizer, n_tokens: int, header: str) -> str:
    """~``n_tokens`` of filler text opened by a distinct ``header``."""
    per = len(tokenizer.encode(FILLER))
    return header + FILLER * max(1, n_tokens // per)


def test_session_returns_to_its_worker_and_reloads_turn_1_from_the_host_tier(gateway, tokenizer):
    gw = gateway
    # Turn 1 (~1.5k tokens): the pass key, deep in filler.
    text1, _ = passkey_prompt(tokenizer, TURN_TOKENS, 0.3, PASSKEY, header="Session 7 about a vault. ")
    user1 = text1.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
    assert INSTRUCTION in user1 and str(PASSKEY) in user1
    turn1 = [{"role": "user", "content": user1}, {"role": "assistant", "content": ANSWER}]
    before = gw.requests_served()
    r1 = chat(gw.url, turn1, 8)
    w = served_by(gw, before)
    n1 = r1["usage"]["prompt_tokens"]
    assert n1 >= TURN_TOKENS - 200, n1
    reply1 = r1["choices"][0]["message"]["content"]
    assert str(PASSKEY) in reply1, reply1

    # Two unrelated ~1.5k-token prompts on the same worker: the second needs the device slots of
    # turn 1's evictable copy, so turn 1 now lives only in that worker's host tier.
    for i in range(2):
        prompt, _ = passkey_prompt(tokenizer, TURN_TOKENS, 0.5, 30000 + i, header=f"Unrelated filler {i}. ")
        r = httpx.post(
            f"{gw.worker_urls[w]}/generate",
            json={"text": prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0}},
            timeout=600,
        )
        assert r.status_code == 200, r.text

    # Turn 2 (~1.5k more tokens), asking about turn 1.
    user2 = filler(tokenizer, TURN_TOKENS, "Now some more text to read. ") + "\nWhat was the pass key?"
    turn2 = turn1[:1] + [
        {"role": "assistant", "content": ANSWER + reply1},
        {"role": "user", "content": user2},
        {"role": "assistant", "content": ANSWER},
    ]
    m_before = scrape(gw.metrics_urls[w])
    before = gw.requests_served()
    r2 = chat(gw.url, turn2, 8)
    assert served_by(gw, before) == w, "turn 2 went to another worker than turn 1"
    m_after = scrape(gw.metrics_urls[w])
    assert r2["usage"]["prompt_tokens"] >= n1 + TURN_TOKENS - 200
    cached = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= n1, (cached, n1)
    rebuilt = m_after.get("dd_host_tier_rebuilt_tokens_total", 0) - m_before.get(
        "dd_host_tier_rebuilt_tokens_total", 0
    )
    assert rebuilt >= n1 - 64, (
        rebuilt
    )  # the device had lost turn 1: it came back from the host tier (page-granular)
    assert str(PASSKEY) in r2["choices"][0]["message"]["content"], r2["choices"][0]["message"]["content"]


def test_killing_a_worker_routes_new_sessions_to_the_other(gateway, tokenizer):
    gw = gateway
    victim, survivor = 1, 0
    gw.kill_worker(victim)
    t0 = time.monotonic()
    # Until two health checks fail (~10 s) smg may still pick the dead worker, and its retries
    # (within ~0.5 s) go to the same one: wait until the gateway has taken it out.
    while healthy_workers(gw.url) != 1 and time.monotonic() - t0 < 60:
        time.sleep(0.5)
    assert healthy_workers(gw.url) == 1, "the gateway still routes to the killed worker after 60 s"
    before = gw.requests_served()[survivor]

    def session(i: int) -> str:
        prompt = filler(tokenizer, 300, f"New session {i} after a worker loss. ") + "\nSay OK."
        r = chat(
            gw.url,
            [{"role": "user", "content": prompt}, {"role": "assistant", "content": "OK"}],
            4,
            timeout=90,
        )
        return r["choices"][0]["finish_reason"]

    # Four new sessions, two at a time; each must finish within its timeout (no request hangs).
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        reasons = list(pool.map(session, range(4)))
    assert all(r in ("length", "stop") for r in reasons), reasons
    assert gw.requests_served()[survivor] - before == 4
    assert time.monotonic() - t0 < 300
    assert gw.proc.poll() is None, "the router must keep serving with one worker"
    deadline = time.monotonic() + 30  # the router notices the worker's launcher exit within a few seconds
    while f"worker {victim} (" not in gw.log_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert f"worker {victim} (" in gw.log_path.read_text() and "routes around it" in gw.log_path.read_text()
