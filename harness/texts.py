"""Real text available offline, and retrieval prompts built from it with fixed seeds.

Three texts, each long enough for an 8k-token window plus a continuation:

* ``licenses``: Debian's licence texts (``/usr/share/common-licenses``),
  ``Apache-2.0`` then ``GPL-3`` then the others in name order, each file once
  (symlinks such as ``GPL`` -> ``GPL-3`` resolved), as whitespace-split words
  joined by single spaces (the construction of issue 10's failing input).
* ``python_docs``: Python's own reference documentation shipped with the
  standard library (``pydoc_data.topics``: the text ``help("assert")`` prints),
  topics in name order.
* ``package_docs``: the long descriptions of the installed packages
  (``*.dist-info/METADATA``), :func:`corpus_text`.

Retrieval prompts (:func:`needle_prompt`) hide one fact or pass key at a given
depth of a window of a text's words and end with the start of the answer, in
the format of issue 10::

    Read the document and answer the question.\\n\\nDocument:\\n<words>\\n\\n
    Question: <question>\\nAnswer: <answer prefix>

No chat template: the model continues the answer directly (a raw completion).
"""

from __future__ import annotations

import functools
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path

LICENSES = Path("/usr/share/common-licenses")
TEXTS = ("licenses", "python_docs", "package_docs")

#: Facts of the kind issue 10 reports lost (a rare name copied out of the middle of a long text):
#: (statement with ``{}`` for the answer, question, answer prefix).
FACT_TEMPLATES = (
    ("The navigator of the expedition was called {}.", "What was the navigator of the expedition called?",
     "The answer is"),
    ("The keeper of the old lighthouse was named {}.", "What was the keeper of the old lighthouse named?",
     "The answer is"),
    ("The ship's cat answered only to the name {}.", "What name did the ship's cat answer to?",
     "The answer is"),
    ("The archive's secret password is {}.", "What is the archive's secret password?", "The answer is"),
)  # fmt: skip
#: Answers: uncommon names and words, most of them several tokens long for SmolLM2.
FACT_ANSWERS = (
    "Leopold", "Bartholomew", "Ignatius", "Cornelius", "Thaddeus", "Evangeline", "Millicent", "Percival",
    "Octavia", "Barnaby", "Ophelia", "Lysander", "Rosalind", "Ezekiel", "Wilhelmina", "Casimir",
    "Philippa", "Peregrine", "Marmaduke", "Clementine", "Tiberius", "Seraphina", "Aurelian", "Griselda",
)  # fmt: skip
PASSKEY = ("The pass key is {}. Remember it. {} is the pass key.", "What is the pass key?", "The pass key is")


def license_words(names: tuple[str, ...] | None = None) -> list[str]:
    """Whitespace-split words of Debian's licence texts.

    Args:
        names: file names under ``/usr/share/common-licenses`` in order; default:
            ``Apache-2.0``, ``GPL-3``, then every other file in name order, each
            distinct file (after resolving symlinks) once.

    Raises:
        FileNotFoundError: the folder or a named file is missing (not a Debian-family image).
    """
    if names is None:
        rest = sorted(p.name for p in LICENSES.iterdir() if p.name not in ("Apache-2.0", "GPL-3"))
        names = ("Apache-2.0", "GPL-3", *rest)
    words, seen = [], set()
    for name in names:
        path = (LICENSES / name).resolve()
        if path in seen:
            continue
        seen.add(path)
        words += path.read_text(errors="replace").split()
    return words


def python_docs() -> str:
    """Python's reference documentation from the standard library (``pydoc_data.topics``), by topic name."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def corpus_text() -> str:
    """Real English prose available offline: installed packages' long descriptions."""
    import site

    texts = []
    for root in site.getsitepackages():
        for meta in sorted(Path(root).glob("*.dist-info/METADATA")):
            body = meta.read_text(errors="ignore").split("\n\n", 1)
            if len(body) == 2 and len(body[1]) > 2000:
                texts.append(body[1])
    return "\n\n".join(texts)[:200_000]  # ~50k tokens, plenty for 8k contexts


