"""Coupled sampling: the speculated token is drawn with the noise the sampler then uses for the real one.

Under sampling, the ``dual_token`` guess of the next token (the argmax of the
riding position's logits) is the real token only as often as the sampled token
is the argmax (~0.5-0.6 at T = 0.8 here, against ~0.95 greedy), and each miss
costs a repair and a step or two of prompt-lookup guesses. Here both draws
share their randomness (the
Gumbel-max coupling used in speculative decoding: Daliri, Musco and Suresh,
"Coupling without Communication and Drafter-Invariant Speculative Decoding",
2024; leaving SGLang's sampler alone and speculating the argmax was measured worse,
``bench/results/archive/prediction_coupled_cpu.json``):

* a sparse row's real token is drawn here, as ``argmax(p_i / E_i)`` over the
  tempered, top-k / top-p / min-p filtered distribution ``p`` (SGLang's
  sampling parameters and their meaning, ``sglang/srt/layers/sampler.py``), with
  ``E_i ~ Exp(1)`` (the exponential race, equal in law to Gumbel-max and to
  ``torch.multinomial``) from token ``i``'s output of a SplitMix64 stream keyed
  by the request's seed (a hash of its request id and ``sampling_seed``) and the
  input token's position;
* the riding position's guess is the same draw from its own distribution, keyed
  by its own position, which is the position the real token has in the next
  step. When the riding token was right, both distributions are the same
  context's (up to the riding position's sparse attention), so the two draws
  agree about as often as two argmaxes do.

Each real token stays an exact sample of SGLang's distribution: the noise of
position ``p`` is used once by the sampler, for logits computed at ``p``, which
depend on earlier positions' noise (through the critical sets the guesses
chose) but not on position ``p``'s own: the guess drawn with it rides only in
the next forward, after the real token (causal attention), and its K/V is never
stored. Only sparse rows are drawn here; SGLang samples every other row as usual.

Where it applies: a batch that is not all greedy, with no logprobs to return, no
grammar, no custom logit processor, no sampling-mask capture, and not seeded by
SGLang itself (``--enable-deterministic-inference``); greedy rows of a mixed
batch (SGLang gives them ``top_k`` 1) keep SGLang's argmax. Anywhere else the
speculation stays the riding position's argmax. (SGLang's own seeded sampler,
``multinomial_with_seed``, needs sgl-kernel's CPU build for its hash on a CPU,
which no registry has, hence this draw.)
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

#: Attribute of SGLang's ``LogitsProcessorOutput`` carrying the coupled rows from
#: :func:`coupled_guesses` to :func:`sample`: ``(rows [m] int64, seeds, positions)``.
_ATTR = "dd_coupled"
_MASK64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """SplitMix64's output function (Steele, Lea and Flood, "Fast splittable pseudorandom number
    generators", OOPSLA 2014): a 64-bit bijection whose outputs for adjacent inputs are unrelated."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment


