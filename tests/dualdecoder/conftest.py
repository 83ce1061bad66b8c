"""The package's server: one ``dualdecoder`` server for the sparse path's end-to-end and quality tests.

Both modules (``test_dualdecoder_e2e.py``, ``test_fidelity_e2e.py``) once started a server each
with nearly the same settings; one start-up (~45-60 s on 2 cores) is saved by sharing it.
The default CPU preset, except that every step measures the prefetch hit rate
(``prefetch.hit_rate_sample: 1``) and a host tier of :data:`HOST_TIER_BYTES`, with SGLang's
``--chunked-prefill-size`` :data:`CHUNK` and a device KV pool of :data:`CAP` tokens (two ~2k
dense requests fit, three do not), SGLang's ``--enable-cache-report`` (cached-token counts)
and ``--enable-custom-logit-processor`` (the quality benches' teacher forcing), and attention traces
for the requests that ask (``DD_SGLANG_TRACE_DIR``, :mod:`dd_sglang.prefetch.trace`). It is
launched before the first test (``tests/conftest.py``) and stops when the package's tests are done.
"""

from __future__ import annotations

import pytest

from dd_sglang.kvcache.params import TRACE_DIR_ENV
from harness.client import COMMON_FLAGS, bench_preset
from harness.server import ServerProcess, launch_server
from tests.servers import boots, serve

#: Device KV pool of the package's server (tokens): two ~2k dense requests fit, three do not (the
#: benchmarks' 8,400 for ~4k prompts, halved: the same checks at half the prefill work).
CAP = 4200
#: SGLang's ``--chunked-prefill-size`` there (the preset's). Two ~2k prompts fit one prefill batch,
#: which can fill the pool to 0.97: the capacity test then sees a request's offload unpin its own
#: prompt to get its resident slots (``Offloader._move_tree_owned``, ``dd_sglang/kvcache/offload.py``),
#: and all 8 must still go sparse.
CHUNK = 4096
#: Its host tier (``sparse.host_tier_bytes``; the preset's 2 GiB, halved): 46,603 bf16 tokens, 23,301
#: float32 ones; the capacity test's 8 requests hold ~16k. ~1.3 GB less resident memory (the tier
#: and its int8 index) beside the suite's other servers.
HOST_TIER_BYTES = 1024**3


@boots("dd_server")
def _launch(tmp_path_factory, tokenizer) -> ServerProcess:
    tmp = tmp_path_factory.mktemp("dd_server")
    args = ["--attention-backend", "dualdecoder", "--enable-cache-report", "--chunked-prefill-size", str(CHUNK),
            "--dd-config", str(bench_preset(tmp, 1.0, HOST_TIER_BYTES)), *COMMON_FLAGS]  # fmt: skip
    return launch_server(tmp / "server.log", CAP, args, env={TRACE_DIR_ENV: str(tmp / "traces")})


@pytest.fixture(scope="package")
def dd_server(tmp_path_factory, tokenizer) -> ServerProcess:
    yield from serve("dd_server", tmp_path_factory, tokenizer)
