"""Embedded model conversion: checksum, atomicity, tokenizer, config."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from dd_sglang.models import smollm2
from dd_sglang.models.smollm2 import GGUF_SHA256, ModelError, is_complete, model_dir, prepare_model


def _fake_convert(gguf, out_dir, progress=True):
    (out_dir / "config.json").write_text("{}")


def test_shipped_gguf_checksum():
    assert smollm2.sha256_file(smollm2.find_gguf(), progress=False) == GGUF_SHA256


def test_checksum_mismatch_refuses_and_leaves_nothing(tmp_path, monkeypatch):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF not the real file")
    monkeypatch.setattr(smollm2, "find_gguf", lambda: bad)
    root = tmp_path / "cache"
    with pytest.raises(ModelError, match="sha256"):
        prepare_model(root=root, progress=False)
    assert not model_dir(root).exists()
    assert not list(root.glob(".tmp-*"))


def test_failed_conversion_leaves_no_model(tmp_path, monkeypatch):
    def broken(gguf, out_dir, progress=True):
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(smollm2, "convert", broken)
    root = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="disk full"):
        prepare_model(root=root, progress=False)
    assert not model_dir(root).exists()
    assert not list(root.glob(".tmp-*"))


def test_killed_conversion_never_yields_a_loadable_model(tmp_path, monkeypatch):
    """SIGKILL a real conversion once its work folder exists: no final folder; the next run cleans
    up and finishes. (Killed as soon as the folder appears rather than after its first files: the
    property is the same, no final folder without the marker, and the suite saves the ~40 s the
    conversion takes to write its tokenizer.)"""
    root = tmp_path / "cache"
    env = dict(os.environ, DD_SGLANG_CACHE=str(root))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from dd_sglang.models.smollm2 import prepare_model; prepare_model(progress=False)",
        ],
        env=env,
    )
    deadline = time.monotonic() + 120
    while not list(root.glob(".tmp-*")):
        assert proc.poll() is None, "conversion ended before it could be interrupted"
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert list(root.glob(".tmp-*")), "the interrupted work folder is still there"
    assert not model_dir(root).exists()
    assert not is_complete(model_dir(root))
    # The next run removes the stale folder and completes (conversion itself stubbed for speed).
    monkeypatch.setattr(smollm2, "convert", _fake_convert)
    out = prepare_model(root=root, progress=False)
    assert is_complete(out) and not list(root.glob(".tmp-*"))


def test_folder_without_marker_is_not_trusted(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    final = model_dir(root)
    final.mkdir(parents=True)
    (final / "model.safetensors").write_bytes(b"half")
    assert not is_complete(final)
    monkeypatch.setattr(smollm2, "convert", _fake_convert)
    out = prepare_model(root=root, progress=False)
    assert out == final and is_complete(out)
    assert not (final / "model.safetensors").exists()
    # readable by other users of a shared cache (mkdtemp alone would leave 0700)
    assert out.stat().st_mode & 0o777 == 0o755
    assert all(f.stat().st_mode & 0o777 == 0o644 for f in out.iterdir())


def test_converted_config(model_path):
    cfg = json.loads((model_path / "config.json").read_text())
    assert cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 30
    assert cfg["num_attention_heads"] == 9
    assert cfg["num_key_value_heads"] == 3
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == 64
    assert cfg["rope_theta"] == 100000.0
    assert cfg["tie_word_embeddings"] is True
    assert cfg["max_position_embeddings"] == 8192
    assert "quantization_config" not in cfg
    assert json.loads((model_path / smollm2.MARKER).read_text())["sha256"] == GGUF_SHA256


def _gguf_vocab() -> list[str]:
    """Token strings straight from the GGUF metadata (independent of transformers)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(smollm2.find_gguf()))
    field = reader.fields["tokenizer.ggml.tokens"]
    return [bytes(field.parts[i]).decode("utf-8") for i in field.data]


def test_digits_are_split_one_by_one(tokenizer):
    vocab = _gguf_vocab()
    ids = tokenizer.encode("year 2024", add_special_tokens=True)
    # "year", " " (byte-level space), then one token per digit, ids as in the GGUF vocabulary.
    assert [vocab[i] for i in ids] == ["year", "Ġ", "2", "0", "2", "4"]


def test_no_bos_token_is_added(tokenizer):
    vocab = _gguf_vocab()
    ids = tokenizer.encode("Hello", add_special_tokens=True)
    assert [vocab[i] for i in ids] == ["Hello"]


@pytest.mark.parametrize(
    "text",
    [
        "3.14159 and 1,000,000",
        "Grüße aus Köln: ÄÖÜ ß",
        "日本語のテキスト",
        "emoji 😀🚲 mixed",
        "tabs\tand\nnewlines  ",
    ],
)
def test_tokenizer_round_trip(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_chat_template_from_gguf(tokenizer):
    s = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert s.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert s.startswith("<|im_start|>system\n")
