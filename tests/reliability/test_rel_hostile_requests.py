"""Malformed and hostile requests: each is a 4xx whose message names the problem, holds no KV, and
the server keeps serving (one greedy token after every case: a crashed scheduler takes SGLang's whole
process tree down, a stalled HTTP server does not answer; a completion and ``/health`` after them all).

Cases already covered in tests/test_server_e2e.py (body not JSON, negative ``max_tokens``, a
completion prompt over the context) and tests/dualdecoder/test_dualdecoder_e2e.py (six bad ``custom_params``
overrides) are not repeated. Four cases here crashed or stalled SGLang 0.5.23 before dd_sglang
refused them: ``/generate`` with ``"text": ""`` and a token id outside the vocabulary each killed
the scheduler (the whole server), ``n=100000`` kept the HTTP server busy for minutes, and a 64 MiB
body got the HTTP server OOM-killed (``dd_sglang/plugin/requests.py``, ``http_limits.py``).
"""

from __future__ import annotations

import httpx
import pytest

from harness.server import scrape

pytestmark = pytest.mark.server

C, CH, G = "/v1/completions", "/v1/chat/completions", "/generate"


def comp(**kw) -> dict:
    return {"model": "x", "prompt": "Hello", "max_tokens": 4, **kw}


def chat(**kw) -> dict:
    return {"model": "x", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **kw}


def gen(**sp) -> dict:
    return {"text": "Hello", "sampling_params": {"max_new_tokens": 2, **sp}}


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
JSON = "application/json"

