"""The request checks dd_sglang adds in front of SGLang (each stopped a crash or a stall; see
tests/reliability/test_rel_hostile_requests.py for the same requests against a live server)."""

from __future__ import annotations

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from dd_sglang.plugin.http_limits import RequestSizeLimit
from dd_sglang.plugin.requests import MAX_PARALLEL_SAMPLES, check_parallel_samples, check_prompt_tokens


@pytest.mark.parametrize(
    "ids,needle",
    [([], "the prompt is empty"), ([1, -1, 2], "token id -1"), ([1, 49152], "token id 49152 is outside")],
)
def test_prompt_tokens_refused(ids, needle):
    with pytest.raises(ValueError, match=needle):
        check_prompt_tokens(ids, 49152)


def test_prompt_tokens_accepted():
    check_prompt_tokens([0, 49151, 7], 49152)
    check_prompt_tokens(None, 49152)  # embeddings instead of ids


@pytest.mark.parametrize("n", [0, -1, MAX_PARALLEL_SAMPLES + 1, 100000, 2.0, True, "2"])
def test_parallel_samples_refused(n):
    with pytest.raises(ValueError, match=rf"n must be an integer in \[1, {MAX_PARALLEL_SAMPLES}\]"):
        check_parallel_samples(n)


def test_parallel_samples_accepted():
    for n in (1, 2, MAX_PARALLEL_SAMPLES):
        check_parallel_samples(n)


@pytest.fixture
def limited():
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request):
        return {"n": len(await request.body())}

    app.add_middleware(RequestSizeLimit, max_bytes=1000)
    return TestClient(app)


def test_body_at_limit_passes_and_over_limit_is_413(limited):
    assert limited.post("/echo", content=b"x" * 1000).json() == {"n": 1000}
    r = limited.post("/echo", content=b"x" * 1001)
    assert r.status_code == 413
    assert "exceeds server.max_request_bytes (1000 bytes)" in r.json()["message"]


def test_chunked_body_over_limit_is_413(limited):
    def chunks():
        for _ in range(5):
            yield b"x" * 400

    r = limited.post("/echo", content=chunks())  # no Content-Length: chunked transfer
    assert r.status_code == 413
    assert "(chunked)" in r.json()["message"]
    small = limited.post("/echo", content=iter([b"x" * 300, b"y" * 300]))
    assert small.json() == {"n": 600}


def test_a_prompt_the_host_tier_cannot_hold_is_refused_naming_the_limit():
    """With the pool no longer bounding a prompt (prefill through the host tier), the tier does:
    ``host_tier_bytes // bytes_per_token`` tokens; SmolLM2 in bfloat16 has 30 x 2 x 3 x 64 x 2 =
    23,040 bytes per token, so a 1 GiB tier holds 46,603."""
    from dd_sglang.plugin.requests import check_host_tier_holds

    per_token = 30 * 2 * 3 * 64 * 2
    check_host_tier_holds(46_603, 2**30, per_token)
    with pytest.raises(ValueError, match=r"input: the prompt has 46604 tokens; the host tier holds at most 46603 "
                                         r"\(sparse.host_tier_bytes 1073741824 / 23040 bytes per token\)"):
        check_host_tier_holds(46_604, 2**30, per_token)
