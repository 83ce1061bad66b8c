"""The speculator: proposes the token after the current one, so its queries can pick step t+1's critical set.

At decode step t a ``DECODE_SPARSE`` request feeds its real token ``x_t`` (position
``p``). The speculator may add a speculated token ``x̂_{t+1}`` (position ``p + 1``) to
the *same* forward pass as a second query position of that request (the
``dualdecoder`` attention backend appends it to the batch; its K/V is never
written to the KV cache and its logits are cut before sampling,
``patches/layers_logits_processor.py``). At every layer the second position's
query is the prediction of step t+1's query at that layer, and the lookahead
selectors (``spec_host``) score it to fix step t+1's critical set during step t.

Where the speculated token comes from (``dual_token``, :class:`DualTokenSpeculator`):

* the argmax of the second position's logits of step t-1. That
  position fed ``x̂_t``; when ``x̂_t`` turned out to be the real ``x_t`` (the
  speculation was *accepted*), its logits are the model's next-token
  distribution after ``x_t`` (up to the sparse attention the second position
  uses), and their argmax is the greedy guess of ``x_{t+1}``. (Riding the
  runner-up beside an unsure argmax as a third position was measured worse:
  it lost recall on 5 of 6 paired cells at the same ``top_k``,
  ``bench/results/archive/prediction_variants_cpu.json``.) When the riding token was not the real one, or on a
  request's first sparse step, it falls back to prompt lookup; with no n-gram
  match either, no token rides along. (Reusing the rejected position's argmax instead keeps the chain one
  token out of phase: every later guess continues a wrong token, and greedy
  acceptance fell from 0.73 to 0.0 on one 4k text in ``bench.prefetch``, a benchmark since deleted with
  the speculators it compared.)
* prompt lookup (:func:`ngram_propose`; Saxena, "Prompt Lookup Decoding", 2023; the idea of
  SGLang's NGRAM speculative algorithm): the token that followed the most
  recent earlier occurrence of the longest suffix of the context, for suffix
  lengths :data:`NGRAM_MAX` down to 1. None when no suffix recurs.

Prompt lookup on its own (``ngram``) and no speculation at all (``none``: the current query ranks
the next step's set) were once speculators of their own; both were measured worse than
``dual_token`` (``bench/results/archive/``) and deleted.

Acceptance (``x̂_t == x_t``) is counted per step (``dd_spec_proposed_total`` /
``dd_spec_accepted_total``). An accepted speculation would be a free extra
token if its logits were verified like SGLang's target-verify pass does; this
code does not emit it (the second position attends sparsely, so its logits
are not exactly the dense model's), it only measures the acceptance rate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

#: Longest suffix (tokens) ``ngram`` looks up.
NGRAM_MAX = 3


@dataclass
class SpecState:
    """Per-request speculation state (kept by the prefetch layer's ``PredictionStore``).

    Attributes:
        riding: the tokens that rode as extra query positions in the last step (0 or 1).
        top: per riding token, ``(token_1, p_1, token_2, p_2)``: the two most likely next tokens
            after it and their probabilities, from its logits (filled after the forward).
        branch: which riding token equalled the real one at the last check (None: none did).
        index: n-gram -> position after its most recent occurrence, over ``history[:indexed]``.
        indexed: how many history tokens ``index`` covers.
        proposed, accepted: steps with a verifiable speculation, and those where a riding token
            equalled the real token.
        seed: the request's sampling seed for coupled sampling (a hash of its request
            id and ``sampling_seed``, fixed at its first sparse step); None until then.
    """

    riding: tuple[int, ...] = ()
    top: list = field(default_factory=list)
    branch: int | None = None
    index: dict = field(default_factory=dict)
    indexed: int = 0
    proposed: int = 0
    accepted: int = 0
    seed: int | None = None


def ngram_propose(history: Sequence[int], state: SpecState, max_n: int = NGRAM_MAX) -> int | None:
    """Prompt lookup: the token after the latest earlier occurrence of the longest recurring suffix.

    Args:
        history: the request's token ids so far (prompt then output; ``history[-1]`` is the
            current token).
        state: its :class:`SpecState`; ``index`` is extended incrementally (amortised O(1) per
            new token, O(len(history)) the first time).
        max_n: longest suffix tried.

    Returns:
        A token id, or None when no suffix of length ``1..max_n`` occurred earlier.
    """
    n_hist = len(history)
    # Index every n-gram that ends strictly before the current token (so the token after it is known).
    for end in range(max(state.indexed, 1), n_hist):
        for n in range(1, max_n + 1):
            if end - n < 0:
                break
            state.index[tuple(history[end - n : end])] = end
    state.indexed = max(state.indexed, n_hist)
    for n in range(min(max_n, n_hist), 0, -1):
        nxt = state.index.get(tuple(history[n_hist - n :]))
        if nxt is not None and nxt < n_hist:
            return int(history[nxt])
    return None


class DualTokenSpeculator:
    """After an accepted speculation, the model's own guess from the riding position; else ``ngram``.

    The riding token that equalled the real one saw the right context, so its logits are the
    model's next-token distribution (up to its sparse attention): its argmax rides next.
    """

    name = "dual_token"

    def propose(self, history: Sequence[int], state: SpecState) -> tuple[int, ...]:
        """0 or 1 token guessed for the position after ``history[-1]``."""
        b = state.branch
        if b is not None and b < len(state.top) and state.top[b] is not None:
            return (state.top[b][0],)
        tok = ngram_propose(history, state)
        return () if tok is None else (tok,)


def verify(state: SpecState, token: int) -> bool | None:
    """Check last step's riding tokens against the real one; None when none rode.

    Sets ``state.branch`` to the index of the matching riding token (None: rejected) and counts.
    """
    if not state.riding:
        state.branch = None
        return None
    state.proposed += 1
    state.branch = state.riding.index(token) if token in state.riding else None
    ok = state.branch is not None
    state.accepted += int(ok)
    return ok
