"""End-to-end tests against one real dd_sglang server (session fixture ``server``).

The model is the embedded SmolLM2-135M-Instruct served by unmodified SGLang
0.5.23 through dd_sglang's CPU platform plugin.
"""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from harness.prompts import passkey_prompt
from harness.server import scrape

pytestmark = pytest.mark.server



def kv_bytes_per_token(server) -> int:
    """Bytes per device-tier KV slot for SmolLM2-135M, computed by hand: 30 layers x 2 (K and V)
    x 3 KV heads x 64 head_dim x the element size of the server's dtype (the launcher picks it
    from the CPU: float32 without native bf16)."""
    return 30 * 2 * 3 * 64 * server.kv_itemsize


def _post(server, path, payload, timeout=300):
    return httpx.post(f"{server.url}{path}", json=payload, timeout=timeout)


def _dd_metrics(server) -> dict[str, float]:
    """The sidecar's ``dd_`` samples, the server's totals (the ``dp_rank`` label folded)."""
    return scrape(server.metrics_url)


@pytest.mark.parametrize(
    "n_tokens,depth,passkey",
    [(2000, 0.5, 68351)],
)
def test_passkey_2k_completions(server, tokenizer, n_tokens, depth, passkey):
    prompt, n = passkey_prompt(tokenizer, n_tokens, depth, passkey)
    assert 1800 <= n <= 2100
    r = _post(server, "/v1/completions", {"model": "x", "prompt": prompt, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] == n
    assert re.match(rf"\s*{passkey}\b", body["choices"][0]["text"]), body["choices"][0]["text"]


#: One bf16 step at logit magnitude 16..32 is 0.125: a gap this small is a numerical tie (float32 ties
#: are far smaller; the same bound holds).
BF16_LOGIT_TIE = 0.25


def test_greedy_matches_transformers(server, tokenizer, model_path):
    """SGLang's greedy tokens are transformers' greedy tokens on the same weights, in the server's dtype.

    HF generates greedily; SGLang generates greedily with logprobs. The first
    tokens must be identical. Then HF scores SGLang's whole sequence
    (teacher-forced): every SGLang token must be HF's argmax, or within a
    tie of it (both engines compute in the same dtype with different kernels, so an
    exact tie can break either way), and the two engines' logprobs must agree.
    """
    import torch
    from transformers import AutoModelForCausalLM

    messages = [{"role": "user", "content": "Write two sentences about the history of the bicycle."}]
    ids = list(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    )
    n_new = 32
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, server.dtype))
    r = _post(
        server,
        "/generate",
        {
            "input_ids": ids,
            "sampling_params": {"temperature": 0, "max_new_tokens": n_new},
            "return_logprob": True,
        },
    )
    assert r.status_code == 200, r.text
    got = r.json()["output_ids"]
    sg_logprobs = torch.tensor([x[0] for x in r.json()["meta_info"]["output_token_logprobs"]])
    assert len(got) == n_new
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids) :].tolist()
        logits = model(torch.tensor([ids + got])).logits[0, len(ids) - 1 : len(ids) + n_new - 1].float()
    assert got[: len(ref)] == ref, (
        f"sglang {tokenizer.decode(got)!r} vs transformers {tokenizer.decode(ref)!r}"
    )
    gaps = logits.max(dim=-1).values - logits[torch.arange(n_new), torch.tensor(got)]
    assert (gaps <= BF16_LOGIT_TIE).all(), (
        f"non-tie divergence at {gaps.argmax().item()}: gap {gaps.max():.3f}"
    )
    assert (gaps == 0).float().mean() >= 0.9
    hf_logprobs = torch.log_softmax(logits, -1)[torch.arange(n_new), torch.tensor(got)]
    assert (hf_logprobs - sg_logprobs).abs().max() < 0.25
    assert (hf_logprobs - sg_logprobs).abs().mean() < 0.05


