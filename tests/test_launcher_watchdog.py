"""The launcher's start-up watchdog stops an SGLang that is not healthy in time."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from harness.server import free_port


@pytest.mark.server
def test_start_timeout_stops_sglang_and_exits_1(tmp_path, model_path):
    # SGLang needs 25-55 s to become healthy here; give it 10 s.
    preset = tmp_path / "p.yaml"
    preset.write_text("server:\n  start_timeout_s: 10\n  max_total_tokens: 2048\n")
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "dd_sglang.launch_server", "--dd-config", str(preset),
         "--port", str(free_port()), "--metrics-port", str(free_port())],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    time.sleep(5)
    family = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 1, out[-2000:]
    assert "not healthy after 10 s" in out
    assert time.monotonic() - t0 < 120
    time.sleep(1)
    assert not [
        p for p in family if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
    ]