@functools.cache
def text(name: str) -> str:
    """One of :data:`TEXTS` as a string.

    Raises:
        ValueError: unknown name (the message lists the known ones).
        FileNotFoundError: ``licenses`` on an image without ``/usr/share/common-licenses``.
    """
    if name == "licenses":
        return " ".join(license_words())
    if name == "python_docs":
        return python_docs()
    if name == "package_docs":
        return corpus_text()
    raise ValueError(f"text must be one of {list(TEXTS)}, got {name!r}")


def available_texts() -> list[str]:
    """The names of :data:`TEXTS` that this machine has (``licenses`` needs Debian's folder)."""
    return [t for t in TEXTS if t != "licenses" or os.path.isdir(LICENSES)]


@dataclass(frozen=True)
class NeedleCase:
    """One retrieval trial: ``prompt`` (a string) and the ``answer`` to find in the completion."""

    text: str
    kind: str  # "fact" or "passkey"
    depth: float
    answer: str
    prompt: str
    n_tokens: int

    def found(self, completion: str) -> bool:
        """The answer occurs as a whole word in ``completion`` (case-insensitive)."""
        return re.search(rf"(?<![\w]){re.escape(self.answer)}(?![\w])", completion, re.IGNORECASE) is not None


def _document(words: list[str], statement: str, depth: float, question: str, prefix: str) -> str:
    at = int(depth * len(words))
    body = " ".join(words[:at] + [statement] + words[at:])
    return (
        "Read the document and answer the question.\n\nDocument:\n"
        f"{body}\n\nQuestion: {question}\nAnswer: {prefix}"
    )


def needle_prompt(tokenizer, text_name: str, n_tokens: int, depth: float, kind: str, seed: int) -> NeedleCase:
    """A retrieval prompt of about ``n_tokens`` tokens (within 1%) from a window of ``text_name``'s words.

    ``seed`` fixes the window's start, the fact template and the answer (or the
    5-digit pass key); the statement goes at ``depth`` (0..1) of the window.

    Raises:
        ValueError: ``depth`` outside [0, 1], ``kind`` not ``fact``/``passkey``, ``n_tokens`` < 256,
            or a text too short for the window.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    if kind not in ("fact", "passkey"):
        raise ValueError(f"kind must be 'fact' or 'passkey', got {kind!r}")
    if n_tokens < 256:
        raise ValueError(f"n_tokens must be >= 256, got {n_tokens}")
    rng = random.Random(seed)
    words = text(text_name).split()
    if kind == "fact":
        statement, question, prefix = rng.choice(FACT_TEMPLATES)
        answer = rng.choice(FACT_ANSWERS)
        statement = statement.format(answer)
    else:
        answer = str(rng.randrange(10000, 100000))
        statement, question, prefix = PASSKEY[0].format(answer, answer), PASSKEY[1], PASSKEY[2]
    n_words = int(n_tokens / 1.5)
    start = rng.randrange(0, max(1, len(words) - 3 * n_tokens))
    for _ in range(8):  # fit the window's word count to the token target
        if start + n_words > len(words):
            raise ValueError(f"text {text_name!r} has too few words for {n_tokens} tokens")
        prompt = _document(words[start : start + n_words], statement, depth, question, prefix)
        got = len(tokenizer.encode(prompt))
        if abs(got - n_tokens) <= n_tokens // 100:
            break
        n_words = max(16, int(n_words * n_tokens / got))
    return NeedleCase(text_name, kind, depth, answer, prompt, got)


#: Issue 10's failing input: the fact, where it goes, the question and the expected answer.
ISSUE10_FACT = "The navigator of the expedition was called Leopold."
ISSUE10_QUESTION = "What was the navigator of the expedition called?"


def issue10_prompt() -> str:
    """Issue 10's input, built exactly as the issue says.

    Whitespace-split words of Debian's ``Apache-2.0`` then ``GPL-3``; a
    3,000-word window starting at ``random.Random(2).randrange(0, len(words) -
    3000)``; the line "The navigator of the expedition was called Leopold." at
    40% of the window; the question; the answer's start ("The answer is").
    Greedy decoding of 16 tokens should answer "Leopold".

    Raises:
        FileNotFoundError: ``/usr/share/common-licenses`` is missing.
    """
    words = license_words(("Apache-2.0", "GPL-3"))
    start = random.Random(2).randrange(0, len(words) - 3000)
    return _document(words[start : start + 3000], ISSUE10_FACT, 0.4, ISSUE10_QUESTION, "The answer is")