def test_chat_completion(server):
    r = _post(
        server,
        "/v1/chat/completions",
        {
            "model": "smollm2-135m-instruct",
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 24,
            "temperature": 0,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "smollm2-135m-instruct"
    assert "Paris" in body["choices"][0]["message"]["content"]
    assert body["choices"][0]["finish_reason"] in ("stop", "length")


def test_streamed_chat_equals_unstreamed(server):
    payload = {
        "model": "x",
        "messages": [{"role": "user", "content": "Name three colours of the rainbow."}],
        "max_tokens": 24,
        "temperature": 0,
    }
    full = _post(server, "/v1/chat/completions", payload).json()["choices"][0]["message"]["content"]
    pieces, done = [], False
    with httpx.stream(
        "POST", f"{server.url}/v1/chat/completions", json={**payload, "stream": True}, timeout=300
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                done = True
                break
            delta = json.loads(data)["choices"][0]["delta"].get("content")
            if delta:
                pieces.append(delta)
    assert done
    assert len(pieces) > 1, "a streamed answer arrives in several chunks"
    assert "".join(pieces) == full


def test_healthz(server):
    r = httpx.get(f"{server.metrics_url}/healthz", timeout=10)
    assert r.status_code == 200
    assert r.json() == {"status": "ok"}


def test_sglang_temporary_files_live_in_the_launchers_folder(server):
    """SGLang's ZMQ sockets and port files go to the launcher's ``dd_sglang_tmp_<pid>_*`` folder (its
    ``TMPDIR``), which the launcher removes when it stops (checked at the end of the session)."""
    import stat
    import tempfile
    from pathlib import Path

    from dd_sglang.launch_server import TMP_DIR_PREFIX

    (folder,) = Path(tempfile.gettempdir()).glob(f"{TMP_DIR_PREFIX}{server.proc.pid}_*")
    assert any(stat.S_ISSOCK(p.lstat().st_mode) for p in folder.iterdir())


def test_metrics_dd_series_and_byte_accounting(server):
    # Traffic first, so the scheduler has published after a batch.
    _post(server, "/v1/completions", {"model": "x", "prompt": "Hello", "max_tokens": 4, "temperature": 0})
    time.sleep(1.0)
    m = _dd_metrics(server)
    for name in (
        "dd_device_kv_capacity_bytes",
        "dd_device_kv_used_bytes",
        "dd_device_kv_evictable_bytes",
        "dd_host_tier_capacity_bytes",
        "dd_host_tier_used_bytes",
        'dd_hbm_used_bytes{source="cpu_device_pool"}',
        'dd_dualpath_requests{state="DENSE"}',
        'dd_dualpath_requests{state="DECODE_SPARSE"}',
    ):
        assert name in m, f"{name} missing from /metrics"
    # SGLang's pool holds max_total_tokens slots plus one padding slot (page_size 1).
    expected_capacity = (server.max_total_tokens + 1) * kv_bytes_per_token(server)
    assert m["dd_device_kv_capacity_bytes"] == expected_capacity
    assert m['dd_hbm_used_bytes{source="cpu_device_pool"}'] == expected_capacity
    used = m["dd_device_kv_used_bytes"]
    assert used > 0 and used % kv_bytes_per_token(server) == 0
    assert 0 <= m["dd_device_kv_evictable_bytes"] <= used
    assert m["dd_host_tier_used_bytes"] == 0
    stats = httpx.get(f"{server.metrics_url}/stats", timeout=10).json()
    assert stats["preset"] == "cpu-smollm2"
    assert stats["metrics"]["dd_device_kv_capacity_bytes"][0]["value"] == expected_capacity
    # SGLang's own series are merged into the same endpoint (--enable-metrics in the preset).
    assert "sglang:" in httpx.get(f"{server.metrics_url}/metrics", timeout=10).text


@pytest.mark.parametrize(
    "kind,path,body,needle",
    [
        ("not json", "/v1/completions", b"{not json", None),
        (
            "negative max_tokens",
            "/v1/completions",
            {"model": "x", "prompt": "hi", "max_tokens": -5},
            "max_tokens",
        ),
        (
            "over context",
            "/v1/completions",
            {"model": "x", "prompt": "word " * 9000, "max_tokens": 4},
            "context length",
        ),
    ],
)
def test_malformed_requests_rejected_and_server_keeps_serving(server, kind, path, body, needle):
    time.sleep(0.6)
    before = _dd_metrics(server)["dd_device_kv_used_bytes"]
    if isinstance(body, bytes):
        r = httpx.post(
            f"{server.url}{path}", content=body, headers={"content-type": "application/json"}, timeout=60
        )
    else:
        r = _post(server, path, body, timeout=60)
    assert 400 <= r.status_code < 500, f"{kind}: {r.status_code} {r.text[:300]}"
    if needle:
        assert needle in r.json()["message"]
    # A rejected request allocates no KV slot.
    time.sleep(0.6)
    assert _dd_metrics(server)["dd_device_kv_used_bytes"] == before
    ok = _post(
        server, "/v1/completions", {"model": "x", "prompt": "The sky is", "max_tokens": 3, "temperature": 0}
    )
    assert ok.status_code == 200


def test_locust_scenarios_run_clean(server, tokenizer, tmp_path):
    """``make loadtest``'s runner (``python -m loadtest.run --host``) drives the server with the shipped
    Locust file for a short bounded run: no failure, and its verdict counts every request Locust
    made, those finishing after ``--run-time`` too (its final JSON, not the CSV Locust rewrites
    once a second while it runs)."""
    import csv
    import json
    import os
    import subprocess
    import sys

    # Locust is never imported here: it monkey-patches the process (gevent).
    from harness.prompts import FILLER, FILLER_TOKENS

    assert len(tokenizer.encode(FILLER)) == FILLER_TOKENS
    prefix = tmp_path / "load"
    r = subprocess.run(
        [sys.executable, "-m", "loadtest.run", "--host", server.url, "--users", "2", "--spawn-rate", "2",
         "--run-time", "15s", "--stop-timeout", "60", "--csv", str(prefix)],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "DD_LOAD_CONTEXT_TOKENS": "1000", "DD_LOAD_TURNS": "2"},
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    entries = json.loads((tmp_path / "load_final.json").read_text())
    made = sum(e["num_requests"] for e in entries)
    assert made > 0 and sum(e["num_failures"] for e in entries) == 0
    assert f"OK: {made} requests, 0 failures" in r.stdout
    csv_total = next(row for row in csv.DictReader(open(tmp_path / "load_stats.csv")) if row["Name"] == "Aggregated")
    assert int(csv_total["Request Count"]) <= made
