"""harness.server's port handling: its draws stay out of SGLang's own, and a server whose HTTP port
was taken during start-up is relaunched on fresh ports instead of hanging until the timeout."""

from __future__ import annotations

import inspect
import subprocess
import sys
import threading
from pathlib import Path

from sglang.srt.utils import network

from harness import server as bs


def test_sglang_draws_its_nccl_port_from_the_range_free_port_skips():
    params = inspect.signature(network.get_free_port_below_ephemeral).parameters
    low, high = params["low"].default, params["high"].default
    assert bs.SGLANG_NCCL_PORTS == range(low, high + 1)


def test_free_port_never_returns_a_port_sglang_may_draw():
    ports = {bs.free_port() for _ in range(300)}
    assert not ports & set(bs.SGLANG_NCCL_PORTS)
    assert all(bs.PORT_FLOOR <= p < bs._ephemeral_low() for p in ports)


class _Fake(bs.ServerProcess):
    """First launch: logs uvicorn's bind failure and hangs, as SGLang does. Second: a static HTTP
    server whose folder holds ``healthz`` and ``server_info`` (answers 200 to both)."""

    def _spawn(self) -> None:
        port = bs.free_port()
        if self.relaunches == 0:
            code = f"import time; print('ERROR:    [Errno 98] {bs._BIND_FAILED} (\\'127.0.0.1\\', {port})', flush=True); time.sleep(600)"
            cmd = [sys.executable, "-c", code]
        else:
            cmd = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                   "--directory", str(self.log_path.parent / "www")]  # fmt: skip
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        self.url = self.metrics_url = f"http://127.0.0.1:{port}"
        self._launched = bs.time.monotonic()


def test_wait_ready_relaunches_on_fresh_ports_when_the_http_port_was_taken(tmp_path: Path):
    www = tmp_path / "www"
    www.mkdir()
    (www / "healthz").write_text("ok")
    (www / "server_info").write_text('{"dtype": "float32"}')
    srv = _Fake("", "", None, tmp_path / "server.log", 1024)
    srv._spawn()
    first = srv.proc
    threading.Thread(target=srv._sample, daemon=True).start()
    try:
        srv.wait_ready(60)
        assert srv.relaunches == 1
        assert first.poll() is not None  # the hung launch was stopped
        assert srv.proc is not first and srv.dtype == "float32"
    finally:
        srv.stop(5)