# (case id, path, JSON payload or raw bytes, status, text the error message must contain)
CASES = [
    ("empty prompt", C, comp(prompt=""), 400, "Prompt cannot be empty"),
    ("empty prompt list", C, comp(prompt=[]), 400, "Prompt cannot be empty"),
    ("empty messages", CH, chat(messages=[]), 400, "Messages cannot be empty"),
    ("empty input_ids", G, {"input_ids": [], "sampling_params": {}}, 400, "input_ids cannot be empty"),
    ("empty text (crashed SGLang)", G, {"text": "", "sampling_params": {}}, 400, "the prompt is empty"),
    ("chat over the context", CH, chat(messages=[{"role": "user", "content": "word " * 9000}]), 400,
     "longer than the model's context length"),
    ("input_ids over the context", G, {"input_ids": [42] * 9000}, 400, "longer than the model's context length"),
    ("prompt + max_tokens over the context", C, comp(prompt="word " * 4000, max_tokens=8000), 400,
     "exceeds the model's maximum context length"),
    ("huge max_tokens", C, comp(max_tokens=10**12), 400, "exceeds the model's maximum context length"),
    ("max_tokens 0", C, comp(max_tokens=0), 400, "max_tokens must be positive"),
    ("max_tokens a string", C, comp(max_tokens="ten"), 400, "max_tokens"),
    ("max_tokens a fraction", C, comp(max_tokens=3.5), 400, "max_tokens"),
    ("negative max_completion_tokens", CH, chat(max_completion_tokens=-1), 400, "max_new_tokens must be at least 0"),
    ("negative temperature", C, comp(temperature=-1), 400, "temperature must be a non-negative finite number"),
    ("temperature a string", C, comp(temperature="hot"), 400, "temperature"),
    ("top_p 0", C, comp(top_p=0), 400, "top_p must be in (0, 1]"),
    ("top_p above 1", C, comp(top_p=1.5), 400, "top_p must be in (0, 1]"),
    ("top_k -5", C, comp(top_k=-5), 400, "top_k must be -1 (disable) or at least 1"),
    ("top_k 0", C, comp(top_k=0), 400, "top_k must be -1 (disable) or at least 1"),
    ("min_p 2", C, comp(min_p=2), 400, "min_p must be in [0, 1]"),
    ("frequency_penalty 5", C, comp(frequency_penalty=5), 400, "frequency_penalty must be in [-2, 2]"),
    ("presence_penalty -3", C, comp(presence_penalty=-3), 400, "presence_penalty must be in [-2, 2]"),
    ("repetition_penalty 0", C, comp(repetition_penalty=0), 400, "repetition_penalty must be in (0, 2]"),
    ("n 0", C, comp(n=0), 400, "n must be an integer in [1, 128]"),
    ("n 100000 (stalled SGLang)", C, comp(n=100000), 400, "n must be an integer in [1, 128]"),
    ("n a string", C, comp(n="two"), 400, "'n'"),
    ("min_tokens above max_tokens", C, comp(min_tokens=10), 400, "min_new_tokens must be in [0, max_new_tokens(4)]"),
    ("negative min_tokens", C, comp(min_tokens=-1), 400, "min_new_tokens must be in [0, max_new_tokens]"),
    ("stop a number", C, comp(stop=5), 400, "'stop'"),
    ("100 stop strings", C, comp(stop=[str(i) for i in range(100)]), 400, "at most 32 stop strings"),
    ("messages a string", CH, chat(messages="hello"), 400, "'messages'"),
    ("unknown role", CH, chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "role"),
    ("message without role", CH, chat(messages=[{"content": "hi"}]), 400, "'role'"),
    ("prompt an object", C, comp(prompt={"a": 1}), 400, "'prompt'"),
    ("negative token id (crashed SGLang)", C, comp(prompt=[1, -5, 3]), 400,
     "token id -5 is outside the vocabulary; ids must be in [0, 49152)"),
    ("token id past the vocabulary (crashed SGLang)", G, {"input_ids": [1, 49152, 3]}, 400,
     "token id 49152 is outside the vocabulary"),
    ("neither text nor input_ids", G, {"sampling_params": {}}, 400, "Either text, input_ids or input_embeds"),
    ("sampling_params a list of numbers", G, {"text": "hi", "sampling_params": [1, 2]}, 400, "sampling_params"),
    ("misspelt sampling key", G, gen(temprature=0), 400, "unknown field `temprature`"),
    ("invalid regex", G, gen(regex="(("), 400, "Failed to compile regex grammar"),
    ("invalid json_schema", G, gen(json_schema="{not json"), 400, "Failed to compile json grammar"),
    ("stop_token_ids strings", G, gen(stop_token_ids=["a"]), 400, "expected i64"),
    ("unknown response_format", CH, chat(response_format={"type": "xml"}), 400, "response_format"),
    ("json_schema format without schema", CH, chat(response_format={"type": "json_schema"}), 400,
     "schema_ is required"),
    ("tool without function", CH, chat(tools=[{"type": "function"}]), 400, "'function'"),
    ("tool_choice names a missing tool", CH,
     chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "g"}}), 400, "Tool 'g' not found"),
    ("logit_bias key not a token id", C, comp(logit_bias={"abc": 5}), 400, "invalid literal for int()"),
    ("logit_bias key past the vocabulary", C, comp(logit_bias={"999999999": 5}), 400, "logit_bias must has keys in [0, 49151]"),
    ("seed a string", C, comp(seed="abc"), 400, "'seed'"),
    ("custom_params a string", C, comp(custom_params="dd_top_k=5"), 400, "'custom_params'"),
    ("dd_top_k a fraction", C, comp(custom_params={"dd_top_k": 1.5}), 400, "custom_params.dd_top_k must be an integer in [1, 8192]"),
    ("dd_top_k a boolean", C, comp(custom_params={"dd_top_k": True}), 400, "custom_params.dd_top_k must be an integer"),
    ("dd_top_k 10 million", C, comp(custom_params={"dd_top_k": 10**7}), 400, "custom_params.dd_top_k must be an integer in [1, 8192]"),
    ("dd_top_k over the preset's request_max_top_k", G, gen(custom_params={"dd_top_k": 8193}), 400,
     "custom_params.dd_top_k must be an integer in [1, 8192], got 8193"),
    ("dd_selector the preset's request_selectors leave out", C, comp(custom_params={"dd_selector": "quest_device"}), 400,
     "custom_params.dd_selector must be one of ['spec_host', 'spec_host_exact', 'oracle', 'recency', 'host_sync'] "
     "on this server, got 'quest_device'"),
    ("dd_selector a number", C, comp(custom_params={"dd_selector": 3}), 400, "custom_params.dd_selector must be one of"),
    ("dd_miss_policy (a deleted switch)", C, comp(custom_params={"dd_miss_policy": "use_prefetched"}), 400,
     "custom_params.dd_miss_policy is not a dd_sglang override"),
    ("dd_speculator (a deleted switch)", G, gen(custom_params={"dd_speculator": "dual_token"}), 400,
     "custom_params.dd_speculator is not a dd_sglang override"),
    ("dd_trace on a server without DD_SGLANG_TRACE_DIR", C, comp(custom_params={"dd_trace": True}), 400,
     "custom_params.dd_trace: this server writes no attention traces (start it with DD_SGLANG_TRACE_DIR"),
    ("custom_params a string in /generate (was ignored)", G, gen(custom_params='{"dd_top_k": -1}'), 400,
     "custom_params must be a JSON object"),
    ("upper-case dd_ key (was ignored)", G, gen(custom_params={"DD_TOP_K": 1}), 400, "custom_params.DD_TOP_K is not"),
    ("unknown LoRA adapter in model", C, comp(model="smollm2-135m-instruct:nonexistent"), 400, "LoRA adapter 'nonexistent'"),
    ("body a JSON array", C, [1, 2, 3], 400, "valid dictionary"),
    ("body without prompt", C, {"model": "x", "max_tokens": 4}, 400, "'prompt'"),
    ("body without messages", CH, {"model": "x", "max_tokens": 4}, 400, "'messages'"),
    ("invalid UTF-8", C, b'{"model":"x","prompt":"\xff\xfe\xfa","max_tokens":4}', 400, "not valid UTF-8"),
    ("lone surrogate escape", C, b'{"model":"x","prompt":"\\ud800abc","max_tokens":4}', 400, "no low surrogate"),
    ("NaN temperature", C, b'{"model":"x","prompt":"hi","max_tokens":4,"temperature":NaN}', 400, "JSON decode error"),
    ("truncated JSON", C, b'{"model":"x","prompt":"hi"', 400, "JSON decode error"),
    ("100,000-deep nesting", C, b'{"model":"x","prompt":"hi","custom_params":' + b"[" * 100000 + b"]" * 100000 + b"}",
     400, "depth limit exceeded"),
    ("5 MiB body (OOM-killed SGLang at 64 MiB)", C, b'{"model":"x","max_tokens":4,"prompt":"' + b"word " * (1 << 20) + b'"}',
     413, "exceeds server.max_request_bytes (2097152 bytes)"),
]  # fmt: skip