def _i64(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def stream_base(seed: int, position: int) -> int:
    """The 64-bit state of the noise stream of ``(seed, position)``."""
    return _mix((_mix((position + _GAMMA) & _MASK64) ^ seed) & _MASK64)


def race_uniforms(base: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1) for the exponential race: the ``token``-th output of the SplitMix64 stream
    whose state is ``base`` (``mix(base + (token + 1) x gamma)``), its top 53 bits as float64.

    Args:
        base: ``[m, 1]`` int64 bit patterns (:func:`stream_base`); tokens: ``[m, n]`` int64 ids.

    Returns:
        ``[m, n]`` float64; int64 products wrap as the unsigned arithmetic of the reference.
    """
    x = base + (tokens + 1) * _i64(_GAMMA)
    x = (x ^ _srl(x, 30)) * _i64(0xBF58476D1CE4E5B9)
    x = (x ^ _srl(x, 27)) * _i64(0x94D049BB133111EB)
    x = x ^ _srl(x, 31)
    return (_srl(x, 11).double() + 0.5) * (1.0 / (1 << 53))


def kept_sorted(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                widths: tuple[int, ...] = (1024, 8192)) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The tokens SGLang may sample: top-k, top-p and min-p applied.

    A token is kept when its rank is below ``top_k``, the mass of the tokens ranked before it is at
    most ``top_p`` and its probability is at least ``min_p`` times the largest (the kept tokens are a
    prefix of the sorted order). With no filter on any row nothing is sorted; else the ``widths``
    most likely are sorted in turn until the kept prefix ends inside them, then the whole vocabulary.

    Args:
        probs: ``[m, vocab]`` float32 probabilities; top_k ``[m]`` int (>= vocab: off); top_p
            ``[m]`` in (0, 1] (1: off); min_p ``[m]`` in [0, 1] (0: off).

    Returns:
        ``(p [m, w], ids [m, w])``: probabilities (0 where not kept) and token ids, w <= vocab.
    """
    vocab = probs.shape[-1]
    if bool(((top_k >= vocab) & (top_p >= 1.0) & (min_p <= 0.0)).all()):
        return probs, torch.arange(vocab, device=probs.device).expand_as(probs)
    for w in (*(w for w in widths if w < vocab), vocab):
        sp, ids = probs.topk(w, dim=-1)
        rank = torch.arange(w, device=probs.device).view(1, -1)
        drop = (rank >= top_k.view(-1, 1)) | ((torch.cumsum(sp, dim=-1) - sp) > top_p.float().view(-1, 1))
        drop |= sp < sp[:, :1] * min_p.float().view(-1, 1)
        if w == vocab or bool(drop[:, -1].all()):
            return sp.masked_fill(drop, 0.0), ids
    raise AssertionError("unreachable: the last width is the vocabulary")


def draw(logits: torch.Tensor, sampling_info, rows: torch.Tensor, seeds, positions) -> torch.Tensor:
    """The coupled draw for logits rows with the sampling parameters of batch ``rows``.

    Args:
        logits: ``[m, vocab]`` float logits (after SGLang's penalties, for real rows).
        sampling_info: SGLang's ``SamplingBatchInfo`` (``temperatures`` ``[bs, 1]``, ``top_ks``,
            ``top_ps``, ``min_ps`` ``[bs]``).
        rows: ``[m]`` int64, the batch row whose request each logits row belongs to.
        seeds, positions: ``m`` ints each (a request's seed; the input token's position).

    Returns:
        ``[m]`` int64 token ids: ``argmax(p_i / E_i)`` over the kept tokens, ``E_i = -log U_i``
        with ``U_i`` = :func:`race_uniforms` of token ``i`` in the stream of ``(seed, position)``.
    """
    si = sampling_info
    r = rows.to(si.top_ks.device)
    probs = torch.softmax(logits.float() / si.temperatures[r].float().view(-1, 1), dim=-1)
    p, ids = kept_sorted(probs, si.top_ks[r].to(probs.device), si.top_ps[r].to(probs.device),
                         si.min_ps[r].to(probs.device))  # fmt: skip
    base = torch.tensor([[_i64(stream_base(int(s) & _MASK64, int(q) & _MASK64))] for s, q in zip(seeds, positions, strict=True)],
                        dtype=torch.int64, device=probs.device)  # fmt: skip
    race = p.double() / -torch.log(race_uniforms(base, ids))
    return ids.gather(1, race.argmax(dim=-1, keepdim=True)).view(-1)


def _applies(forward_batch, si) -> bool:
    return (
        si is not None
        and not si.is_all_greedy
        and si.sampling_seed is None
        and not getattr(forward_batch, "return_logprob", False)
        and not si.grammars
        and not si.has_custom_logit_processor
        and si.sampling_mask_batch_indices is None
    )


def coupled_guesses(output, plan, forward_batch, n: int) -> list[int] | None:
    """The riding positions' coupled guesses; the sparse rows to draw are stashed on ``output``.

    Args:
        output: SGLang's ``LogitsProcessorOutput`` of the step; ``next_token_logits`` is
            ``[n + riding, vocab]``. Gets ``dd_coupled = (rows, seeds, positions)`` for
            :func:`sample`: the sparse rows that sample (``top_k`` not 1), their seeds and input positions.
        plan: the step's :class:`~dd_sglang.prefetch.plan.StepPlan` (``seeds`` per plan row,
            ``rows``, ``spec_rows``).
        forward_batch: SGLang's ``ForwardBatch`` (``sampling_info``, ``return_logprob``;
            ``positions`` ``[n + riding]``).
        n: the batch's real rows.

    Returns:
        Per riding token, in plan order, the token :func:`sample` draws in the next step if that
        token was the real one; None when coupling does not apply (module docstring).
    """
    si = getattr(forward_batch, "sampling_info", None)
    if not plan.requests.seeds or not _applies(forward_batch, si):
        return None
    seed_of = dict(zip(plan.rows.tolist(), plan.requests.seeds, strict=True))
    top_ks = si.top_ks.tolist()
    sampled = [b for b in plan.rows.tolist() if top_ks[b] != 1]
    pos = forward_batch.positions.tolist()
    if sampled:
        setattr(output, _ATTR, (torch.tensor(sampled, dtype=torch.int64), [seed_of[b] for b in sampled],
                                [pos[b] for b in sampled]))  # fmt: skip
    rows = plan.rows[plan.spec.rows.cpu()]
    seeds = [seed_of[b] for b in rows.tolist()]
    return draw(output.next_token_logits[n:], si, rows, seeds, pos[n:]).tolist()


def sample(original, sampler, logits_output, sampling_info, *args, **kwargs):
    """SGLang's ``Sampler.forward``, with the coupled rows' tokens drawn by :func:`draw` (the hook's body).

    The draw reads the logits before SGLang's sampler scales them in place; SGLang then samples
    the batch as usual (its tokens for every other row stand) and the coupled rows' tokens replace
    its own. Calls without a stash run ``original`` untouched.

    A stash on a call that returns logprobs (which :func:`coupled_guesses` never leaves: the
    logprobs would be of SGLang's tokens) is dropped with a warning and SGLang's tokens stand.
    """
    stash = getattr(logits_output, _ATTR, None)
    if stash is None:
        return original(sampler, logits_output, sampling_info, *args, **kwargs)
    setattr(logits_output, _ATTR, None)
    if args[0] if args else kwargs.get("return_logprob"):
        logger.warning("coupled sampling skipped on a step that returns logprobs; SGLang's tokens stand")
        return original(sampler, logits_output, sampling_info, *args, **kwargs)
    rows, seeds, positions = stash
    logits = logits_output.next_token_logits
    ours = draw(logits[rows.to(logits.device)], sampling_info, rows, seeds, positions)
    ids = original(sampler, logits_output, sampling_info, *args, **kwargs)
    ids[rows.to(ids.device)] = ours.to(ids.dtype)
    return ids
