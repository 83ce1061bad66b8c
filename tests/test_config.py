"""Preset validation, and the launcher refusing a bad preset before SGLang starts."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from pydantic import BaseModel

from dd_sglang.config import (
    CONFIGS_DIR,
    ConfigError,
    DDConfig,
    ExperimentalSection,
    load_config,
    parse_config,
)
from dd_sglang.launch_server import build_sglang_argv, flag_value, parse_dd_args


def test_default_preset_loads_and_caps_kv_pool():
    cfg = load_config()
    assert cfg.name == "cpu-smollm2"
    assert cfg.server.host == "127.0.0.1"
    assert cfg.metrics.host == "127.0.0.1"
    assert cfg.server.max_total_tokens == 16384
    assert cfg.model.path is None


def test_every_shipped_preset_validates():
    presets = sorted(CONFIGS_DIR.glob("*.yaml"))
    assert presets
    for p in presets:
        load_config(p)


@pytest.mark.parametrize(
    "data,needles",
    [
        ({"server": {"prot": 1}}, ["unknown key 'server.prot'"]),
        ({"bogus": 1}, ["unknown key 'bogus'"]),
        ({"server": {"port": 70000}}, ["server.port", "le 65535", "70000"]),
        ({"server": {"max_total_tokens": 10}}, ["server.max_total_tokens", "ge 256"]),
        ({"metrics": {"update_interval_s": 0}}, ["metrics.update_interval_s", "ge 0.01"]),
        ({"server": {"port": "abc"}}, ["server.port", "integer"]),
        ({"sparse": {"page_size": 0}}, ["sparse.page_size", "ge 1"]),
        ({"sparse": {"host_tier_bytes": 1000}}, ["sparse.host_tier_bytes", "ge 1048576"]),
        ({"sparse": {"n_recent": 0}}, ["sparse.n_recent", "ge 1"]),
        ({"sparse": {"keep_signal": "key_norm"}}, ["unknown key 'sparse.keep_signal'"]),
        ({"prefetch": {"select": "worker"}}, ["unknown key 'prefetch.select'"]),
        ({"experimental": {"kernel": "cuda"}}, ["experimental.kernel", "'native'", "cuda"]),
        ({"experimental": {"branches": 2}}, ["unknown key 'experimental.branches'"]),
        ({"experimental": {"sampling": "independent"}}, ["unknown key 'experimental.sampling'"]),
        ({"experimental": {"request_overrides": True}}, ["unknown key 'experimental.request_overrides'"]),
        ({"experimental": {"miss_policy": "use_prefetched"}}, ["unknown key 'experimental.miss_policy'"]),
        ({"experimental": {"speculator": "ngram"}}, ["unknown key 'experimental.speculator'"]),
        ({"sparse": {"request_selectors": ["psychic"]}}, ["sparse.request_selectors.0", "'quest_device'", "psychic"]),
        ({"sparse": {"request_selectors": ["oracle", "oracle"]}}, ["sparse.request_selectors", "names a selector twice"]),
        ({"sparse": {"request_max_top_k": 0}}, ["sparse.request_max_top_k", "ge 1"]),
        ({"sparse": {"top_k": 512, "request_max_top_k": 256}},
         ["key 'sparse.request_max_top_k': Value error, is below sparse.top_k (512)", "got 256"]),
        ({"sparse": {"request_max_top_k": "512"}}, ["sparse.request_max_top_k", "valid integer", "got '512'"]),
        ({"sparse": {"request_max_top_k": True}}, ["sparse.request_max_top_k", "valid integer", "got True"]),
        ({"sparse": {"min_sparse_len": True}}, ["sparse.min_sparse_len", "valid integer"]),
        ({"sparse": {"policy": "lazy"}}, ["sparse.policy", "'always'", "'pressure'", "lazy"]),
        ({"sparse": {"policy": "Pressure"}}, ["sparse.policy", "'always'", "'pressure'", "Pressure"]),
        ({"server": {"max_total_tokens": "4096"}}, ["server.max_total_tokens", "valid integer"]),
        ({"metrics": {"update_interval_s": "fast"}}, ["metrics.update_interval_s", "valid number"]),
    ],
)
def test_bad_values_name_the_key_and_range(data, needles):
    with pytest.raises(ConfigError) as e:
        parse_config(data, "test")
    for n in needles:
        assert n in str(e.value)


#: Most preset keys an operator meets: every leaf key outside the ``experimental`` section.
SHIPPED_KEYS_MAX = 29  # 27, plus model.rope_scaling and model.rope_factor (issue 54: contexts past the trained one)


def _leaf_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, field in model.model_fields.items():
        sub = field.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            out += _leaf_keys(sub, f"{prefix}{name}.")
        else:
            out.append(prefix + name)
    return out


def test_the_shipped_schema_stays_small():
    """The schema an operator reads holds at most SHIPPED_KEYS_MAX keys; experiment switches live
    under ``experimental`` only, and no measured loser is back among the shipped keys."""
    shipped = [k for k in _leaf_keys(DDConfig) if not k.startswith("experimental.")]
    assert len(shipped) <= SHIPPED_KEYS_MAX, shipped
    assert len(shipped) == 29  # name, model 3 (path, rope_scaling, rope_factor), server 8, metrics 3, sparse 11, prefetch 3
    moved = {"transfer", "select", "gather", "kernel", "n_keep", "first_level_tokens"}
    deleted = {"keep_signal", "speculator", "miss_policy", "branches", "confident", "sampling", "request_overrides"}
    assert {k.rsplit(".", 1)[-1] for k in shipped} & (moved | deleted) == set()
    assert moved == set(ExperimentalSection.model_fields)


def test_no_shipped_preset_sets_an_experimental_key():
    import yaml

    for p in sorted(CONFIGS_DIR.glob("*.yaml")):
        assert "experimental" not in (yaml.safe_load(p.read_text()) or {}), p.name


def test_the_runtime_settings_are_the_presets():
    """``PrefetchParams`` / ``SparseParams`` take every value from the preset's sections (``prefetch`` and
    ``experimental``; ``sparse`` and ``experimental.n_keep``), whichever section a key lives in, and
    default to the schema's defaults."""
    from dataclasses import asdict

    from dd_sglang.kvcache.params import SparseParams
    from dd_sglang.prefetch.params import PrefetchParams

    cfg = parse_config({"prefetch": {"depth": 3, "rerank": 4.0},
                        "experimental": {"kernel": "torch", "select": "split", "n_keep": 5},
                        "sparse": {"top_k": 64, "request_max_top_k": 128}})  # fmt: skip
    p = PrefetchParams.from_config(cfg)
    assert (p.depth, p.rerank, p.kernel, p.select) == (3, 4.0, "torch", "split")
    assert asdict(PrefetchParams()) == asdict(PrefetchParams.from_config(DDConfig()))
    s = SparseParams.from_config(cfg, host_tier_bytes=4096 * 1024)
    assert (s.top_k, s.request_max_top_k, s.n_keep, s.host_tier_bytes, s.n_recent) == (64, 128, 5, 4096 * 1024, 128)


