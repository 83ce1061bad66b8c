"""Passkey-retrieval prompts (the long-context test of Mohtashami & Jaggi, 2023, "Landmark Attention").

A random 5-digit passkey is hidden at a chosen depth inside repetitive filler
text; the model must repeat it. Prompts are built in SmolLM2's chat format and
end with the start of the answer, so a greedy completion of a few tokens is
enough. The answer prefix ends with a space so the next tokens are the digits
(SmolLM2 splits every digit into its own token).
"""

from __future__ import annotations

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
#: Tokens of FILLER under SmolLM2's tokenizer (asserted in tests/test_server_e2e.py); lets the
#: load generator size prompts without loading a tokenizer.
FILLER_TOKENS = 25
INSTRUCTION = (
    "There is an important info hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about the important information there."
)


def passkey_prompt(tokenizer, n_tokens: int, depth: float, passkey: int, header: str = "") -> tuple[str, int]:
    """Chat-formatted prompt of about ``n_tokens`` tokens with the passkey at ``depth`` (0..1).

    ``header`` (optional) opens the user message; a distinct header per prompt
    keeps prompts from sharing a radix-cache prefix.

    Returns:
        ``(prompt, n_prompt_tokens)`` where the count comes from ``tokenizer``.

    Raises:
        ValueError: ``depth`` outside [0, 1] or ``n_tokens`` < 200.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    if n_tokens < 200:
        raise ValueError(f"n_tokens must be >= 200, got {n_tokens}")
    needle = f" The pass key is {passkey}. Remember it. {passkey} is the pass key. "
    per_filler = len(tokenizer.encode(FILLER))
    n_fill = max(1, (n_tokens - 120) // per_filler)
    before = int(n_fill * depth)
    body = FILLER * before + needle + FILLER * (n_fill - before)
    prompt = (
        "<|im_start|>user\n"
        f"{header}{INSTRUCTION}\n{body}\nWhat is the pass key?<|im_end|>\n"
        "<|im_start|>assistant\nThe pass key is "
    )
    return prompt, len(tokenizer.encode(prompt))
