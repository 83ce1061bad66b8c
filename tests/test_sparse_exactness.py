"""Exactness: with ``top_k`` >= the context, the sparse path's greedy tokens equal the dense path's.

A ``dualdecoder`` server started from a preset whose ``sparse.top_k`` is 8192:
the request still goes PREFILL_FULL -> OFFLOADING -> DECODE_SPARSE, its device KV
is released down to the resident set, and every decode step gathers the rest
of its context from the host tier. Its 48 greedy tokens on a ~3,000-token
prompt must equal the session's dense (``torch_native``) server's, token for
token: the sparse kernel attends in position order with the same SDPA call.
"""

from __future__ import annotations

import httpx
import pytest
import yaml

from bench.prompts import passkey_prompt
from bench.server import start_server
from dd_sglang.config import CONFIGS_DIR

pytestmark = pytest.mark.server
N_LAYERS = 30


@pytest.fixture(scope="module")
def exact_server(model_path, tmp_path_factory):
    d = tmp_path_factory.mktemp("exact_server")
    preset = yaml.safe_load((CONFIGS_DIR / "cpu-smollm2.yaml").read_text())
    preset["name"] = "exactness"
    preset["sparse"]["top_k"] = 8192
    (d / "preset.yaml").write_text(yaml.safe_dump(preset))
    try:
        srv = start_server(
            d / "server.log",
            6144,
            ["--dd-config", str(d / "preset.yaml"), "--attention-backend", "dualdecoder"],
        )
    except RuntimeError as err:
        pytest.fail(str(err))
    yield srv
    rc, alive = srv.stop()
    assert rc == 0 and not alive, f"rc={rc} alive={alive}\n{srv.log_tail()}"


def _dd(srv) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{srv.metrics_url}/metrics", timeout=10).text.splitlines():
        if line.startswith("dd_"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_sparse_path_with_full_top_k_is_token_identical_to_dense(exact_server, server, tokenizer):
    prompt, n = passkey_prompt(tokenizer, 3200, 0.5, 48213)
    ids = tokenizer.encode(prompt)
    assert 2950 <= len(ids) <= 3100
    payload = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True},
    }
    before = _dd(exact_server)
    sparse = httpx.post(f"{exact_server.url}/generate", json=payload, timeout=600).json()
    after = _dd(exact_server)
    dense = httpx.post(f"{server.url}/generate", json=payload, timeout=600).json()
    assert len(dense["output_ids"]) == 48
    assert sparse["output_ids"] == dense["output_ids"]
    key = 'dd_dualpath_transitions_total{from="OFFLOADING",to="DECODE_SPARSE"}'
    assert after[key] - before.get(key, 0.0) == 1
    rows = after["dd_sparse_decode_rows_total"] - before.get("dd_sparse_decode_rows_total", 0.0)
    assert rows == 47 * N_LAYERS  # every decode step, every layer, on the sparse path
