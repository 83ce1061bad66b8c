"""The launcher's start-up checks: steps 2-5 of :mod:`dd_sglang.launch_server`.

Every check runs before any SGLang process exists, and a failed one raises :class:`Refused`
with a message for the user (the launcher exits 2). The checks that need neither PyTorch nor
SGLang come first (:func:`prepare`), so such a refusal takes well under a second.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
from pathlib import Path

from dd_sglang.config import DDConfig, load_config
from dd_sglang.launcher.sglang_argv import (
    CPU_BIND_ENV,
    PRESET_OWNED_FLAGS,
    build_sglang_argv,
    cpu_threads_bind,
    flag_value,
    has_flag,
    names_flag,
    parallel_ranks,
    preset_words,
    rope_override_json,
    with_cpu_dtype,
)

logger = logging.getLogger("dd_sglang.launch_server")

def bind_listening(host: str, port: int) -> socket.socket:
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


def port_error(host: str, port: int) -> str | None:
    try:
        bind_listening(host, port).close()
    except OSError as err:
        return f"{host}:{port} is not available ({err.strerror or err})"
    return None


class Refused(Exception):
    """A start-up check failed before any SGLang process exists (the message is for the user)."""


def load_preset(dd_args: argparse.Namespace) -> DDConfig:
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


def local_model_error(path: str) -> str | None:
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
        Refused: a local model path that is neither a folder nor a GGUF file (:func:`local_model_error`);
            the embedded model cannot be prepared.
    """
    user_model = flag_value(sglang_argv, "--model-path") or cfg.model.path
    if user_model and user_model.startswith(("/", "./", "../", "~")) and (err := local_model_error(user_model)):
        raise Refused(f"--model-path / model.path: {err}: {user_model}")
    if has_flag(sglang_argv, "--model-path"):
        return None, None
    if cfg.model.path:
        return cfg.model.path, None
    from dd_sglang.models.smollm2 import SERVED_MODEL_NAME, ModelError, prepare_model

    try:
        return str(prepare_model()), SERVED_MODEL_NAME
    except ModelError as err:
        raise Refused(str(err)) from None


def _rope_override(cfg: DDConfig, sglang_argv: list[str], model_path: str | None) -> str | None:
    """``--json-model-override-args`` for ``model.rope_scaling`` (:func:`rope_override_json`), read from
    the model folder SGLang will load (``--model-path`` on the command line, else ``model_path``).

    Raises:
        Refused: the scaling beside a ``--json-model-override-args`` of the command line or of
            ``server.sglang_args`` (one would silently replace the other), or a model folder without
            the ``config.json`` keys the override needs.
    """
    if cfg.model.rope_scaling is None:
        return None
    if has_flag([*sglang_argv, *preset_words(cfg)], "--json-model-override-args"):
        raise Refused("model.rope_scaling sets SGLang's --json-model-override-args, which the command line or "
                      "server.sglang_args gives too; drop one of them")  # fmt: skip
    try:
        return rope_override_json(cfg.model, flag_value(sglang_argv, "--model-path") or model_path)
    except ValueError as err:
        raise Refused(str(err)) from None


def _check_sglang_args(cfg: DDConfig) -> None:
    """``server.sglang_args`` names none of :data:`PRESET_OWNED_FLAGS` (nor, with ``_`` for ``-``, a
    spelling of one), nor ``--attention-backend`` while ``sparse.enabled`` sets it. Raises
    :class:`Refused` naming the key and the preset key to use instead."""

    def spells(flag: str, word: str) -> bool:  # as SGLang's parser reads it, or with _ for -
        return names_flag(flag, word) or names_flag(flag, word.replace("_", "-"))

    for key, word in zip(cfg.server.sglang_args, preset_words(cfg), strict=True):
        for flag, owner in PRESET_OWNED_FLAGS.items():
            if spells(flag, word):
                raise Refused(f"server.sglang_args: {key!r} names SGLang's {flag}; set {owner} instead")
        if cfg.sparse.enabled and spells("--attention-backend", word):
            raise Refused(f"server.sglang_args: {key!r} names SGLang's --attention-backend, which sparse.enabled: "
                          "true sets (dualdecoder); drop one of them")  # fmt: skip


def _port(argv: list[str], cfg: DDConfig) -> tuple[str, int]:
    """SGLang's ``(host, port)``: ``--host`` / ``--port`` in ``argv``, else the preset's ``server`` section.
    Raises :class:`Refused` for a port outside 1..65535 or an empty ``--host``."""
    host = flag_value(argv, "--host")
    if host is not None and not host.strip():
        raise Refused("--host is empty (SGLang would listen on every interface); give an address, e.g. 127.0.0.1")
    host = host or cfg.server.host
    raw_port = flag_value(argv, "--port")
    raw_port = cfg.server.port if raw_port is None else raw_port  # "--port=" is refused below, not replaced
    try:
        port = int(raw_port)
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise Refused(f"--port must be an integer in 1..65535, got {raw_port!r}")
    return host, port