def error_message(r: httpx.Response) -> str:
    """The error text of SGLang's three error shapes (OpenAI routes, /generate, FastAPI)."""
    try:
        body = r.json()
    except ValueError:
        return r.text
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            return str(err.get("message", ""))
        return str(body.get("message") or err or body.get("detail") or "")
    return r.text


@pytest.fixture(scope="module")
def kv_baseline(rel_server) -> float:
    """Device KV bytes held by requests before the hostile ones (prefix cache excluded)."""
    m = scrape(rel_server.metrics_url)
    return m["dd_device_kv_used_bytes"] - m["dd_device_kv_evictable_bytes"]


def assert_still_serving(srv) -> None:
    """One greedy token through ``/generate``: what SGLang's ``/health`` does too, without its 1 s
    poll (``http_server.py: health_generate`` sleeps a second before it looks, ~70 s over this
    module); ``/health`` itself is checked once, after every case."""
    r = srv.post(G, {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}, timeout=30)
    assert r.status_code == 200, r.text[:300]
    assert len(r.json()["output_ids"]) == 1


def assert_still_completing(srv) -> None:
    ok = srv.post(C, {"model": "x", "prompt": "The sky is", "max_tokens": 1, "temperature": 0})
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize("case,path,body,status,needle", CASES, ids=[c[0] for c in CASES])
def test_hostile_request_is_refused_and_server_keeps_serving(
    rel_server, kv_baseline, case, path, body, status, needle
):
    if isinstance(body, bytes):
        r = httpx.post(f"{rel_server.url}{path}", content=body, timeout=120,
                       headers={**rel_server.headers, "content-type": "application/json"})  # fmt: skip
    else:
        r = rel_server.post(path, body, timeout=120)
    assert r.status_code == status, f"{case}: {r.status_code} {r.text[:300]}"
    assert needle in error_message(r), f"{case}: {r.text[:500]}"
    assert_still_serving(rel_server)


def test_refused_requests_hold_no_kv(rel_server, kv_baseline):
    """After every hostile request above the server still completes, and no device KV is held by a
    request (only the prefix cache)."""
    assert_still_completing(rel_server)
    assert httpx.get(f"{rel_server.url}/health", timeout=30).status_code == 200
    m = scrape(rel_server.metrics_url)
    assert m["dd_device_kv_used_bytes"] - m["dd_device_kv_evictable_bytes"] == kv_baseline == 0


@pytest.mark.parametrize(
    "method,path,headers,status,needle",
    [
        ("POST", C, {}, 401, "Unauthorized"),  # no key
        ("POST", C, {"Authorization": "Bearer wrong-key"}, 401, "Unauthorized"),
        ("POST", C, {"Authorization": "Basic " + "x" * 20}, 401, "Unauthorized"),
        ("GET", C, None, 405, "Method Not Allowed"),
        ("POST", "/v1/nothing", None, 404, "Not Found"),
        ("DELETE", CH, None, 405, "Method Not Allowed"),
    ],
)
def test_unauthorized_or_unrouted_request(rel_server, method, path, headers, status, needle):
    """Without the server's ``--api-key`` every API route is 401; unknown routes and methods 404/405."""
    hdrs = rel_server.headers if headers is None else headers
    r = httpx.request(method, f"{rel_server.url}{path}", headers=hdrs, json=comp(), timeout=60)
    assert r.status_code == status, r.text
    assert needle in error_message(r) or needle in r.text
    assert_still_serving(rel_server)
