"""A custom logit processor that forces a request's output to given token ids (teacher forcing).

SGLang applies custom logit processors to each request's next-token logits
before sampling (``--enable-custom-logit-processor``; the request sends
``custom_logit_processor: ForceTokens.to_str()`` and the ids in
``sampling_params.custom_params["force_ids"]``). Output token ``j`` becomes
``force_ids[j]``: the decode follows the real text while the speculators still
guess from the model, which is DESIGN.md's "teacher-forced real text" regime.
The class is pickled by reference, so the server imports it from ``harness``
(the server's working directory is the project root).
"""

from __future__ import annotations

import torch
from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor


def forced_rows(custom_param_list) -> list[tuple[int, int]]:
    """``(row, forced token id)`` of each batch row that is forced at this step: its request sent
    ``force_ids`` and has produced fewer tokens than it lists (the id is ``force_ids[len(req.output_ids)]``)."""
    rows = []
    for i, params in enumerate(custom_param_list or []):
        ids, req = params.get("force_ids"), params.get("__req__")
        if ids and req is not None and len(req.output_ids) < len(ids):
            rows.append((i, int(ids[len(req.output_ids)])))
    return rows


class ForceTokens(CustomLogitProcessor):
    """Set every logit to -inf except ``force_ids[len(req.output_ids)]`` (while ids remain)."""

    def __call__(self, logits: torch.Tensor, custom_param_list=None) -> torch.Tensor:
        for i, f in forced_rows(custom_param_list):
            logits[i].fill_(float("-inf"))
            logits[i, f] = 0.0
        return logits


#: Token ids whose returned log-probabilities carry :class:`ForceTokensScored`'s measurements.
CARRIER_IDS = (0, 1, 2)


class ForceTokensScored(CustomLogitProcessor):
    """Teacher forcing that also reports the model's own log-probability of each forced token.

    Why a carrier: SGLang 0.5.23 applies custom logit processors in place
    before it computes any returned log-probability
    (``Sampler._preprocess_logits`` is the first thing ``Sampler.forward``
    does; ``return_logprob``, ``top_logprobs_num``, ``token_ids_logprob`` and
    ``SGLANG_RETURN_ORIGINAL_LOGPROB`` all read the processed logits), so with
    :class:`ForceTokens` the forced token's returned log-probability is 0. This
    processor therefore writes what it measured on the model's logits into the
    processed row: with ``f = force_ids[j]``, ``lp = log_softmax(logits)``
    (the model's own distribution, from the sparse or dense step that produced
    it) and ``a, b`` the first two of :data:`CARRIER_IDS` other than ``f``::

        logits'[f] = 1.0,  logits'[a] = lp[f],  logits'[b] = max(lp),  every other id -inf

    ``f`` stays the argmax (``lp <= 0 < 1``), so greedy decoding emits it, and
    from the returned log-probabilities of ``f`` (``output_token_logprobs``) and of
    the carriers (request ``token_ids_logprob: CARRIER_IDS``)
    :func:`decode_scores` recovers ``lp[f] = lp'[a] - lp'[f] + 1`` and
    ``max(lp) = lp'[b] - lp'[f] + 1`` (differences of float32 log-softmax
    outputs: exact to ~1e-6). Requests must be greedy (``temperature: 0``).

    Like :class:`ForceTokens` (and SGLang's own processors) it reads the step's index
    from ``len(req.output_ids)``, which lags one step under SGLang's overlap scheduler:
    the server must run with ``--disable-overlap-schedule`` (``dualdecoder`` always does).
    """

    def __call__(self, logits: torch.Tensor, custom_param_list=None) -> torch.Tensor:
        for i, f in forced_rows(custom_param_list):
            lp = torch.log_softmax(logits[i].float(), dim=-1)
            a, b = [c for c in CARRIER_IDS if c != f][:2]
            lp_f, lp_max = float(lp[f]), float(lp.max())
            logits[i].fill_(float("-inf"))
            logits[i, f] = 1.0
            logits[i, a] = lp_f
            logits[i, b] = lp_max
        return logits


def decode_scores(meta_info: dict, force_ids: list[int]) -> list[tuple[float, bool]]:
    """Per forced output token: ``(model log-probability of the token, token was the model's argmax)``.

    Args:
        meta_info: the ``/generate`` response's ``meta_info`` of a request sent with
            ``custom_logit_processor: ForceTokensScored.to_str()``, ``return_logprob: true``
            and ``token_ids_logprob: CARRIER_IDS``.
        force_ids: the forced ids (the request's ``custom_params["force_ids"]``).

    Raises:
        ValueError: the output does not follow ``force_ids`` or a carrier log-probability is
            missing (the processor did not run: is ``--enable-custom-logit-processor`` on?).
    """
    out = meta_info.get("output_token_logprobs") or []
    ids_lp = meta_info.get("output_token_ids_logprobs") or []
    if len(out) != len(ids_lp) or len(out) > len(force_ids):
        raise ValueError(f"{len(out)} output logprobs, {len(ids_lp)} carrier rows, {len(force_ids)} forced ids")
    scores = []
    for j, ((lp_out, tok, *_), row) in enumerate(zip(out, ids_lp, strict=True)):
        f = int(force_ids[j])
        if int(tok) != f:
            raise ValueError(f"output token {j} is {tok}, not the forced {f}")
        by_id = {int(t): float(v) for v, t, *_ in row}
        a, b = [c for c in CARRIER_IDS if c != f][:2]
        if a not in by_id or b not in by_id:
            raise ValueError(f"carrier log-probabilities missing at output token {j}: {row}")
        lp_f = by_id[a] - float(lp_out) + 1.0
        lp_max = by_id[b] - float(lp_out) + 1.0
        scores.append((lp_f, lp_f >= lp_max - 1e-6))
    return scores