def _check_dualdecoder(full_argv: list[str], cfg: DDConfig) -> None:
    """The ``dualdecoder`` backend's refusals: flags its sparse path cannot serve, and a host tier
    (plus its int8 key index) larger than the host memory available now.

    Raises:
        Refused: either (the message names the flag or ``sparse.host_tier_bytes``).
    """
    if flag_value(full_argv, "--attention-backend") != "dualdecoder":
        return
    from dd_sglang.kvcache.params import host_memory_available_bytes
    from dd_sglang.prefetch.params import quant_index_bytes_bound

    for flag in ("--enable-mixed-chunk", "--enable-hierarchical-cache"):
        if has_flag(full_argv, flag):
            raise Refused(f"--attention-backend dualdecoder does not support {flag}; drop that flag")
    tier, have = cfg.sparse.host_tier_bytes, host_memory_available_bytes()
    need = tier + quant_index_bytes_bound(tier)
    if need > have:
        raise Refused(
            f"sparse.host_tier_bytes {tier} and its int8 key index (up to {need - tier} bytes) exceed "
            f"the host memory available now ({max(have, 0)} bytes, free memory less a 512 MiB margin); "
            "lower it in the preset (--dd-config)"
        )


def _check_sglang_port(cfg: DDConfig, host: str, port: int) -> None:
    """SGLang's port differs from the metrics port and is free now.

    Raises:
        Refused: either is not so (the message names the flag).
    """
    if cfg.metrics.port == port:
        raise Refused(f"metrics.port {cfg.metrics.port} equals SGLang's --port; choose another --metrics-port")
    if err := port_error(host, port):
        raise Refused(f"SGLang --port: {err}")


def _metrics_socket(cfg: DDConfig) -> socket.socket:
    """Step 5: bind the metrics port (kept by this launcher; SGLang's port was checked by
    :func:`_check_sglang_port`, before the PyTorch imports; :func:`prepare` also binds and
    closes this one there, so a taken metrics port is refused in well under a second too).

    Raises:
        Refused: the metrics port is taken.
    """
    m = cfg.metrics
    try:
        return bind_listening(m.host, m.port)
    except OSError as err:
        raise Refused(f"metrics.port: {m.host}:{m.port} is not available ({err.strerror})") from None


def _check_trace_dir() -> None:
    """``DD_SGLANG_TRACE_DIR`` (:mod:`dd_sglang.prefetch.trace`), where set, must be a directory this
    process can create and write: the scheduler writes traces there mid-step.

    Raises:
        Refused: it cannot be created or written (the variable, the path and the reason named).
    """
    from dd_sglang.kvcache.params import TRACE_DIR_ENV

    raw = os.environ.get(TRACE_DIR_ENV)
    if not raw:
        return
    try:
        os.makedirs(raw, exist_ok=True)
        if not os.access(raw, os.W_OK | os.X_OK):
            raise PermissionError(13, "not writable")
    except OSError as err:
        raise Refused(f"{TRACE_DIR_ENV} must name a directory this server can write, got {raw!r} "
                      f"({err.strerror or err})") from None  # fmt: skip


def prepare(cfg: DDConfig, sglang_argv: list[str]) -> tuple[list[str], str | None, str, int, socket.socket]:
    """Steps 3-5: ``(SGLang's full argv, CPU bind value or None, host, port, metrics socket)``.

    Raises:
        Refused: any start-up check (nothing is started; the socket is bound only when all pass).
    """
    # The checks that need neither PyTorch nor SGLang come first: a refusal among them takes well
    # under a second, where importing PyTorch (below: the switches' modules, the platform) takes 2-10 s.
    _check_sglang_args(cfg)
    model_path, served_name = _model(cfg, sglang_argv)
    host, port = _port(sglang_argv, cfg)  # what build_sglang_argv passes: the flag, else the preset's
    _check_sglang_port(cfg, host, port)
    _metrics_socket(cfg).close()  # a taken metrics port too, before PyTorch; bound for good at the end
    rope = _rope_override(cfg, sglang_argv, model_path)
    from dd_sglang.kvcache.params import HUGE_PAGES_ENV
    from dd_sglang.platform import PREPACK_ENV, ROW_BUCKETS_ENV

    for switch in (PREPACK_ENV, ROW_BUCKETS_ENV, HUGE_PAGES_ENV):  # read again inside SGLang; refused here first
        if os.environ.get(switch, "1").strip() not in ("0", "1"):
            raise Refused(f"{switch} must be 0 or 1, got {os.environ[switch]!r}")
    from dd_sglang.platform.heap import trim_interval_s

    try:
        trim_interval_s()
    except ValueError as err:
        raise Refused(str(err)) from None
    _check_trace_dir()
    # The dualdecoder refusals read flags the CPU platform never adds (--device, --dtype): they are
    # judged on the command line SGLang would get without them, still before PyTorch is imported.
    _check_dualdecoder(build_sglang_argv(cfg, sglang_argv, model_path, cpu=False, served_name=served_name,
                                         rope_override=rope), cfg)  # fmt: skip
    from dd_sglang.platform import activate

    cpu = activate() is not None
    sglang_argv = with_cpu_dtype(sglang_argv, cpu, preset_words(cfg))
    full_argv = build_sglang_argv(cfg, sglang_argv, model_path, cpu=cpu, served_name=served_name, rope_override=rope)
    try:
        ranks = parallel_ranks(full_argv)
    except ValueError as err:
        raise Refused(str(err)) from None
    threads_bind = None
    if cpu and ranks > 1 and CPU_BIND_ENV not in os.environ:
        from sglang.srt.utils.common import get_cpu_ids_by_node

        threads_bind = cpu_threads_bind(ranks, get_cpu_ids_by_node())
        if threads_bind is not None:
            logger.info("%d CPU scheduler processes: %s=%s", ranks, CPU_BIND_ENV, threads_bind)
    return full_argv, threads_bind, host, port, _metrics_socket(cfg)
