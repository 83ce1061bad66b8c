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
"""

from __future__ import annotations

import argparse
import ctypes
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
from pathlib import Path

import httpx

from dd_sglang.config import ConfigError, DDConfig, load_config
from dd_sglang.platform import bounded_cache_env
from dd_sglang.plugin.runtime import CONFIG_ENV

logger = logging.getLogger("dd_sglang.launch_server")

SHUTDOWN_GRACE_S = 20.0
SIDECAR_RESTART_MIN_S = 1.0
PROM_DIR_PREFIX = "dd_sglang_prom_"
#: Prefix of SGLang's private temporary folder (its ``TMPDIR``): SGLang 0.5.23 leaves its ZMQ
#: sockets and port files (``tempfile`` names) behind in the system's temporary folder, six
#: entries a run; they go with this folder when SGLang stops.
TMP_DIR_PREFIX = "dd_sglang_tmp_"
DD_FLAGS_HELP = """dd_sglang flags (every other flag goes to SGLang unchanged; SGLang's flags follow):
  --dd-config NAME|PATH   preset in configs/ or a YAML file (default: cpu-smollm2)
  --metrics-port N        metrics sidecar port (default from the preset: 9464). Shadows SGLang's own
  --metrics-host H        --metrics-port/--metrics-host, which serve only its Rust gRPC mode.
  --dd-help               show only these
"""
_PR_SET_PDEATHSIG = 1


def parse_dd_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Split ``argv`` into dd flags and the untouched SGLang flags."""
    ap = argparse.ArgumentParser(
        prog="python -m dd_sglang.launch_server",
        description="SGLang with dd_sglang. Every sglang.launch_server flag is accepted unchanged.",
        add_help=False,
    )
    ap.add_argument(
        "--dd-config", default=None, help="preset name in configs/ or a YAML path (default cpu-smollm2)"
    )
    ap.add_argument(
        "--metrics-port", type=int, default=None, help="sidecar port (default from the preset: 9464)"
    )
    ap.add_argument("--metrics-host", default=None, help="sidecar host (default from the preset: 127.0.0.1)")
    ap.add_argument("--dd-help", action="help", help="show the dd flags and exit")
    return ap.parse_known_args(argv)


#: SGLang 0.5.23 flag aliases (sglang/srt/arg_groups/fields/model.py: ``--model`` for ``--model-path``).
FLAG_ALIASES = {"--model-path": ("--model",)}


def _names(flag: str, arg: str) -> bool:
    """True when command-line word ``arg`` names ``flag``: exactly, by an SGLang alias, or by an
    abbreviation (SGLang's argparse accepts unambiguous prefixes such as ``--max-total-tok``)."""
    if not arg.startswith("--") or len(arg) < 4:
        return False
    name = arg.split("=", 1)[0]
    return any(f == name or f.startswith(name) for f in (flag, *FLAG_ALIASES.get(flag, ())))


#: SGLang flags that preset keys of their own set (or the launcher derives from them): ``server.sglang_args``
#: may not name one, by any spelling SGLang's parser takes (a prefix, an alias), or SGLang would get
#: a second value, and take the last, that the launcher's checks never saw.
PRESET_OWNED_FLAGS = {
    "--host": "server.host",
    "--port": "server.port",
    "--max-total-tokens": "server.max_total_tokens",
    "--context-length": "server.context_length",
    "--max-running-requests": "server.max_running_requests",
    "--model-path": "model.path",
}


def preset_words(cfg: DDConfig) -> list[str]:
    """The ``--flag`` words that ``server.sglang_args`` adds to SGLang's command line (values left out)."""
    return [f"--{k}" for k in cfg.server.sglang_args]


def flag_value(argv: list[str], flag: str) -> str | None:
    """Value of ``flag`` in ``argv`` (``--flag v`` or ``--flag=v``, aliases and prefixes too); the last wins."""
    value = None
    for i, a in enumerate(argv):
        if not _names(flag, a):
            continue
        if "=" in a:
            value = a.split("=", 1)[1]
        elif i + 1 < len(argv):
            value = argv[i + 1]
    return value


def has_flag(argv: list[str], flag: str) -> bool:
    """True when ``flag`` (or an SGLang alias or abbreviation of it) appears in ``argv``."""
    return any(_names(flag, a) for a in argv)


def build_sglang_argv(
    cfg: DDConfig, user_argv: list[str], model_path: str | None, cpu: bool, served_name: str | None = None
) -> list[str]:
    """SGLang's flags: the user's, then the preset's for every flag the user did not give.

    ``cpu`` (no CUDA; the dd_sglang CPU platform is active) adds ``--device cpu``:
    SGLang 0.5.23 resolves a missing ``--device`` through a path that expects a
    string from the platform (``srt/utils/common.py: get_device``).

    ``--attention-backend dualdecoder`` (from the user or the preset) also adds
    ``--radix-cache-backend dualdecoder``, ``--disable-overlap-schedule`` and, on
    CUDA, ``--disable-cuda-graph``, unless given.
    """
    s = cfg.server
    defaults: list[tuple[str, object]] = [
        ("--model-path", model_path),
        ("--served-model-name", served_name),
        ("--device", "cpu" if cpu else None),
        ("--host", s.host),
        ("--port", s.port),
        ("--max-total-tokens", s.max_total_tokens),
        ("--context-length", s.context_length),
        ("--max-running-requests", s.max_running_requests),
    ]
    defaults += [(f"--{k}", v) for k, v in s.sglang_args.items()]
    out = list(user_argv)
    for flag, value in defaults:
        if value is None or value is False or has_flag(user_argv, flag):
            continue
        out += [flag] if value is True else [flag, str(value)]
    if flag_value(out, "--attention-backend") == "dualdecoder":
        # The sparse path needs its radix cache (host tier, row release) and a
        # scheduler that processes a batch's result before building the next one.
        sparse_flags: list[tuple[str, object]] = [
            ("--radix-cache-backend", "dualdecoder"),
            ("--disable-overlap-schedule", True),
            ("--disable-cuda-graph", None if cpu else True),
        ]
        for flag, value in sparse_flags:
            if value is None or has_flag(out, flag):
                continue
            out += [flag] if value is True else [flag, str(value)]
    return out


def with_cpu_dtype(argv: list[str], cpu: bool, preset: list[str] | None = None) -> list[str]:
    """``argv`` plus ``--dtype`` chosen by the CPU platform when ``cpu`` and neither ``argv`` nor
    ``preset`` (the ``--flag`` words of ``server.sglang_args``, :func:`preset_words`) gives one.

    The choice (:func:`dd_sglang.platform.dtype.default_dtype`: bf16 with native bf16 matrix
    instructions, else float32, measured faster there) is logged once.
    """
    if not cpu or has_flag([*argv, *(preset or [])], "--dtype"):
        return list(argv)
    from dd_sglang.platform.dtype import NATIVE_BF16_FLAGS, default_dtype, native_bf16

    dtype = default_dtype()
    logger.info("dd_sglang: this CPU %s native bf16 (%s): --dtype %s (give --dtype to override)",
                "has" if native_bf16() else "lacks", "/".join(sorted(NATIVE_BF16_FLAGS)), dtype)  # fmt: skip
    return [*argv, "--dtype", dtype]


#: SGLang's CPU thread-binding variable (``sglang/srt/utils/numa_utils.py: init_threads_binding``).
CPU_BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"


def parallel_ranks(argv: list[str]) -> int:
    """Scheduler processes SGLang starts for ``argv``: ``--dp-size x --tp-size x --pp-size`` (1 each by default).

    Raises:
        ValueError: a size that is not an integer >= 1 (the message names the flag).
    """
    n = 1
    for flag in ("--dp-size", "--tp-size", "--pp-size"):
        raw = flag_value(argv, flag) or "1"
        try:
            size = int(raw)
        except ValueError:
            size = 0
        if size < 1:
            raise ValueError(f"{flag} must be an integer >= 1, got {raw!r}")
        n *= size
    return n


def cpu_threads_bind(ranks: int, cpus_by_node: list[str]) -> str | None:
    """A value for :data:`CPU_BIND_ENV` giving each of ``ranks`` CPU scheduler processes its own cores.

    SGLang 0.5.23 on the CPU refuses more ranks (``dp x tp x pp``) than NUMA nodes unless this
    variable lists one ``|``-separated core set per rank (``numa_utils.py: init_threads_binding``).
    ``cpus_by_node`` is SGLang's ``get_cpu_ids_by_node()`` (``["0,1,2,3", "4,5,6,7"]``). Returns
    None when SGLang's default (one NUMA node per rank) already fits. The machine's cores are split
    into ``ranks`` contiguous groups; with fewer cores than ranks, rank ``i`` gets core ``i mod n``.
    """
    if ranks <= len(cpus_by_node):
        return None
    cores = [c for node in cpus_by_node for c in node.split(",") if c]
    if not cores:
        return None
    groups = []
    for i in range(ranks):
        part = cores[i * len(cores) // ranks : (i + 1) * len(cores) // ranks] or [cores[i % len(cores)]]
        groups.append(",".join(part))
    return "|".join(groups)


def _bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (IPv4 or IPv6, as ``host`` resolves). Raises ``OSError``."""
    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    sock.listen(128)
    sock.set_inheritable(False)
    return sock


def _child_setup() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def _port_error(host: str, port: int) -> str | None:
    try:
        _bind(host, port).close()
    except OSError as err:
        return f"{host}:{port} is not available ({err.strerror or err})"
    return None


def _clean_stale_dirs() -> None:
    """Remove metrics and SGLang temporary folders left by launchers that died without cleaning
    up (e.g. SIGKILL)."""
    for prefix in (PROM_DIR_PREFIX, TMP_DIR_PREFIX):
        for d in Path(tempfile.gettempdir()).glob(f"{prefix}*"):
            try:
                pid = int(d.name[len(prefix) :].split("_", 1)[0])
            except ValueError:
                continue
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                shutil.rmtree(d, ignore_errors=True)
            except PermissionError:
                pass


def _fail(msg: str) -> int:
    print(f"dd_sglang: error: {msg}", file=sys.stderr)
    return 2


def _announce_when_ready(
    url: str, metrics_url: str, stop: threading.Event, ready: threading.Event, t0: float
):
    while not stop.wait(1.0):
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                ready.set()
                logger.info(
                    "ready in %.1f s: SGLang %s, metrics %s/metrics", time.monotonic() - t0, url, metrics_url
                )
                return
        except httpx.HTTPError:
            pass


class _Refused(Exception):
    """A start-up check failed before any SGLang process exists (the message is for the user)."""


def _config(dd_args: argparse.Namespace) -> DDConfig:
    """Step 2: the preset, with ``--metrics-port`` / ``--metrics-host`` applied.

    Raises:
        ConfigError: a bad preset or flag value (the message names the key).
    """
    cfg = load_config(dd_args.dd_config)
    overrides = {}
    if dd_args.metrics_port is not None:
        overrides["port"] = dd_args.metrics_port
    if dd_args.metrics_host is not None:
        overrides["host"] = dd_args.metrics_host
    if not overrides:
        return cfg
    from dd_sglang.config import parse_config

    data = cfg.model_dump()
    data["metrics"].update(overrides)
    return parse_config(data, "--metrics-port/--metrics-host")


def _local_model_error(path: str) -> str | None:
    """Why local ``path`` cannot be a model SGLang loads, or None: a folder, or a GGUF file (suffix
    ``.gguf`` or the ``GGUF`` magic, as ``sglang/srt/utils/hf_transformers/common.py: check_gguf_file``)."""
    p = Path(path).expanduser()
    if p.is_dir():
        return None
    if not p.exists():
        return "no such local folder"
    if p.suffix == ".gguf":
        return None
    try:
        with p.open("rb") as f:
            return None if f.read(4) == b"GGUF" else "neither a folder nor a GGUF file"
    except OSError as err:
        return f"cannot read it ({err.strerror})"


def _model(cfg: DDConfig, sglang_argv: list[str]) -> tuple[str | None, str | None]:
    """Step 3: ``(model_path, served_name)`` to add to SGLang's flags (both None when the command
    line gives ``--model-path``); the embedded model is converted on first use.

    Raises:
        _Refused: a local model path that is neither a folder nor a GGUF file (:func:`_local_model_error`);
            the embedded model cannot be prepared.
    """
    user_model = flag_value(sglang_argv, "--model-path") or cfg.model.path
    if user_model and user_model.startswith(("/", "./", "../", "~")) and (err := _local_model_error(user_model)):
        raise _Refused(f"--model-path / model.path: {err}: {user_model}")
    if has_flag(sglang_argv, "--model-path"):
        return None, None
    if cfg.model.path:
        return cfg.model.path, None
    from dd_sglang.models.smollm2 import SERVED_MODEL_NAME, ModelError, prepare_model

    try:
        return str(prepare_model()), SERVED_MODEL_NAME
    except ModelError as err:
        raise _Refused(str(err)) from None


def _check_sglang_args(cfg: DDConfig) -> None:
    """``server.sglang_args`` names none of :data:`PRESET_OWNED_FLAGS` (nor, with ``_`` for ``-``, a
    spelling of one). Raises :class:`_Refused` naming the key and the preset key to use instead."""
    for key, word in zip(cfg.server.sglang_args, preset_words(cfg), strict=True):
        for flag, owner in PRESET_OWNED_FLAGS.items():
            if _names(flag, word) or _names(flag, word.replace("_", "-")):
                raise _Refused(f"server.sglang_args: {key!r} names SGLang's {flag}; set {owner} instead")


def _port(argv: list[str], cfg: DDConfig) -> tuple[str, int]:
    """SGLang's ``(host, port)``: ``--host`` / ``--port`` in ``argv``, else the preset's ``server`` section.
    Raises :class:`_Refused` for a port outside 1..65535 or an empty ``--host``."""
    host = flag_value(argv, "--host")
    if host is not None and not host.strip():
        raise _Refused("--host is empty (SGLang would listen on every interface); give an address, e.g. 127.0.0.1")
    host = host or cfg.server.host
    raw_port = flag_value(argv, "--port")
    raw_port = cfg.server.port if raw_port is None else raw_port  # "--port=" is refused below, not replaced
    try:
        port = int(raw_port)
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise _Refused(f"--port must be an integer in 1..65535, got {raw_port!r}")
    return host, port


def _check_dualdecoder(full_argv: list[str], cfg: DDConfig) -> None:
    """The ``dualdecoder`` backend's refusals: flags its sparse path cannot serve, and a host tier
    (plus its int8 key index) larger than the host memory available now.

    Raises:
        _Refused: either (the message names the flag or ``sparse.host_tier_bytes``).
    """
    if flag_value(full_argv, "--attention-backend") != "dualdecoder":
        return
    from dd_sglang.kvcache.params import host_memory_available_bytes
    from dd_sglang.prefetch.params import quant_index_bytes_bound

    for flag in ("--enable-mixed-chunk", "--enable-hierarchical-cache"):
        if has_flag(full_argv, flag):
            raise _Refused(f"--attention-backend dualdecoder does not support {flag}; drop that flag")
    tier, have = cfg.sparse.host_tier_bytes, host_memory_available_bytes()
    need = tier + quant_index_bytes_bound(tier)
    if need > have:
        raise _Refused(
            f"sparse.host_tier_bytes {tier} and its int8 key index (up to {need - tier} bytes) exceed "
            f"the host memory available now ({max(have, 0)} bytes, free memory less a 512 MiB margin); "
            "lower it in the preset (--dd-config)"
        )


def _check_sglang_port(cfg: DDConfig, host: str, port: int) -> None:
    """SGLang's port differs from the metrics port and is free now.

    Raises:
        _Refused: either is not so (the message names the flag).
    """
    if cfg.metrics.port == port:
        raise _Refused(f"metrics.port {cfg.metrics.port} equals SGLang's --port; choose another --metrics-port")
    if err := _port_error(host, port):
        raise _Refused(f"SGLang --port: {err}")


def _metrics_socket(cfg: DDConfig) -> socket.socket:
    """Step 5: bind the metrics port (kept by this launcher; SGLang's port was checked by
    :func:`_check_sglang_port`, before the PyTorch imports; :func:`_prepare` also binds and
    closes this one there, so a taken metrics port is refused in well under a second too).

    Raises:
        _Refused: the metrics port is taken.
    """
    m = cfg.metrics
    try:
        return _bind(m.host, m.port)
    except OSError as err:
        raise _Refused(f"metrics.port: {m.host}:{m.port} is not available ({err.strerror})") from None


def _prepare(cfg: DDConfig, sglang_argv: list[str]) -> tuple[list[str], str | None, str, int, socket.socket]:
    """Steps 3-5: ``(SGLang's full argv, CPU bind value or None, host, port, metrics socket)``.

    Raises:
        _Refused: any start-up check (nothing is started; the socket is bound only when all pass).
    """
    # The checks that need neither PyTorch nor SGLang come first: a refusal among them takes well
    # under a second, where importing PyTorch (below: the switches' modules, the platform) takes 2-10 s.
    _check_sglang_args(cfg)
    model_path, served_name = _model(cfg, sglang_argv)
    host, port = _port(sglang_argv, cfg)  # what build_sglang_argv passes: the flag, else the preset's
    _check_sglang_port(cfg, host, port)
    _metrics_socket(cfg).close()  # a taken metrics port too, before PyTorch; bound for good at the end
    from dd_sglang.kvcache.params import HUGE_PAGES_ENV
    from dd_sglang.platform import PREPACK_ENV

    for switch in (PREPACK_ENV, HUGE_PAGES_ENV):  # read again inside SGLang; refused here first
        if os.environ.get(switch, "1").strip() not in ("0", "1"):
            raise _Refused(f"{switch} must be 0 or 1, got {os.environ[switch]!r}")
    # The dualdecoder refusals read flags the CPU platform never adds (--device, --dtype): they are
    # judged on the command line SGLang would get without them, still before PyTorch is imported.
    _check_dualdecoder(build_sglang_argv(cfg, sglang_argv, model_path, cpu=False, served_name=served_name), cfg)
    from dd_sglang.platform import activate

    cpu = activate() is not None
    sglang_argv = with_cpu_dtype(sglang_argv, cpu, preset_words(cfg))
    full_argv = build_sglang_argv(cfg, sglang_argv, model_path, cpu=cpu, served_name=served_name)
    try:
        ranks = parallel_ranks(full_argv)
    except ValueError as err:
        raise _Refused(str(err)) from None
    threads_bind = None
    if cpu and ranks > 1 and CPU_BIND_ENV not in os.environ:
        from sglang.srt.utils.common import get_cpu_ids_by_node

        threads_bind = cpu_threads_bind(ranks, get_cpu_ids_by_node())
        if threads_bind is not None:
            logger.info("%d CPU scheduler processes: %s=%s", ranks, CPU_BIND_ENV, threads_bind)
    return full_argv, threads_bind, host, port, _metrics_socket(cfg)


def main(argv: list[str] | None = None) -> int:
    """Run the launcher (module docstring); returns the exit code: 0 after a signal, 2 for a
    refused flag or preset (SGLang's own parser included), 1 when SGLang failed or timed out."""
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(DD_FLAGS_HELP)
        return subprocess.call([sys.executable, "-m", "sglang.launch_server", "--help"])
    dd_args, sglang_argv = parse_dd_args(argv)
    try:
        cfg = _config(dd_args)
        full_argv, threads_bind, host, port, metrics_sock = _prepare(cfg, sglang_argv)
    except (ConfigError, _Refused) as err:
        return _fail(str(err))
    _clean_stale_dirs()
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
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_child_setup)

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
        health_timeout_s=m.health_timeout_s,
        preset=cfg.name,
        api_key=flag_value(full_argv, "--api-key") or flag_value(full_argv, "--admin-api-key"),
    )
    sidecar.start()
    ready = threading.Event()
    threading.Thread(
        target=_announce_when_ready,
        args=(sglang_url, f"http://{m.host}:{m.port}", stop, ready, t0),
        daemon=True,
    ).start()
    try:
        rc = _supervise(proc, sidecar, stop, ready, t0, cfg.server.start_timeout_s, received)
    finally:
        sidecar.stop()
    logger.info("stopped (exit code %s)", rc)
    return rc


def _supervise(proc: subprocess.Popen, sidecar: Sidecar, stop: threading.Event, ready: threading.Event,
               t0: float, start_timeout: float, received: list[int]) -> int:  # fmt: skip
    """Wait for a signal (``stop``), SGLang's exit or the start-up timeout (seconds from ``t0``,
    monotonic), restarting a dead sidecar; then stop SGLang's process group. Returns the exit code."""
    timed_out = False
    while proc.poll() is None and not stop.wait(0.5):
        sidecar.restart_if_dead()
        if not ready.is_set() and time.monotonic() - t0 > start_timeout:
            timed_out = True
            logger.error(
                "SGLang not healthy after %.0f s (server.start_timeout_s); stopping it", start_timeout
            )
            break

    rc = proc.poll()
    if timed_out:
        stop.set()
        _stop_group(proc)
        return 1
    if rc is None:
        logger.info(
            "signal %s: stopping SGLang (process group %d)", received[0] if received else "?", proc.pid
        )
        _stop_group(proc)
        return 0
    stop.set()
    logger.error("SGLang exited with code %s", rc)
    _stop_group(proc)  # reap anything its processes left behind
    if rc == 2 and not ready.is_set():
        # argparse's usage error: SGLang's own parser refused a flag (its message is above),
        # before any engine process started. A bad flag is exit code 2, as for dd's own.
        logger.error("SGLang refused its command line; nothing was started")
        return 2
    return 1  # SGLang died on its own (a crash, an OOM kill): one code, its own is in the log


class Sidecar:
    """The metrics sidecar child process (:mod:`dd_sglang.metrics.sidecar`), supervised.

    It serves on ``sock``, a listening socket this launcher bound and keeps open, so a
    restarted sidecar takes over the same port without a gap in which another process
    could bind it; connections made while it restarts wait in the socket's backlog.

    Args:
        sock: the listening metrics socket (handed to the child by file descriptor).
        sglang_url, multiproc_dir, health_timeout_s, preset: see
            :func:`dd_sglang.metrics.sidecar.create_app`.
        api_key: protects ``/stats``; passed through the environment, not the command line.
    """

    def __init__(
        self,
        sock: socket.socket,
        *,
        sglang_url: str,
        multiproc_dir: str,
        health_timeout_s: float,
        preset: str,
        api_key: str | None,
    ):
        from dd_sglang.metrics.sidecar import API_KEY_ENV

        self.sock = sock
        self.cmd = [
            sys.executable, "-m", "dd_sglang.metrics.sidecar", "--fd", str(sock.fileno()),
            "--sglang-url", sglang_url, "--multiproc-dir", multiproc_dir,
            "--health-timeout-s", str(health_timeout_s), "--preset", preset,
        ]  # fmt: skip
        self.env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
        if api_key:
            self.env[API_KEY_ENV] = api_key
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self._started_at = 0.0

    def start(self) -> None:
        self._started_at = time.monotonic()
        self.proc = subprocess.Popen(
            self.cmd,
            env=self.env,
            pass_fds=(self.sock.fileno(),),
            start_new_session=True,  # a terminal's Ctrl-C reaches the launcher, which stops it in order
            preexec_fn=_child_setup,
        )

    def restart_if_dead(self) -> None:
        """Start a new sidecar if the current one exited (rate-limited)."""
        if self.proc is None or self.proc.poll() is None:
            return
        if time.monotonic() - self._started_at < SIDECAR_RESTART_MIN_S:
            return
        self.restarts += 1
        logger.warning(
            "metrics sidecar (pid %d) exited with code %s; restarting it (restart %d)",
            self.proc.pid, self.proc.returncode, self.restarts,
        )  # fmt: skip
        self.start()

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM the sidecar, SIGKILL it after ``timeout`` seconds."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


#: Seconds the rest of SGLang's process group gets once its main process has exited. A main
#: process that stopped normally has stopped its children already; one killed before its
#: signal handlers were installed (a stop during start-up) leaves them running.
ORPHAN_GRACE_S = 1.0


def _wait_group(proc: subprocess.Popen, seconds: float) -> bool:
    """Wait up to ``seconds`` for SGLang's whole process group to exit; True if it did. Gives up
    early, :data:`ORPHAN_GRACE_S` after SGLang's main process exited with the group still alive."""
    deadline = time.monotonic() + seconds
    exited = None
    while time.monotonic() < deadline:
        if not _group_alive(proc.pid):
            return True
        if proc.poll() is not None:
            exited = exited or time.monotonic()
            if time.monotonic() - exited > ORPHAN_GRACE_S:
                return False
        time.sleep(0.2)
    return False


def _stop_group(proc: subprocess.Popen) -> None:
    """Stop SGLang: SIGTERM to its main process (which stops its own scheduler and
    detokenizer), then SIGTERM to the whole group, then SIGKILL, each after
    :data:`SHUTDOWN_GRACE_S` seconds at most."""
    pgid = proc.pid
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        if _wait_group(proc, SHUTDOWN_GRACE_S):
            return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        if _wait_group(proc, SHUTDOWN_GRACE_S):
            return


if __name__ == "__main__":
    sys.exit(main())
