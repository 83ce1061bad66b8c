"""Coupled sampling: the speculated token is drawn with the noise the sampler then uses for the real one.

Under sampling, the ``dual_token`` guess of the next token (the argmax of the
riding position's logits) is the real token only as often as the sampled token
is the argmax (~0.5-0.6 at T = 0.8 here, against ~0.95 greedy), and each miss
costs a repair and a step or two of prompt-lookup guesses. With
``prefetch.sampling: coupled`` both draws share their randomness (the
Gumbel-max coupling used in speculative decoding: Daliri, Musco and Suresh,
"Coupling without Communication and Drafter-Invariant Speculative Decoding",
2024):

* a sparse row's real token is drawn here, as ``argmax(p_i / E_i)`` over the
  tempered, top-k / top-p / min-p filtered distribution ``p`` (SGLang's
  sampling parameters and their meaning, ``sglang/srt/layers/sampler.py``), with
  ``E_i ~ Exp(1)`` (the exponential race, equal in law to Gumbel-max and to
  ``torch.multinomial``) from a generator seeded by the request's seed and the
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

import torch

#: Attribute of SGLang's ``LogitsProcessorOutput`` carrying the coupled rows from
#: :func:`coupled_guesses` to :func:`sample`: ``(rows [m] int64, seeds, positions)``.
_ATTR = "dd_coupled"
_MASK64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """SplitMix64's finaliser (Steele, Lea and Flood, "Fast splittable pseudorandom number
    generators", OOPSLA 2014): a 64-bit bijection whose outputs for adjacent inputs are unrelated."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def race_noise(seed: int, position: int, vocab: int) -> torch.Tensor:
    """``[vocab]`` float32 Exp(1) draws, a function of ``(seed, position)`` only (CPU generator)."""
    g = torch.Generator().manual_seed(_mix((seed & _MASK64) ^ _mix(position & _MASK64)))
    return torch.empty(vocab, dtype=torch.float32).exponential_(generator=g)


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   min_p: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The distribution SGLang samples from: ``softmax(logits / T)`` with top-k, top-p and min-p applied.

    Args:
        logits: ``[m, vocab]``; temperature ``[m]`` (> 0); top_k ``[m]`` int (>= vocab: off);
            top_p ``[m]`` in (0, 1] (1: off); min_p ``[m]`` in [0, 1] (0: off).

    Returns:
        ``[m, vocab]`` float32, unnormalised after filtering (zeros where filtered out): a token
        is kept when its rank is below ``top_k``, the mass of the tokens ranked before it is at most
        ``top_p``, and its probability is at least ``min_p`` times the largest.
    """
    probs = torch.softmax(logits.float() / temperature.float().view(-1, 1), dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device).view(1, -1)
    drop = (rank >= top_k.view(-1, 1)) | ((torch.cumsum(sorted_p, dim=-1) - sorted_p) > top_p.float().view(-1, 1))
    drop |= sorted_p < sorted_p[:, :1] * min_p.float().view(-1, 1)
    return probs.scatter(1, order, sorted_p.masked_fill(drop, 0.0))


def draw(logits: torch.Tensor, sampling_info, rows: torch.Tensor, seeds, positions) -> torch.Tensor:
    """The coupled draw for logits rows with the sampling parameters of batch ``rows``.

    Args:
        logits: ``[m, vocab]`` float logits (after SGLang's penalties, for real rows).
        sampling_info: SGLang's ``SamplingBatchInfo`` (``temperatures`` ``[bs, 1]``, ``top_ks``,
            ``top_ps``, ``min_ps`` ``[bs]``).
        rows: ``[m]`` int64, the batch row whose request each logits row belongs to.
        seeds, positions: ``m`` ints each (a request's seed; the input token's position).

    Returns:
        ``[m]`` int64 token ids, ``argmax(p / E)`` with ``E`` = :func:`race_noise` ``(seed, position)``.
    """
    dev = logits.device
    r = rows.to(sampling_info.top_ks.device)
    p = filtered_probs(logits, sampling_info.temperatures[r].view(-1), sampling_info.top_ks[r],
                       sampling_info.top_ps[r], sampling_info.min_ps[r])  # fmt: skip
    noise = torch.stack([race_noise(int(s), int(q), logits.shape[-1]) for s, q in zip(seeds, positions, strict=True)])
    return (p / noise.to(dev)).argmax(dim=-1)


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
    if not plan.seeds or not _applies(forward_batch, si):
        return None
    seed_of = dict(zip(plan.rows.tolist(), plan.seeds, strict=True))
    top_ks = si.top_ks.tolist()
    sampled = [b for b in plan.rows.tolist() if top_ks[b] != 1]
    pos = forward_batch.positions.tolist()
    if sampled:
        setattr(output, _ATTR, (torch.tensor(sampled, dtype=torch.int64), [seed_of[b] for b in sampled],
                                [pos[b] for b in sampled]))  # fmt: skip
    rows = plan.rows[plan.spec_rows.cpu()]
    seeds = [seed_of[b] for b in rows.tolist()]
    return draw(output.next_token_logits[n:], si, rows, seeds, pos[n:]).tolist()


def sample(original, sampler, logits_output, sampling_info, *args, **kwargs):
    """SGLang's ``Sampler.forward``, with the coupled rows' tokens drawn by :func:`draw` (the hook's body).

    The draw reads the logits before SGLang's sampler scales them in place; SGLang then samples
    the batch as usual (its tokens for every other row stand) and the coupled rows' tokens replace
    its own. Calls without a stash run ``original`` untouched.

    Raises:
        RuntimeError: a stash on a call that returns logprobs (their tokens would not match).
    """
    stash = getattr(logits_output, _ATTR, None)
    if stash is None:
        return original(sampler, logits_output, sampling_info, *args, **kwargs)
    setattr(logits_output, _ATTR, None)
    if (args[0] if args else kwargs.get("return_logprob")):
        raise RuntimeError("coupled sampling was planned for a step that returns logprobs")
    rows, seeds, positions = stash
    logits = logits_output.next_token_logits
    ours = draw(logits[rows.to(logits.device)], sampling_info, rows, seeds, positions)
    ids = original(sampler, logits_output, sampling_info, *args, **kwargs)
    ids[rows.to(ids.device)] = ours.to(ids.dtype)
    return ids
