"""Shared fixtures. One real server (``python -m dd_sglang.launch_server``) per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.server import ServerProcess, start_server

#: KV pool cap of the test server, in tokens (small: the suite runs on 2 cores / 24 GB).
TEST_MAX_TOTAL_TOKENS = 12288


@pytest.fixture(scope="session")
def model_path() -> Path:
    """The converted embedded model (``make test`` prepares it before pytest starts)."""
    from dd_sglang.models.smollm2 import prepare_model

    return prepare_model(progress=False)


@pytest.fixture(scope="session")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="session")
def server(model_path, tmp_path_factory) -> ServerProcess:
    """A real dd_sglang server on free loopback ports, started once for the session.

    Teardown sends SIGTERM to the launcher and asserts that it exits 0 and that
    every process it started (SGLang's HTTP server, scheduler, detokenizer) is gone.
    """
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    try:
        srv = start_server(log_path, TEST_MAX_TOTAL_TOKENS, timeout=900)  # a loaded 2-core machine: > 300 s
    except RuntimeError as err:
        pytest.fail(str(err))
    yield srv
    rc, alive = srv.stop()
    assert rc == 0, f"launcher exit code {rc} after SIGTERM:\n{srv.log_tail()}"
    assert not alive, f"processes left after SIGTERM: {alive}"
    assert "crashed with exit code" not in srv.log_path.read_text(), "SGLang saw a crash during a normal stop"


def serve(log_path: Path, max_total_tokens: int, args: list[str], **kwargs):
    """A fixture body for a test-owned server: start it (``bench.server.start_server``; a failed
    start fails the test), yield it, then stop it and assert it exited 0, left no process
    behind and logged no ``Traceback``."""
    try:
        srv = start_server(log_path, max_total_tokens, args, timeout=900, **kwargs)  # a loaded 2-core machine: > 300 s
    except RuntimeError as err:
        pytest.fail(str(err))
    yield srv
    rc, alive = srv.stop()
    assert rc == 0 and not alive, f"rc={rc} alive={alive}\n{srv.log_tail()}"
    assert "Traceback" not in srv.log_path.read_text(), srv.log_tail()
