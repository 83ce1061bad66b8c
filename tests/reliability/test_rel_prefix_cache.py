"""Prefix-cache edge cases: fully cached prompts, cached-token counts with ``n > 1``, ``/flush_cache``
right after a request, and prompt logprobs that must not depend on what the cache holds.

SGLang matches at most ``prompt - 1`` cached tokens (the last prompt token is always computed, to
produce the next token's logits), so a fully cached prompt reports ``n - 1`` cached tokens.
"""

from __future__ import annotations

import uuid

import httpx
import pytest

from harness.prompts import passkey_prompt
from harness.server import delta, flush_when_idle, scrape, wait_idle
from tests.dualdecoder.test_fidelity_e2e import BF16_LOGPROB_TOL  # the bound on one token's bf16 rounding

pytestmark = pytest.mark.server


def generate(srv, ids: list[int], n: int, **extra) -> dict:
    sp = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    r = srv.post("/generate", {"input_ids": ids, "sampling_params": sp, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_fully_cached_prompt_with_max_tokens_1(rel_server, tokenizer):
    """The same ~1,100-token prompt with max_tokens=1: cold, warm (device radix cache), and after a
    host-tier round trip (its device copy evicted, its host pages reloaded: REBUILD). Each time the one
    token equals a fresh prefill's (a new ``extra_key``: no cache shared with these requests) and the
    cached-token count is exact."""
    prompt, n = passkey_prompt(tokenizer, 1200, 0.5, 42424, header="Fully cached check. ")
    ids = tokenizer.encode(prompt)
    assert 1024 <= n
    first = generate(rel_server, ids, 1, extra_key=f"reference-{uuid.uuid4().hex}")["output_ids"]
    flush_when_idle(rel_server)
    cold = generate(rel_server, ids, 1)
    assert cold["output_ids"] == first and cold["meta_info"]["cached_tokens"] == 0
    warm = generate(rel_server, ids, 1)
    assert warm["output_ids"] == first and warm["meta_info"]["cached_tokens"] == n - 1
    # A sparse run of the prompt leaves its host pages as a prefix entry; four dense ~1,000-token
    # prompts (below min_sparse_len: no host tier) then push its device copy out of the 4,096-slot pool.
    assert len(generate(rel_server, ids, 8)["output_ids"]) == 8
    for i in range(4):
        filler, m = passkey_prompt(tokenizer, 1000, 0.5, 11000 + i, header=f"Filler {i}. ")
        assert m < 1024
        generate(rel_server, tokenizer.encode(filler), 1)
    before = wait_idle(rel_server)
    assert before["dd_host_tier_prefix_cache_bytes"] > 0
    again = generate(rel_server, ids, 1)
    after = scrape(rel_server.metrics_url)
    rebuilt = delta(after, before, "dd_host_tier_rebuilt_tokens_total")
    assert rebuilt > 0, "the device copy was not evicted: no host-tier round trip happened"
    assert again["output_ids"] == first
    assert again["meta_info"]["cached_tokens"] == n - 1


def completion(srv, prompt: str, **kw) -> dict:
    """Four tokens per choice, EOS ignored: a sampled choice may draw EOS early (CI once saw 7 of 8
    tokens at ``n`` = 2 on another CPU), which would make the token count depend on the machine."""
    body = {"model": "x", "prompt": prompt, "max_tokens": 4, "ignore_eos": True, **kw}
    r = srv.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("n", [2, 4])
def test_cached_token_count_with_n_choices_warm(rel_server, tokenizer, n):
    """``n`` sampled choices of a cached prompt: usage counts the prompt once, and its cached tokens
    are what one request reports (prompt - 1), never multiplied by ``n``."""
    prompt = f"Warm choice check {n}. " + "Describe a quiet harbour at dawn in one sentence. " * 12
    p = len(tokenizer.encode(prompt))
    completion(rel_server, prompt)  # caches the prompt
    warm = completion(rel_server, prompt, n=n, temperature=0.8, seed=n)
    assert len(warm["choices"]) == n
    assert warm["usage"]["prompt_tokens"] == p
    assert warm["usage"]["completion_tokens"] == 4 * n
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == p - 1


@pytest.mark.xfail(
    strict=True,
    reason="SGLang 0.5.23 bug: for n > 1 its tokenizer manager first prefills the prompt alone to cache it, "
    "then runs the n samples, which hit that cache; usage reports prompt - 1 cached tokens for a prompt "
    "nobody sent before (managers/tokenizer_manager.py, _handle_batch_request)",
)
def test_cached_token_count_with_n_choices_cold(rel_server, tokenizer):
    """A prompt nobody sent before, with ``n`` = 3: none of its tokens came from the cache."""
    prompt = "Cold choice check. " + "List three uses of a lighthouse keeper's logbook. " * 12
    p = len(tokenizer.encode(prompt))
    cold = completion(rel_server, prompt, n=3, temperature=0.8, seed=3)
    assert cold["usage"]["prompt_tokens"] == p
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_flush_cache_right_after_a_request(rel_server, tokenizer):
    """``/flush_cache`` sent the moment a response arrives succeeds (the request is gone), and really
    empties both caches: the next identical request reports 0 cached tokens."""
    prompt, n = passkey_prompt(tokenizer, 1200, 0.5, 90210, header="Flush check. ")
    ids = tokenizer.encode(prompt)
    for _ in range(3):
        generate(rel_server, ids, 4)  # sparse: leaves a host prefix entry and a device radix copy
        r = httpx.post(f"{rel_server.url}/flush_cache", headers=rel_server.headers, timeout=30)
        assert r.status_code == 200, r.text
        assert generate(rel_server, ids, 1)["meta_info"]["cached_tokens"] == 0
    m = wait_idle(rel_server)
    assert m["dd_host_tier_prefix_cache_bytes"] == 0  # the 1-token request never went to the host tier


def prompt_logprobs(srv, ids: list[int]) -> list[float]:
    body = generate(srv, ids, 1, return_logprob=True, logprob_start_len=0)
    lps = [x[0] for x in body["meta_info"]["input_token_logprobs"]]
    assert len(lps) == len(ids)
    return lps[1:]  # the first token has no logprob (None)


def transformers_logprobs(model_path, ids: list[int]) -> list[float]:
    """Log-probabilities (nats, ``len(ids) - 1`` floats) of ``ids[1:]`` under transformers' float32
    forward pass of the same weights: an implementation independent of SGLang's."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1]
    lps = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return lps.tolist()


def test_prompt_logprobs_do_not_depend_on_request_order(rel_server, tokenizer, model_path):
    """Two prompts sharing a ~300-token prefix, asked for prompt logprobs cold, after each other and
    after themselves: every order gives the same logprobs bit for bit (a cached prefix must not change
    or drop them), and they match transformers' on the same weights in float32 within bf16 rounding."""
    shared = "Notes from the harbour master. " * 60
    a = tokenizer.encode(shared + "The ferry leaves at nine and returns at noon.")
    b = tokenizer.encode(shared + "Storms close the harbour twice every winter.")
    assert 300 < len(a) < 1024
    flush_when_idle(rel_server)
    a_cold = prompt_logprobs(rel_server, a)
    b_after_a = prompt_logprobs(rel_server, b)
    a_after_both = prompt_logprobs(rel_server, a)
    flush_when_idle(rel_server)
    b_cold = prompt_logprobs(rel_server, b)
    a_after_b = prompt_logprobs(rel_server, a)
    assert a_cold == a_after_both == a_after_b
    assert b_cold == b_after_a
    # The float32 reference: the server's gap from it is its own rounding (bf16 on a CPU with native
    # bf16). Measured on the AMD EPYC host (bf16): mean 0.003 nats, largest 0.090 (from a bf16 transformers
    # run: 0.098). A dropped or shifted prefix is off by nats on most tokens; bf16 logits step
    # 0.0625-0.125 at |logit| 8-32, hence the single-token bound.
    gaps = [abs(x - y) for x, y in zip(transformers_logprobs(model_path, a), a_cold, strict=True)]
    assert sum(gaps) / len(gaps) < 0.02 and max(gaps) < BF16_LOGPROB_TOL, (sum(gaps) / len(gaps), max(gaps))
