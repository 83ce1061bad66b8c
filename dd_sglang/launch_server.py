"""``python -m dd_sglang.launch_server``: SGLang with dd_sglang loaded, plus the metrics sidecar.

Usage::

    python -m dd_sglang.launch_server [--dd-config NAME|PATH] [--metrics-port N]
                                      [--metrics-host H] [any sglang.launch_server flag ...]

Start-up, in order (every check runs before any SGLang process exists):

1. Split the dd flags from SGLang's; SGLang's pass through unchanged.
2. Load and validate the preset (:mod:`dd_sglang.config`); a bad key exits 2
   with a message naming it.
3. Pick the model: ``--model-path`` on the command line, else the preset's
   ``model.path``, else the embedded SmolLM2 (converted once into the cache).
4. Build SGLang's flags: preset values for every flag the command line does
   not give (loopback host, ``--max-total-tokens`` cap, ...).
5. Check that SGLang's port and the metrics port are free (exit 2 if not).
   On the CPU with more scheduler processes (``--dp-size x --tp-size``) than
   NUMA nodes, give each its own cores through :data:`CPU_BIND_ENV` (SGLang
   refuses to start otherwise), unless the environment sets it.
6. Start ``python -m sglang.launch_server`` in a new process group with
   ``PROMETHEUS_MULTIPROC_DIR`` (a fresh folder) and the preset in
   ``DD_SGLANG_CONFIG_JSON``; SGLang loads dd_sglang's plugins in each of its
   processes through entry points. The child also gets SIGTERM if this
   launcher dies (``PR_SET_PDEATHSIG``), and the oneDNN caches of bfloat16 CPU matmuls bounded
   (:func:`dd_sglang.platform.bounded_cache_env`: 256 entries each unless the environment sets them;
   their default 1,024 let a server grow ~690 MiB, ``docs/operations-memory.md``).
7. Start the metrics sidecar (``python -m dd_sglang.metrics.sidecar``,
   FastAPI/uvicorn) as a child process serving on the metrics socket this
   launcher bound and keeps. It only reads the metrics folder; if it dies it is
   restarted (at most once per :data:`SIDECAR_RESTART_MIN_S` seconds) and
   serving is unaffected. SGLang's ``--api-key`` (else ``--admin-api-key``)
   protects its ``/stats``.
8. SIGINT/SIGTERM: SIGTERM to SGLang's whole process group, SIGKILL after
   :data:`SHUTDOWN_GRACE_S` seconds, stop the sidecar, remove the metrics
   folder and SGLang's temporary folder (its ``TMPDIR``), exit 0. If SGLang exits on its own, exit with its code.

The work lives in :mod:`dd_sglang.launcher`: SGLang's command line
(:mod:`~dd_sglang.launcher.sglang_argv`, steps 1 and 4), the start-up checks
(:mod:`~dd_sglang.launcher.startup_checks`, steps 2-5) and the processes started and stopped
(:mod:`~dd_sglang.launcher.supervision`, steps 6-8); this module runs them in order.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from dd_sglang.config import ConfigError, DDConfig
from dd_sglang.launcher.sglang_argv import (
    CPU_BIND_ENV,
    DD_FLAGS_HELP,
    build_sglang_argv,
    cpu_threads_bind,
    flag_value,
    has_flag,
    parallel_ranks,
    parse_dd_args,
    preset_words,
    with_cpu_dtype,
)
from dd_sglang.launcher.startup_checks import (
    Refused,
    bind_listening,
    load_preset,
    local_model_error,
    port_error,
    prepare,
)
from dd_sglang.launcher.supervision import (
    PROM_DIR_PREFIX,
    SHUTDOWN_GRACE_S,
    SIDECAR_RESTART_MIN_S,
    TMP_DIR_PREFIX,
    Sidecar,
    announce_when_ready,
    child_setup,
    clean_stale_dirs,
    supervise,
)
from dd_sglang.metrics.health import health_wait_s
from dd_sglang.platform import bounded_cache_env
from dd_sglang.plugin.runtime import CONFIG_ENV

# The launcher's names as tests, bench/ and launch_router knew them before the split.
_bind, _port_error, _local_model_error = bind_listening, port_error, local_model_error
_child_setup, _clean_stale_dirs = child_setup, clean_stale_dirs

__all__ = [
    "CPU_BIND_ENV", "PROM_DIR_PREFIX", "SHUTDOWN_GRACE_S", "SIDECAR_RESTART_MIN_S", "TMP_DIR_PREFIX", "Sidecar",
    "build_sglang_argv", "cpu_threads_bind", "flag_value", "has_flag", "main", "parallel_ranks", "parse_dd_args",
    "preset_words", "with_cpu_dtype",
]  # fmt: skip

logger = logging.getLogger("dd_sglang.launch_server")


def _fail(msg: str) -> int:
    print(f"dd_sglang: error: {msg}", file=sys.stderr)
    return 2


def print_sglang_help() -> int:
    """Print SGLang's own flags with their help, from SGLang's parser (``ServerArgs.add_cli_args``, what
    ``prepare_server_args`` in ``sglang/srt/server_args.py`` builds), after loading SGLang's plugins as
    SGLang does, so that the choices include this project's (``--attention-backend dualdecoder``).
    In this process, not a ``python -m sglang.launch_server --help`` child (the same flags, without that
    entry point's deprecation warning; about the same import time). Returns 0."""
    import argparse

    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs

    load_plugins()
    parser = argparse.ArgumentParser(prog="python -m dd_sglang.launch_server")
    ServerArgs.add_cli_args(parser)
    parser.print_help()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the launcher (module docstring); returns the exit code: 0 after a signal, 2 for a
    refused flag or preset (SGLang's own parser included), 1 when SGLang failed or timed out."""
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(DD_FLAGS_HELP)
        return print_sglang_help()
    dd_args, sglang_argv = parse_dd_args(argv)
    try:
        health_wait_s()  # the sidecar's /healthz wait, from SGLang's own variable: refused before anything starts
    except ValueError as err:
        return _fail(str(err))
    try:
        cfg = load_preset(dd_args)
        full_argv, threads_bind, host, port, metrics_sock = prepare(cfg, sglang_argv)
    except (ConfigError, Refused) as err:
        return _fail(str(err))
    clean_stale_dirs()
    prom_dir = tempfile.mkdtemp(prefix=f"{PROM_DIR_PREFIX}{os.getpid()}_")
    sglang_tmp = tempfile.mkdtemp(prefix=f"{TMP_DIR_PREFIX}{os.getpid()}_")
    try:
        return _serve(cfg, full_argv, threads_bind, host, port, metrics_sock, prom_dir, sglang_tmp)
    finally:
        metrics_sock.close()
        shutil.rmtree(prom_dir, ignore_errors=True)
        shutil.rmtree(sglang_tmp, ignore_errors=True)


def _serve(cfg: DDConfig, full_argv: list[str], threads_bind: str | None, host: str, port: int,
           metrics_sock: socket.socket, prom_dir: str, sglang_tmp: str) -> int:  # fmt: skip
    """Steps 6-8: start SGLang and the sidecar, supervise until a signal, SGLang's exit or the
    start-up timeout, then stop both. Returns the exit code (:func:`main`)."""
    env = dict(os.environ)
    env["PROMETHEUS_MULTIPROC_DIR"] = prom_dir
    env["TMPDIR"] = sglang_tmp  # SGLang's temporary files go with it (TMP_DIR_PREFIX)
    env[CONFIG_ENV] = json.dumps(cfg.model_dump())
    env.pop("SGLANG_USE_CPU_ENGINE", None)
    env.update(bounded_cache_env(env))  # the oneDNN caches keyed by shape, bounded (issue 44)
    if threads_bind is not None:
        env[CPU_BIND_ENV] = threads_bind
    cmd = [sys.executable, "-m", "sglang.launch_server", *full_argv]
    logger.info("starting SGLang: %s", " ".join(cmd))
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=child_setup)

    stop = threading.Event()
    received: list[int] = []

    def on_signal(signum, _frame):
        received.append(signum)
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    m = cfg.metrics
    sglang_url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    sidecar = Sidecar(
        metrics_sock,
        sglang_url=sglang_url,
        multiproc_dir=prom_dir,
        preset=cfg.name,
        api_key=flag_value(full_argv, "--api-key") or flag_value(full_argv, "--admin-api-key"),
    )
    sidecar.start()
    ready = threading.Event()
    threading.Thread(
        target=announce_when_ready,
        args=(sglang_url, f"http://{m.host}:{m.port}", stop, ready, t0),
        daemon=True,
    ).start()
    try:
        rc = supervise(proc, sidecar, stop, ready, t0, cfg.server.start_timeout_s, received)
    finally:
        sidecar.stop()
    logger.info("stopped (exit code %s)", rc)
    return rc


if __name__ == "__main__":
    sys.exit(main())
