"""The package's server: one ``dualdecoder`` server for the sparse path's end-to-end and quality tests.

Both modules (``test_dualdecoder_e2e.py``, ``test_fidelity_e2e.py``) once started a server each
with nearly the same settings; one start-up (~45-60 s on 2 cores) is saved by sharing it.
The default CPU preset, except that every step measures the prefetch hit rate
(``prefetch.hit_rate_sample: 1``), with a device KV pool of :data:`CAP` tokens (two ~4k
dense requests fit, three do not), SGLang's ``--enable-cache-report`` (cached-token counts)
and ``--enable-custom-logit-processor`` (the quality benches' teacher forcing). It is
launched before the first test (``tests/conftest.py``) and stops when the package's tests are done.
"""

from __future__ import annotations

import pytest

from bench.client import COMMON_FLAGS, bench_preset
from bench.server import ServerProcess, launch_server
from tests.servers import boots, serve

#: Device KV pool of the package's server (tokens): two ~4k dense requests fit, three do not.
CAP = 8400


@boots("dd_server")
def _launch(tmp_path_factory, tokenizer) -> ServerProcess:
    tmp = tmp_path_factory.mktemp("dd_server")
    args = ["--attention-backend", "dualdecoder", "--enable-cache-report", "--dd-config", str(bench_preset(tmp, 1.0)),
            *COMMON_FLAGS]  # fmt: skip
    return launch_server(tmp / "server.log", CAP, args)


@pytest.fixture(scope="package")
def dd_server(tmp_path_factory, tokenizer) -> ServerProcess:
    yield from serve("dd_server", tmp_path_factory, tokenizer)
