"""Request checks dd_sglang adds before SGLang queues a request (tokenizer-manager process)."""

from __future__ import annotations


def check_prompt_tokens(input_ids, vocab_size: int) -> None:
    """Refuse a prompt with no token, or with a token id outside the vocabulary.

    SGLang 0.5.23 checks neither before the scheduler runs the model on the
    prompt, and both then crash the scheduler process, which takes the whole
    server down (every other request fails, the launcher exits 1):

    * a native ``/generate`` request with ``"text": ""`` tokenizes to zero tokens
      when the tokenizer adds no BOS token (the embedded SmolLM2's does not); the
      forward pass fails on an empty tensor. (SGLang itself refuses an empty
      ``input_ids`` list and an empty OpenAI ``prompt``.)
    * a prompt given as token ids (``input_ids``, or an OpenAI ``prompt`` list of
      ints) with an id < 0 or >= the vocabulary size makes the embedding lookup
      fail (on CUDA: a device-side assert).

    Args:
        input_ids: the request's token ids after tokenization (``list[int]``), or
            None for requests that carry embeddings instead.
        vocab_size: the model's vocabulary size (``ModelConfig.vocab_size``).

    Raises:
        ValueError: naming the field and the allowed range; SGLang answers HTTP 400 with it.
    """
    if input_ids is None:
        return
    if len(input_ids) == 0:
        raise ValueError(
            "text: the prompt is empty (it tokenizes to 0 tokens); send at least one token of text"
        )
    lo, hi = min(input_ids), max(input_ids)
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise ValueError(
            f"input_ids: token id {bad} is outside the vocabulary; ids must be in [0, {vocab_size})"
        )


#: Most completions one request may ask for (``n``); the OpenAI API's own limit.
MAX_PARALLEL_SAMPLES = 128


def check_parallel_samples(n) -> None:
    """Refuse an ``n`` (completions per request) outside ``[1, MAX_PARALLEL_SAMPLES]``.

    SGLang 0.5.23 fans a request with ``n`` out into ``n`` copies before any
    check: ``n=0`` fails with Python's ``range() arg 3 must not be zero`` and
    ``n=100000`` keeps the HTTP server busy building copies for minutes, a
    denial of service from one request.

    Raises:
        ValueError: ``n`` is not an integer in the range (SGLang answers HTTP 400 with the message).
    """
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_PARALLEL_SAMPLES:
        raise ValueError(f"n must be an integer in [1, {MAX_PARALLEL_SAMPLES}], got {n!r}")


def check_host_tier_holds(n_tokens: int, host_tier_bytes: int, bytes_per_token: int) -> None:
    """Refuse a prompt of ``n_tokens`` that the ``dualdecoder`` host tier could never hold whole.

    A prompt longer than the device pool is prefilled through the host tier
    (``patches/managers_tp_worker.py`` lifts SGLang's pool bound), so the tier, not the pool,
    bounds it: ``host_tier_bytes // bytes_per_token`` tokens (the tier's whole capacity, before
    other requests' share; a request that fits it waits for room).

    Args:
        n_tokens: the prompt's tokens.
        host_tier_bytes: ``sparse.host_tier_bytes``.
        bytes_per_token: K and V of one token over every layer (``layers x 2 x kv_heads x
            head_dim x itemsize``).

    Raises:
        ValueError: naming ``sparse.host_tier_bytes`` and the tokens it holds; SGLang answers HTTP 400.
    """
    capacity = host_tier_bytes // max(bytes_per_token, 1)
    if n_tokens > capacity:
        raise ValueError(
            f"input: the prompt has {n_tokens} tokens; the host tier holds at most {capacity} "
            f"(sparse.host_tier_bytes {host_tier_bytes} / {bytes_per_token} bytes per token)"
        )
