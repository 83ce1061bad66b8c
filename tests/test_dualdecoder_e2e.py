"""End to end: SGLang with ``--attention-backend dualdecoder`` (sparse decode over device KV).

A second real server for this module, beside the session's dense one. The
default preset's ``sparse`` section applies: contexts of 1,024+ tokens decode
over 4 sink + 128 recent + top-256 oracle tokens per layer and KV head.
"""

from __future__ import annotations

import re

import httpx
import pytest

from bench.prompts import passkey_prompt
from bench.server import start_server

pytestmark = pytest.mark.server
N_LAYERS = 30  # SmolLM2-135M


@pytest.fixture(scope="module")
def dd_server(model_path, tmp_path_factory):
    try:
        srv = start_server(
            tmp_path_factory.mktemp("dd_server") / "server.log", 16384, ["--attention-backend", "dualdecoder"]
        )
    except RuntimeError as err:
        pytest.fail(str(err))
    yield srv
    rc, alive = srv.stop()
    assert rc == 0 and not alive, f"rc={rc} alive={alive}\n{srv.log_tail()}"


def _sparse_rows(srv) -> float:
    for line in httpx.get(f"{srv.metrics_url}/metrics", timeout=10).text.splitlines():
        if line.startswith("dd_sparse_decode_rows_total "):
            return float(line.split()[1])
    return 0.0


@pytest.mark.parametrize("depth,passkey", [(0.1, 40917), (0.5, 11111), (0.9, 73052)])
def test_passkey_4k_on_sparse_path(dd_server, tokenizer, depth, passkey):
    prompt, n = passkey_prompt(tokenizer, 4000, depth, passkey)
    assert n > 1024 + 256
    before = _sparse_rows(dd_server)
    r = httpx.post(
        f"{dd_server.url}/v1/completions",
        json={"model": "x", "prompt": prompt, "max_tokens": 8, "temperature": 0},
        timeout=600,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert re.match(rf"\s*{passkey}\b", body["choices"][0]["text"]), body["choices"][0]["text"]
    # Every decode step after the first token ran sparsely in every layer.
    decode_steps = body["usage"]["completion_tokens"] - 1
    assert decode_steps >= 5
    assert _sparse_rows(dd_server) - before >= decode_steps * N_LAYERS


def test_short_context_is_token_identical_to_dense(dd_server, server):
    """Below min_sparse_len the backend delegates to the dense one: same greedy tokens."""
    payload = {
        "model": "x",
        "messages": [{"role": "user", "content": "Explain in three sentences why the sky is blue."}],
        "max_tokens": 48,
        "temperature": 0,
    }
    before = _sparse_rows(dd_server)
    sparse = httpx.post(f"{dd_server.url}/v1/chat/completions", json=payload, timeout=300).json()
    dense = httpx.post(f"{server.url}/v1/chat/completions", json=payload, timeout=300).json()
    assert sparse["choices"][0]["message"]["content"] == dense["choices"][0]["message"]["content"]
    assert _sparse_rows(dd_server) == before