def test_the_schemas_selector_names_are_the_registrys():
    """``sparse.selector`` / ``sparse.request_selectors`` accept exactly the selectors that exist."""
    from typing import get_args

    from dd_sglang.config import SelectorName
    from dd_sglang.prefetch.selectors import SELECTORS

    assert sorted(get_args(SelectorName)) == sorted(SELECTORS)


def test_top_level_must_be_mapping():
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        parse_config([1, 2], "test")


def test_missing_preset_lists_known_ones():
    with pytest.raises(ConfigError, match="cpu-smollm2"):
        load_config("no-such-preset")


def test_invalid_yaml(tmp_path):
    p = tmp_path / "x.yaml"
    p.write_text("server: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(p)


def test_command_line_wins_over_preset():
    cfg = DDConfig()
    argv = build_sglang_argv(
        cfg, ["--port", "1234", "--max-total-tokens=999"], "/m", cpu=True, served_name="s"
    )
    assert flag_value(argv, "--port") == "1234"
    assert flag_value(argv, "--max-total-tokens") == "999"
    assert argv.count("--port") == 1
    assert flag_value(argv, "--host") == "127.0.0.1"
    assert flag_value(argv, "--model-path") == "/m"
    assert flag_value(argv, "--device") == "cpu"
    assert "--device" not in build_sglang_argv(cfg, [], "/m", cpu=False)


def test_model_alias_counts_as_model_path():
    argv = build_sglang_argv(DDConfig(), ["--model", "/mine"], None, cpu=False)
    assert "--model-path" not in argv and flag_value(argv, "--model-path") == "/mine"


def test_preset_sglang_args_switches():
    cfg = parse_config(
        {"server": {"sglang_args": {"enable-metrics": True, "disable-radix-cache": False, "x-y": 3}}}
    )
    argv = build_sglang_argv(cfg, [], None, cpu=False)
    assert "--enable-metrics" in argv and "--disable-radix-cache" not in argv
    assert flag_value(argv, "--x-y") == "3"
    assert "--model-path" not in argv


def test_dd_flags_are_split_from_sglang_flags():
    dd, rest = parse_dd_args(["--dd-config", "p", "--metrics-port", "9", "--tp", "2", "--model-path", "/x"])
    assert dd.dd_config == "p" and dd.metrics_port == 9
    assert rest == ["--tp", "2", "--model-path", "/x"]


@pytest.mark.parametrize(
    "yaml_text,needle",
    [
        ("server:\n  port: 0\n", "server.port"),
        ("server:\n  maxtokens: 5\n", "unknown key 'server.maxtokens'"),
        ("sparse:\n  request_max_top_k: 100\n", "key 'sparse.request_max_top_k': Value error, is below sparse.top_k (256)"),
        ("sparse:\n  policy: lazy\n", "sparse.policy"),
    ],
)
def test_launcher_rejects_bad_preset_before_sglang_starts(tmp_path, yaml_text, needle):
    p = tmp_path / "bad.yaml"
    p.write_text(yaml_text)
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "dd_sglang.launch_server", "--dd-config", str(p)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert needle in r.stderr
    assert "starting SGLang" not in r.stderr + r.stdout
    assert time.monotonic() - t0 < 60


def test_launcher_refuses_a_host_tier_larger_than_host_memory(tmp_path):
    p = tmp_path / "huge.yaml"
    p.write_text("sparse:\n  host_tier_bytes: 1125899906842624\n")  # 1 PiB
    r = _refused_before_torch("--dd-config", str(p), "--attention-backend", "dualdecoder", "--model-path", str(tmp_path))
    assert "sparse.host_tier_bytes 1125899906842624 and its int8 key index" in r.stderr
    assert "exceed the host memory available" in r.stderr


#: Runs the launcher's ``main`` on ``sys.argv[1:]``, then prints whether PyTorch was imported.
_MAIN_THEN_TORCH = (
    "import sys; from dd_sglang.launch_server import main; rc = main(sys.argv[1:]); "
    "print('torch imported:', 'torch' in sys.modules); sys.exit(rc)"
)


def _refused_before_torch(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The launcher run with ``args`` (and ``env`` added to the environment): it must exit 2 without
    having imported PyTorch (the checks that need neither PyTorch nor SGLang come first, so such a
    refusal takes well under a second)."""
    import os

    r = subprocess.run([sys.executable, "-c", _MAIN_THEN_TORCH, *args], capture_output=True, text=True,
                       timeout=120, env={**os.environ, **(env or {})})  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    assert "torch imported: False" in r.stdout, r.stdout
    assert "starting SGLang" not in r.stderr
    return r


@pytest.mark.parametrize("port", ["99999", "0", "abc", ""])
def test_launcher_rejects_bad_sglang_port(port, tmp_path):
    r = _refused_before_torch(f"--port={port}", "--model-path", str(tmp_path))
    assert "--port must be an integer in 1..65535" in r.stderr


@pytest.mark.parametrize(
    "key,flag,owner",
    [("port", "--port", "server.port"), ("por", "--port", "server.port"), ("hos", "--host", "server.host"),
     ("model", "--model-path", "model.path"), ("model_path", "--model-path", "model.path"),
     ("max_total_tokens", "--max-total-tokens", "server.max_total_tokens")],
)  # fmt: skip
def test_sglang_args_may_not_name_a_flag_the_preset_owns(tmp_path, key, flag, owner):
    """``server.sglang_args`` cannot spell, in any way SGLang's parser takes (a prefix, the ``--model``
    alias, ``_`` for ``-``), a flag that preset keys of their own set: SGLang takes the last value given,
    so the launcher would check one port (or model folder) while SGLang used the other."""
    p = tmp_path / "preset.yaml"
    p.write_text(f"server:\n  sglang_args:\n    {key}: 31000\n")
    r = _refused_before_torch("--dd-config", str(p), "--model-path", str(tmp_path))
    assert f"server.sglang_args: {key!r} names SGLang's {flag}; set {owner} instead" in r.stderr


def test_dtype_in_sglang_args_is_the_dtype_sglang_gets():
    """A preset's ``sglang_args: {dtype: ...}`` wins over the CPU platform's choice, as ``--dtype`` does."""
    from dd_sglang.launch_server import preset_words, with_cpu_dtype

    cfg = parse_config({"server": {"sglang_args": {"dtype": "float32"}}}, "test")
    argv = with_cpu_dtype(["--x"], True, preset_words(cfg))
    assert argv == ["--x"]
    assert flag_value(build_sglang_argv(cfg, argv, "/m", cpu=True), "--dtype") == "float32"
    assert flag_value(with_cpu_dtype(["--x"], True, []), "--dtype") in ("bfloat16", "float32")


def test_a_bad_sglang_health_check_timeout_is_refused_before_sglang_starts(tmp_path):
    """The sidecar's ``/healthz`` waits SGLang's own ``SGLANG_HEALTH_CHECK_TIMEOUT`` (plus a second): a value
    SGLang could not read stops the launcher before anything starts, naming the variable."""
    r = _refused_before_torch("--model-path", str(tmp_path), env={"SGLANG_HEALTH_CHECK_TIMEOUT": "soon"})
    assert "SGLANG_HEALTH_CHECK_TIMEOUT must be a positive integer (seconds), got 'soon'" in r.stderr


@pytest.mark.parametrize("host", [["--host="], ["--host", ""], ["--host", " "]])
def test_an_empty_host_is_refused(tmp_path, host):
    """An empty ``--host`` would make SGLang listen on every interface while the launcher checked the preset's."""
    r = _refused_before_torch(*host, "--model-path", str(tmp_path))
    assert "--host is empty" in r.stderr


def test_a_preset_that_is_not_utf8_is_a_config_error(tmp_path):
    p = tmp_path / "binary.yaml"
    p.write_bytes(b"server:\n  port: \xff\xfe\n")
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        load_config(p)


def test_launcher_rejects_busy_metrics_port(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "dd_sglang.launch_server",
                "--metrics-port",
                str(port),
                "--model-path",
                str(tmp_path),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert r.returncode == 2
    assert "metrics.port" in r.stderr and "starting SGLang" not in r.stderr


def test_abbreviated_sglang_flag_counts_as_given():
    argv = build_sglang_argv(DDConfig(), ["--max-total-tok", "5000"], "/m", cpu=False)
    assert "--max-total-tokens" not in argv
    assert flag_value(argv, "--max-total-tokens") == "5000"


@pytest.fixture(scope="module")
def sglang_cli(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """The two launcher runs that reach SGLang's own parser (``--help``; a flag SGLang refuses), started
    at once: each spends most of its 20-50 s importing SGLang on one core, so side by side they take
    about the time of one. Keys ``help`` and ``bogus``."""
    from harness.server import free_port

    model = tmp_path_factory.mktemp("model")
    argvs = {
        "help": ["--port", "1", "--help"],
        "bogus": ["--model-path", str(model), "--port", str(free_port()), "--metrics-port", str(free_port()),
                  "--bogus-flag", "3"],
    }
    procs = {
        k: subprocess.Popen([sys.executable, "-m", "dd_sglang.launch_server", *a], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
        for k, a in argvs.items()
    }
    out = {}
    try:
        for k, p in procs.items():
            stdout, stderr = p.communicate(timeout=300)
            out[k] = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def test_help_passes_through_without_starting_anything(sglang_cli):
    r = sglang_cli["help"]
    assert r.returncode == 0
    assert "dd_sglang flags" in r.stdout and "--model-path" in r.stdout
    assert "starting SGLang" not in r.stderr


def test_same_port_for_api_and_metrics_is_refused_whatever_the_host_spelling(tmp_path):
    r = _refused_before_torch(
        "--host", "localhost", "--port", "32199", "--metrics-port", "32199", "--model-path", str(tmp_path)
    )
    assert "equals SGLang's --port" in r.stderr


def test_a_flag_sglang_refuses_exits_2_with_sglangs_message(sglang_cli):
    """SGLang's own parser judges SGLang's flags (no hand-written flag table here): its usage error
    becomes the launcher's exit code 2, and nothing is left running."""
    r = sglang_cli["bogus"]
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-2000:]
    assert "unrecognized arguments: --bogus-flag 3" in out and "refused its command line" in out


def test_missing_local_model_path_fails_fast():
    r = _refused_before_torch("--model-path", "/nonexistent/model")
    assert "no such local folder: /nonexistent/model" in r.stderr
    r = _refused_before_torch("--model-path", "/etc/hostname")  # a file, not GGUF
    assert "neither a folder nor a GGUF file: /etc/hostname" in r.stderr


def test_a_gguf_file_passes_the_model_path_check(tmp_path):
    """SGLang loads a GGUF file given as ``--model-path``; the launcher's check lets one through (by its
    magic or suffix) and refuses other files."""
    from dd_sglang.launch_server import _local_model_error

    (tmp_path / "m.bin").write_bytes(b"GGUF\x03\x00\x00\x00")
    (tmp_path / "m.gguf").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("x")
    assert _local_model_error(str(tmp_path / "m.bin")) is None
    assert _local_model_error(str(tmp_path / "m.gguf")) is None
    assert _local_model_error(str(tmp_path)) is None
    assert _local_model_error(str(tmp_path / "notes.txt")) == "neither a folder nor a GGUF file"
    assert _local_model_error(str(tmp_path / "absent")) == "no such local folder"


def test_unusable_cache_folder_is_a_clear_error(tmp_path):
    f = tmp_path / "a-file"
    f.write_text("x")
    r = _refused_before_torch(env={"DD_SGLANG_CACHE": str(f)})
    assert "DD_SGLANG_CACHE" in r.stderr and "Traceback" not in r.stderr


def test_stale_folders_of_dead_launchers_are_removed(tmp_path, monkeypatch):
    """Metrics folders and SGLang temporary folders of launchers no longer alive go; a live one's stay."""
    import os
    import tempfile

    from dd_sglang import launch_server as ls

    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    for prefix in (ls.PROM_DIR_PREFIX, ls.TMP_DIR_PREFIX):
        dead = tmp_path / f"{prefix}999999999_abc"
        live = tmp_path / f"{prefix}{os.getpid()}_abc"
        dead.mkdir()
        live.mkdir()
        ls._clean_stale_dirs()
        assert not dead.exists() and live.exists()


def test_dualdecoder_backend_brings_its_radix_cache_and_scheduler_flags():
    argv = build_sglang_argv(DDConfig(), ["--attention-backend", "dualdecoder"], "/m", cpu=True)
    assert flag_value(argv, "--radix-cache-backend") == "dualdecoder"
    assert "--disable-overlap-schedule" in argv and "--disable-cuda-graph" not in argv
    gpu = build_sglang_argv(DDConfig(), ["--attention-backend=dualdecoder"], "/m", cpu=False)
    assert "--disable-cuda-graph" in gpu
    assert "--radix-cache-backend" not in build_sglang_argv(DDConfig(), [], "/m", cpu=True)


def test_the_sparse_path_is_a_preset_key_and_the_flag_still_wins():
    """``sparse.enabled: true`` gives SGLang ``--attention-backend dualdecoder`` and the flags it brings;
    a command-line ``--attention-backend`` wins over the key either way; false adds nothing."""
    on = DDConfig.model_validate({"sparse": {"enabled": True}})
    argv = build_sglang_argv(on, [], "/m", cpu=True)
    assert flag_value(argv, "--attention-backend") == "dualdecoder"
    assert flag_value(argv, "--radix-cache-backend") == "dualdecoder" and "--disable-overlap-schedule" in argv
    dense = build_sglang_argv(on, ["--attention-backend", "torch_native"], "/m", cpu=True)
    assert flag_value(dense, "--attention-backend") == "torch_native" and "--radix-cache-backend" not in dense
    assert "--attention-backend" not in build_sglang_argv(DDConfig(), [], "/m", cpu=True)


def test_sparse_enabled_and_an_attention_backend_in_sglang_args_are_refused_together(tmp_path):
    """``sparse.enabled: true`` sets ``--attention-backend``; naming it again in ``server.sglang_args``
    stops the launcher (exit 2) naming both. Without ``sparse.enabled`` a preset may pick any backend there."""
    p = tmp_path / "preset.yaml"
    p.write_text("sparse:\n  enabled: true\nserver:\n  sglang_args:\n    attention-backend: triton\n")
    r = _refused_before_torch("--dd-config", str(p), "--model-path", str(tmp_path))
    assert "server.sglang_args: 'attention-backend' names SGLang's --attention-backend, which sparse.enabled" in r.stderr
    other = DDConfig.model_validate({"server": {"sglang_args": {"attention-backend": "triton"}}})
    assert flag_value(build_sglang_argv(other, [], "/m", cpu=True), "--attention-backend") == "triton"


def test_value_lists_and_ranges_come_from_the_schema():
    """The runtime's lists of allowed values are the schema's own declarations, not copies."""
    from typing import get_args

    from dd_sglang.config import PathPolicy, SparseSection
    from dd_sglang.kvcache.dualpath import PATH_POLICIES
    from dd_sglang.kvcache.params import TOP_K_RANGE

    assert PATH_POLICIES == get_args(PathPolicy) == ("always", "pressure")
    top_k = {type(m).__name__: m for m in SparseSection.model_fields["top_k"].metadata}
    assert TOP_K_RANGE == (top_k["Ge"].ge, top_k["Le"].le) == (1, 1_000_000)


@pytest.mark.parametrize("flag", ["--enable-mixed-chunk", "--enable-hierarchical-cache"])
def test_launcher_refuses_flags_the_sparse_path_cannot_serve(flag, tmp_path):
    r = _refused_before_torch("--attention-backend", "dualdecoder", flag, "--model-path", str(tmp_path))
    assert f"--attention-backend dualdecoder does not support {flag}" in r.stderr


def test_the_preset_can_name_a_flag_the_sparse_path_cannot_serve(tmp_path):
    """The refusal reads the preset's ``server.sglang_args`` too (they reach SGLang's command line)."""
    p = tmp_path / "p.yaml"
    p.write_text("sparse:\n  enabled: true\nserver:\n  sglang_args:\n    enable-mixed-chunk: true\n")
    r = _refused_before_torch("--dd-config", str(p), "--model-path", str(tmp_path))
    assert "--attention-backend dualdecoder does not support --enable-mixed-chunk" in r.stderr


@pytest.mark.parametrize("switch", ["DD_SGLANG_CPU_PREPACK", "DD_SGLANG_CPU_ROW_BUCKETS", "DD_SGLANG_HOST_HUGE_PAGES"])
def test_launcher_refuses_a_bad_on_off_switch(tmp_path, switch):
    """DD_SGLANG_CPU_PREPACK, DD_SGLANG_CPU_ROW_BUCKETS and DD_SGLANG_HOST_HUGE_PAGES take 0 or 1; anything else stops before
    SGLang starts (exit 2), naming the variable."""
    r = _refused_before_torch("--model-path", str(tmp_path), env={switch: "false"})
    assert f"{switch} must be 0 or 1, got 'false'" in r.stderr + r.stdout


@pytest.mark.parametrize("value", ["-1", "soon", "nan", "3601"])
def test_launcher_refuses_a_bad_heap_trim_interval(tmp_path, value):
    """DD_SGLANG_CPU_HEAP_TRIM_S takes seconds in [0, 3600]; anything else stops before SGLang
    starts, naming the variable and the range."""
    r = _refused_before_torch("--model-path", str(tmp_path), env={"DD_SGLANG_CPU_HEAP_TRIM_S": value})
    assert f"DD_SGLANG_CPU_HEAP_TRIM_S must be seconds in [0, 3600] (0: off), got {value!r}" in r.stderr + r.stdout


def test_launcher_refuses_a_trace_directory_it_cannot_write(tmp_path):
    """DD_SGLANG_TRACE_DIR must be a directory the server can create and write; a path under a regular
    file stops the launcher before SGLang starts, naming the variable and the path."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    bad = str(blocker / "traces")
    r = _refused_before_torch("--model-path", str(tmp_path), env={"DD_SGLANG_TRACE_DIR": bad})
    assert f"DD_SGLANG_TRACE_DIR must name a directory this server can write, got {bad!r}" in r.stderr + r.stdout


def _hf_config(folder, **extra) -> str:
    """A model folder holding only a ``config.json`` (SmolLM2's RoPE fields, transformers 5 layout)."""
    import json

    data = {"max_position_embeddings": 8192, "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}}
    (folder / "config.json").write_text(json.dumps({**data, **extra}))
    return str(folder)


@pytest.mark.parametrize("scaling", ["yarn", "dynamic", "linear"])
def test_rope_scaling_becomes_sglangs_model_override(tmp_path, scaling):
    """``model.rope_scaling`` x ``rope_factor`` reaches SGLang as ``--json-model-override-args``: the
    model's own ``rope_theta`` kept, the type and factor set; for YaRN the trained context becomes
    ``original_max_position_embeddings`` and ``max_position_embeddings`` grows by the factor (SGLang's
    ``get_context_length`` then derives 32,768; it multiplies by the factor itself for the others)."""
    import json

    from dd_sglang.launcher.sglang_argv import rope_override_json

    cfg = DDConfig.model_validate({"model": {"rope_scaling": scaling, "rope_factor": 4.0}})
    override = rope_override_json(cfg.model, _hf_config(tmp_path))
    argv = build_sglang_argv(cfg, [], str(tmp_path), cpu=True, rope_override=override)
    got = json.loads(flag_value(argv, "--json-model-override-args"))
    want = {"rope_parameters": {"rope_theta": 100000.0, "rope_type": scaling, "factor": 4.0}}
    if scaling == "yarn":
        want["rope_parameters"]["original_max_position_embeddings"] = 8192
        want["max_position_embeddings"] = 32768
    assert got == want
    theta_top = rope_override_json(cfg.model, _hf_config(tmp_path, rope_parameters=None, rope_theta=5e5))
    assert json.loads(theta_top)["rope_parameters"]["rope_theta"] == 5e5  # transformers 4 layout
    assert rope_override_json(DDConfig().model, str(tmp_path)) is None
    assert "--json-model-override-args" not in build_sglang_argv(DDConfig(), [], str(tmp_path), cpu=True)


@pytest.mark.parametrize(
    "model,needle",
    [({"rope_scaling": "yarn"}, "model.rope_factor must be > 1 with model.rope_scaling 'yarn'; got 1.0"),
     ({"rope_scaling": "ntk", "rope_factor": 2.0}, "key 'model.rope_scaling': Input should be 'yarn', 'dynamic' or 'linear'"),
     ({"rope_scaling": "yarn", "rope_factor": 100.0}, "key 'model.rope_factor'")],
)  # fmt: skip
def test_bad_rope_scaling_is_refused_naming_the_key(model, needle):
    with pytest.raises(ConfigError) as e:
        parse_config({"model": model}, "t")
    assert needle in str(e.value)


def test_rope_scaling_is_refused_beside_an_override_or_without_a_config_json(tmp_path):
    """The launcher stops (exit 2, before PyTorch) when the scaling would silently replace a
    ``--json-model-override-args`` of the command line or of ``server.sglang_args``, or when the model
    folder has no ``config.json`` to read the trained context and ``rope_theta`` from."""
    p = tmp_path / "p.yaml"
    p.write_text("model:\n  rope_scaling: yarn\n  rope_factor: 2.0\n")
    r = _refused_before_torch("--dd-config", str(p), "--model-path", str(tmp_path))
    assert f"model.rope_scaling needs the model folder's config.json: {tmp_path}/config.json" in r.stderr
    (tmp_path / "m").mkdir()
    model = _hf_config(tmp_path / "m")
    r = _refused_before_torch("--dd-config", str(p), "--model-path", model, "--json-model-override-args", "{}")
    assert "model.rope_scaling sets SGLang's --json-model-override-args, which the command line or" in r.stderr
    p.write_text("model:\n  rope_scaling: yarn\n  rope_factor: 2.0\nserver:\n  sglang_args:\n"
                 "    json-model-override-args: '{}'\n")  # fmt: skip
    r = _refused_before_torch("--dd-config", str(p), "--model-path", model)
    assert "server.sglang_args gives too; drop one of them" in r.stderr
