"""End to end: prompts longer than the device pool, prefilled through the host tier (issue 54).

The package's server (``dd_server``: a 4,200-token device pool, SGLang's chunked prefill of 4,096,
context 8,192) would refuse a prompt of 4,194+ tokens with HTTP 400 on its own (SGLang's
``max_req_input_len`` is bounded by the pool). With ``dualdecoder`` such a prompt is admitted one
chunk at a time, each finished chunk moves to the host tier and gives its device slots back
(``Offloader.offload_chunk``), later chunks attend the earlier ones from the host tier exactly, and
the request decodes sparsely. The reference is the session's dense server, whose 12,288-token pool
has room for the whole prompt.
"""

from __future__ import annotations

import re
import time

import httpx
import pytest

from harness.prompts import passkey_prompt
from harness.server import flush_when_idle, scrape, transitions, wait_idle
from tests.reliability.geometry import Sampler, kv_bytes_per_token

from .conftest import CAP
from .fanout import assert_back_at_baseline

pytestmark = pytest.mark.server
PASSKEY = 52817
RESIDENT_BOUND = 4 + 0 + 128 + 64  # n_sink + n_keep + n_recent + page_size (default preset)


@pytest.fixture(scope="module")
def long_prompt(tokenizer):
    """A ~6,000-token passkey prompt: past the 4,200-token pool, inside the 8,192-token context."""
    prompt, n = passkey_prompt(tokenizer, 6200, 0.4, PASSKEY, header="Past the pool. ")
    assert CAP + 1000 < n < 8000
    return prompt, tokenizer.encode(prompt)


def generate(srv, ids: list[int], n: int, custom: dict | None = None) -> list[int]:
    sampling = {"max_new_tokens": n, "temperature": 0, **({"custom_params": custom} if custom else {})}
    body = {"input_ids": ids, "sampling_params": sampling}
    r = httpx.post(f"{srv.url}/generate", json=body, timeout=900)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def held_between_batches(sample: dict[str, float]) -> float:
    """Device KV bytes held (not evictable) in one sidecar scrape: the gauge is refreshed after each
    batch, so this is what is held between batches."""
    return sample.get("dd_device_kv_used_bytes", 0.0) - sample.get("dd_device_kv_evictable_bytes", 0.0)


def test_a_prompt_longer_than_the_pool_answers_as_dense_with_room_does(dd_server, server, long_prompt, tokenizer):
    """At ``dd_top_k`` covering the whole context the sparse row attends every token, so the greedy
    tokens equal the dense server's only if every chunk's prefill attended its host-tier prefix
    exactly; at the default ``top_k`` 256 the pass key is still found. Between batches the device
    holds no more than the request's resident set (each chunk's slots went back after its batch),
    and afterwards both tiers are back at baseline."""
    ids = long_prompt[1]
    dense = generate(server, ids, 16)
    assert str(PASSKEY) in tokenizer.decode(dense)
    base = flush_when_idle(dd_server)
    before = scrape(dd_server.metrics_url)
    with Sampler(dd_server) as sampler:
        full = generate(dd_server, ids, 16, {"dd_top_k": 8192})
    assert full == dense
    peak = max(held_between_batches(m) for m in sampler.samples)
    assert 0 < peak <= RESIDENT_BOUND * kv_bytes_per_token(dd_server.kv_itemsize)
    sparse = generate(dd_server, ids, 16)
    assert re.match(rf"\s*{PASSKEY}\b", tokenizer.decode(sparse)), tokenizer.decode(sparse)
    after = wait_idle(dd_server)
    assert transitions(after, "OFFLOADING", "DECODE_SPARSE") - transitions(before, "OFFLOADING", "DECODE_SPARSE") == 2
    assert_back_at_baseline(dd_server, after, base)


def test_a_prompt_past_the_context_is_refused_naming_the_limit(dd_server, tokenizer):
    """The context, not the pool, now bounds a prompt: one past 8,192 tokens gets SGLang's 400 naming
    the limit, and nothing is held afterwards."""
    base = flush_when_idle(dd_server)
    ids = tokenizer.encode("word " * 9000)[:8500]
    r = httpx.post(f"{dd_server.url}/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 4}},
                   timeout=120)  # fmt: skip
    assert r.status_code == 400, r.text
    assert "The input (8500 tokens) is longer than the model's context length (8192 tokens)" in r.text, r.text
    assert_back_at_baseline(dd_server, wait_idle(dd_server), base)


def test_an_abort_during_the_prefill_through_the_host_tier_leaves_both_tiers_at_baseline(dd_server, long_prompt):
    """A client that goes away while the prompt's chunks are being prefilled (before the first
    token): the request is aborted between chunks, its device slots and its host pages are freed."""
    base = flush_when_idle(dd_server)
    body = {"input_ids": long_prompt[1], "sampling_params": {"max_new_tokens": 64, "temperature": 0}, "stream": True}
    with httpx.stream("POST", f"{dd_server.url}/generate", json=body, timeout=900) as r:
        assert r.status_code == 200
        t0 = time.monotonic()
        while time.monotonic() - t0 < 60:  # until the first chunk has gone to the host tier
            if scrape(dd_server.metrics_url).get("dd_host_tier_used_bytes", 0) > 0:
                break
            time.sleep(0.1)
        else:
            pytest.fail("no chunk reached the host tier within 60 s")
    assert_back_at_baseline(dd_server, wait_idle(dd_server), base)


def test_a_prompt_past_the_pool_that_asks_to_stay_dense_is_refused(dd_server, long_prompt):
    """``dd_sparse: false`` would keep the whole prompt on the device, which the pool cannot hold: 400
    naming the field and the pool's bound, nothing admitted."""
    base = flush_when_idle(dd_server)
    r = httpx.post(f"{dd_server.url}/generate", timeout=120, json={
        "input_ids": long_prompt[1], "sampling_params": {"max_new_tokens": 4, "custom_params": {"dd_sparse": False}}})  # fmt: skip
    assert r.status_code == 400, r.text
    assert f"custom_params.dd_sparse: false keeps the whole prompt on the device, whose pool takes prompts below {CAP - 6}" in r.text
    assert_back_at_baseline(dd_server, wait_idle(dd_server), base)
