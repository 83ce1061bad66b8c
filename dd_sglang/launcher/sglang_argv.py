"""SGLang's command line as the launcher builds it.

The dd flags (``--dd-config``, ``--metrics-port``, ``--metrics-host``) are split off
(:func:`parse_dd_args`); every other flag goes to SGLang unchanged. Flags are read the way
SGLang's argparse reads them: by an alias (``--model`` for ``--model-path``) or an
unambiguous prefix, the last value winning (:func:`flag_value`, :func:`has_flag`). The preset
fills every flag the command line does not give (:func:`build_sglang_argv`), the CPU platform
the ``--dtype`` (:func:`with_cpu_dtype`), and on a CPU with more scheduler processes than NUMA
nodes each gets its own cores (:func:`cpu_threads_bind`).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from dd_sglang.config import DDConfig, ModelSection

logger = logging.getLogger("dd_sglang.launch_server")

DD_FLAGS_HELP = """dd_sglang flags (every other flag goes to SGLang unchanged; SGLang's flags follow):
  --dd-config NAME|PATH   preset in configs/ or a YAML file (default: cpu-smollm2)
  --metrics-port N        metrics sidecar port (default from the preset: 9464). Shadows SGLang's own
  --metrics-host H        --metrics-port/--metrics-host, which serve only its Rust gRPC mode.
  --dd-help               show only these
"""


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


def names_flag(flag: str, arg: str) -> bool:
    """True when command-line word ``arg`` names ``flag``: exactly, by an SGLang alias, or by an
    abbreviation (SGLang's argparse accepts unambiguous prefixes such as ``--max-total-tok``)."""
    if not arg.startswith("--") or len(arg) < 4:
        return False
    name = arg.split("=", 1)[0]
    return any(f == name or f.startswith(name) for f in (flag, *FLAG_ALIASES.get(flag, ())))


#: The one table of preset keys and the SGLang flags they set, in command-line order: ``(key, flag,
#: value, owned)``, ``value`` mapping the key's value to the flag's (None: the flag is not given).
#: :func:`build_sglang_argv` passes each (unless the command line gives the flag); ``server.sglang_args``
#: may not name an ``owned`` one (:data:`PRESET_OWNED_FLAGS`). ``sparse.enabled`` owns
#: ``--attention-backend`` only when true (a preset may pick another backend through ``sglang_args``:
#: ``startup_checks`` refuses the two together). ``model.path`` is passed as the launcher resolves it;
#: ``model.rope_scaling`` (with ``model.rope_factor``) as :func:`rope_override_json` builds it from the
#: model's ``config.json`` (``startup_checks`` refuses it beside a ``--json-model-override-args``).
PRESET_KEY_FLAGS: tuple[tuple[str, str, object, bool], ...] = (
    ("model.path", "--model-path", None, True),
    ("server.host", "--host", None, True),
    ("server.port", "--port", None, True),
    ("server.max_total_tokens", "--max-total-tokens", None, True),
    ("server.context_length", "--context-length", None, True),
    ("server.max_running_requests", "--max-running-requests", None, True),
    ("sparse.enabled", "--attention-backend", lambda on: "dualdecoder" if on else None, False),
    ("model.rope_scaling", "--json-model-override-args", None, False),
)
#: SGLang flags that preset keys of their own set (:data:`PRESET_KEY_FLAGS`): ``server.sglang_args``
#: may not name one, by any spelling SGLang's parser takes (a prefix, an alias), or SGLang would get
#: a second value, and take the last, that the launcher's checks never saw.
PRESET_OWNED_FLAGS = {flag: key for key, flag, _, owned in PRESET_KEY_FLAGS if owned}


def preset_key_value(cfg: DDConfig, key: str) -> object:
    """The value of a dotted preset key (``"server.port"``) in ``cfg``."""
    value: object = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def preset_words(cfg: DDConfig) -> list[str]:
    """The ``--flag`` words that ``server.sglang_args`` adds to SGLang's command line (values left out)."""
    return [f"--{k}" for k in cfg.server.sglang_args]


def flag_value(argv: list[str], flag: str) -> str | None:
    """Value of ``flag`` in ``argv`` (``--flag v`` or ``--flag=v``, aliases and prefixes too); the last wins."""
    value = None
    for i, a in enumerate(argv):
        if not names_flag(flag, a):
            continue
        if "=" in a:
            value = a.split("=", 1)[1]
        elif i + 1 < len(argv):
            value = argv[i + 1]
    return value


def has_flag(argv: list[str], flag: str) -> bool:
    """True when ``flag`` (or an SGLang alias or abbreviation of it) appears in ``argv``."""
    return any(names_flag(flag, a) for a in argv)


def rope_override_json(model: ModelSection, model_dir: str) -> str | None:
    """SGLang's ``--json-model-override-args`` for ``model.rope_scaling`` x ``model.rope_factor``, or
    None when the preset sets no scaling.

    Read from ``model_dir/config.json``: ``max_position_embeddings`` (the trained context, in tokens)
    and ``rope_theta`` (top level, or in transformers 5's ``rope_parameters``). The override replaces
    ``rope_parameters`` (SGLang's Llama reads its RoPE from there: ``sglang/srt/models/llama.py``) with
    ``{rope_theta, rope_type, factor}``; for ``yarn`` it adds ``original_max_position_embeddings`` and
    raises ``max_position_embeddings`` to ``factor x`` the trained context, so that SGLang derives
    that context length (``sglang/srt/utils/hf_transformers/common.py: get_context_length`` scales
    by ``factor`` only without an original length, as for ``dynamic`` and ``linear``).

    Raises:
        ValueError: ``model_dir`` has no readable ``config.json`` (a GGUF file, a hub id), or it lacks
            ``max_position_embeddings`` or ``rope_theta`` (the message names the file and the key).
    """
    if model.rope_scaling is None:
        return None
    path = Path(model_dir).expanduser() / "config.json"
    try:
        hf = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"model.rope_scaling needs the model folder's config.json: {path}: {err}") from None
    theta = (hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta"))
    trained = hf.get("max_position_embeddings")
    for key, value in (("rope_theta", theta), ("max_position_embeddings", trained)):
        if not isinstance(value, (int, float)):
            raise ValueError(f"model.rope_scaling: {path} gives no numeric {key} (got {value!r})")
    params = {"rope_theta": theta, "rope_type": model.rope_scaling, "factor": model.rope_factor}
    override: dict[str, object] = {"rope_parameters": params}
    if model.rope_scaling == "yarn":
        params["original_max_position_embeddings"] = trained
        override["max_position_embeddings"] = int(trained * model.rope_factor)
    return json.dumps(override, sort_keys=True)


def build_sglang_argv(
    cfg: DDConfig, user_argv: list[str], model_path: str | None, cpu: bool, served_name: str | None = None,
    rope_override: str | None = None,
) -> list[str]:
    """SGLang's flags: the user's, then the preset's for every flag the user did not give.

    ``rope_override``: the value of ``--json-model-override-args`` for ``model.rope_scaling``
    (:func:`rope_override_json`; the launcher reads the model folder once).
    ``cpu`` (no CUDA; the dd_sglang CPU platform is active) adds ``--device cpu``:
    SGLang 0.5.23 resolves a missing ``--device`` through a path that expects a
    string from the platform (``srt/utils/common.py: get_device``).

    ``--attention-backend dualdecoder`` (from the user or ``sparse.enabled``) also adds
    ``--radix-cache-backend dualdecoder``, ``--disable-overlap-schedule`` and, on
    CUDA, ``--disable-cuda-graph``, unless given.
    """
    defaults: list[tuple[str, object]] = []
    for key, flag, to_flag, _ in PRESET_KEY_FLAGS:
        value = {"model.path": model_path, "model.rope_scaling": rope_override}.get(key, preset_key_value(cfg, key))
        defaults.append((flag, to_flag(value) if to_flag else value))
    defaults[1:1] = [("--served-model-name", served_name), ("--device", "cpu" if cpu else None)]  # after the model
    defaults += [(f"--{k}", v) for k, v in cfg.server.sglang_args.items()]
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
