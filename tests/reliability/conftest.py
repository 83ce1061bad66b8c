"""The reliability suite's server: one ``dualdecoder`` server for the whole package.

Cases come from failure reports of KV-offload and sparse-decode systems
(SGLang HiCache/HiSparse, vLLM's offload connector, LMCache); each is a real
request sequence against a real server, checked against values computed
independently (the server's own dense path after a fresh prefill, transformers on the same
weights, byte counts of the preset). The package does not use the session's dense server: it
runs on the second pytest-xdist worker beside the tests that do (``tests/lanes.py``).

The server (:func:`rel_server`, package scope) is the CPU preset with:

* ``--chunked-prefill-size 128``: a ~2k prompt prefills in 16 chunks, so aborts
  land between chunks;
* a sparse geometry that makes pages move often: ``n_recent`` 32 and
  ``page_size`` 16 (defaults 128 and 64), so a generation of ~50 tokens already
  pushes its own first tokens out of the window into the host tier;
* a host tier of :data:`GROWTH_PROMPT` 's pages + 2 (``sparse.host_tier_bytes``),
  so one request's decode growth fills it;
* ``prefetch.hit_rate_sample`` 1 (every step feeds the prefetch series);
* what a request may ask bounded as a GPU operator would (:data:`REQUEST_SELECTORS`,
  :data:`REQUEST_MAX_TOP_K`): every selector but ``quest_device`` (device-resident index), and a
  ``dd_top_k`` of at most the model's context;
* the launcher's default dtype for this CPU, given explicitly (the host tier is sized in its bytes
  before the server starts);
* a device pool of 4,096 tokens and SGLang's ``--api-key`` (the sidecar's
  ``/stats`` must honour it), ``--enable-cache-report`` for cached-token counts.
"""

from __future__ import annotations

import pytest
import yaml

from harness.prompts import passkey_prompt
from harness.server import ROOT, ServerProcess, launch_server
from tests.servers import boots, serve

from .geometry import API_KEY, CAP, GROWTH_PROMPT, N_RECENT, N_SINK, PAGE, host_pages, kv_bytes_per_token

#: The preset's ``sparse.request_selectors`` / ``sparse.request_max_top_k`` (module docstring).
REQUEST_SELECTORS = ("spec_host", "spec_host_exact", "oracle", "recency", "host_sync")
REQUEST_MAX_TOP_K = 8192


def _growth_prompt(tokenizer) -> tuple[str, list[int]]:
    prompt, n = passkey_prompt(tokenizer, *GROWTH_PROMPT)
    assert 1024 <= n <= 1400
    return prompt, tokenizer.encode(prompt)


def _usable_bytes(n_tokens: int, bytes_per_token: int) -> int:
    return (host_pages(n_tokens) + 2) * PAGE * bytes_per_token


@pytest.fixture(scope="package")
def growth_prompt(tokenizer) -> tuple[str, list[int]]:
    """The host-tier-sizing prompt: ``(text, token ids)``, 1,024+ tokens (goes sparse)."""
    return _growth_prompt(tokenizer)


@pytest.fixture(scope="package")
def bytes_per_token(rel_server) -> int:
    """KV bytes per token in the dtype the reliability server reports (``/server_info``)."""
    return kv_bytes_per_token(rel_server.kv_itemsize)


@pytest.fixture(scope="package")
def host_usable_bytes(growth_prompt, bytes_per_token) -> int:
    """Usable host-tier bytes: the growth prompt's pages plus two (the padding page excluded)."""
    return _usable_bytes(len(growth_prompt[1]), bytes_per_token)


def _dtype() -> str:
    """The launcher's default dtype for this CPU (:func:`dd_sglang.platform.dtype.default_dtype`), given
    to the reliability server explicitly: its host tier is sized in that dtype's bytes before it starts."""
    from dd_sglang.platform.dtype import default_dtype

    return default_dtype()


@boots("rel_server")
def _launch(tmp_path_factory, tokenizer) -> ServerProcess:
    dtype = _dtype()
    per_token = kv_bytes_per_token({"float32": 4, "bfloat16": 2, "float16": 2}[dtype])
    usable = _usable_bytes(len(_growth_prompt(tokenizer)[1]), per_token)
    tmp = tmp_path_factory.mktemp("rel_server")
    preset = yaml.safe_load((ROOT / "configs" / "cpu-smollm2.yaml").read_text())
    preset["name"] = "reliability"
    preset["sparse"].update(
        n_sink=N_SINK,
        n_recent=N_RECENT,
        page_size=PAGE,
        host_tier_bytes=usable + PAGE * per_token,  # + SGLang's padding page
    )
    preset["sparse"].update(request_selectors=list(REQUEST_SELECTORS), request_max_top_k=REQUEST_MAX_TOP_K)
    preset["prefetch"]["hit_rate_sample"] = 1.0
    (tmp / "preset.yaml").write_text(yaml.safe_dump(preset))
    args = ["--attention-backend", "dualdecoder", "--enable-cache-report", "--chunked-prefill-size", "128",
            "--dtype", dtype, "--dd-config", str(tmp / "preset.yaml")]  # fmt: skip
    return launch_server(tmp / "server.log", CAP, args, api_key=API_KEY)


@pytest.fixture(scope="package")
def rel_server(tmp_path_factory, tokenizer) -> ServerProcess:
    body = serve("rel_server", tmp_path_factory, tokenizer)
    srv = next(body)
    try:
        assert srv.dtype == _dtype(), f"reliability server in {srv.dtype}, launched with --dtype {_dtype()}"
        yield srv
    finally:
        next(body, None)  # its stop
