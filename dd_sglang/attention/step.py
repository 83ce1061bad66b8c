"""One decode forward's backend-side state, and its end (the logits hook).

:class:`DecodeStep` rides on the batch as ``forward_batch.dd_step`` from the
``dualdecoder`` backend's ``init_forward_metadata`` until :func:`finish_step`,
which SGLang's ``LogitsProcessor.forward`` hook (``patches/layers_logits_processor.py``)
calls with the step's logits.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch

from dd_sglang.attention.coupling import coupled_guesses
from dd_sglang.prefetch.events import PrefetchEvents
from dd_sglang.prefetch.plan import StepPlan


class BackendEvents(PrefetchEvents):
    """What the backend reports (the plugin turns it into Prometheus metrics); no-ops here."""

    def sparse_rows(self, n: int) -> None:
        """``n`` (request, layer) rows were decoded sparsely."""

    def exact_rows(self, n: int) -> None:
        """``n`` of them had their whole context as critical set and were attended with dense's own call."""

    def extend_rows_skipped(self, n: int) -> None:
        """An extend layer skipped ``n`` query rows of cached prefixes (:mod:`dd_sglang.attention.extend`)."""

    def step(self, kind: str, seconds: float) -> None:
        """A decode forward finished: ``kind`` ``sparse`` (it had sparse rows) or ``dense``."""


@dataclass
class DecodeStep:
    """Backend-side state of one decode forward (on the batch as ``forward_batch.dd_step``)."""

    plan: StepPlan | None
    dense_rows: torch.Tensor | None
    dense_batch: object
    events: BackendEvents
    started: float
    attention_s: float = 0.0
    #: Layers that ran the plan's sparse rows (their counts are reported once, at the step's end).
    sparse_layers: int = 0


def dense_sub_batch(fb, sparse_rows: list[int], translator=None) -> tuple[torch.Tensor, object]:
    """The dense rows of decode batch ``fb`` (those not in ``sparse_rows``) and a shallow copy of ``fb``
    restricted to them, for the dense backend to plan and run on.

    Restricted: ``batch_size``, ``req_pool_indices``, ``seq_lens``, ``seq_lens_cpu``, ``seq_lens_sum``,
    ``out_cache_loc`` (and its virtual mirror), ``encoder_lens``: the fields SGLang's decode backends
    plan from (``torch_native_backend.py``, ``flashinfer_backend.py: init_forward_metadata``). Where the
    batch carries a ``kv_loc_plan`` and ``translator`` (SGLang's ``KVIndexTranslator``) is given, the
    sub-batch gets its own plan, ``translator.own_plan(sub)`` bound to it (SGLang's
    ``mem_cache/kv_loc_plan.py``: "the plan of a forward that is its own iteration, from its own
    fields"), its write window being the rows' virtual ids.

    Returns:
        ``([n] int64 batch rows on fb's device, the sub-batch)``.
    """
    sparse = set(sparse_rows)
    rows = [i for i in range(fb.batch_size) if i not in sparse]
    host_idx = torch.tensor(rows, dtype=torch.int64)
    idx = host_idx.to(fb.seq_lens.device)
    sub = copy.copy(fb)
    sub.batch_size = len(rows)
    sub.req_pool_indices = fb.req_pool_indices[idx]
    sub.seq_lens = fb.seq_lens[idx]
    seq_lens_cpu = getattr(fb, "seq_lens_cpu", None)
    if seq_lens_cpu is not None:
        sub.seq_lens_cpu = seq_lens_cpu[host_idx]
    sub.seq_lens_sum = int((sub.seq_lens_cpu if seq_lens_cpu is not None else sub.seq_lens).sum())
    virtual = getattr(fb, "out_cache_loc_virtual", None)
    sub.out_cache_loc = fb.out_cache_loc[idx]
    if virtual is not None:
        sub.out_cache_loc_virtual = virtual[idx]
    if getattr(fb, "encoder_lens", None) is not None:
        sub.encoder_lens = fb.encoder_lens[idx]
    if getattr(fb, "kv_loc_plan", None) is not None and translator is not None:
        if virtual is not None:
            sub.out_cache_loc = sub.out_cache_loc_virtual
        translator.own_plan(sub).bind(sub, translator)
    return idx, sub


def finish_step(output, forward_batch) -> None:
    """End of a decode forward (the ``LogitsProcessor.forward`` hook calls it with its output).

    Cuts the speculated positions' rows from ``output`` (``next_token_logits`` goes from
    ``[batch_size + n_spec, vocab]`` to ``[batch_size, vocab]``, hidden states alike),
    storing each one's two most likely next tokens and their probabilities in its request's
    ``SpecState`` (``dual_token``; under coupled sampling, the token the coupled draw will give if
    the riding token was right, :mod:`dd_sglang.attention.coupling`), and reports the step's time. A no-op for batches this backend did not plan.
    """
    step = getattr(forward_batch, "dd_step", None)
    if not isinstance(step, DecodeStep):
        return
    forward_batch.dd_step = None
    plan = step.plan
    logits = getattr(output, "next_token_logits", None)
    if plan is not None and plan.spec.states and logits is not None:
        n, extra = plan.batch_size, len(plan.spec.states)
        if logits.shape[0] == n + extra:
            guesses = coupled_guesses(output, plan, forward_batch, n)
            if guesses is not None:  # the draw the sampler will make: certain, no runner-up
                for (state, i), g in zip(plan.spec.states, guesses, strict=True):
                    state.top[i] = (g, 1.0, g, 0.0)
            else:
                top = torch.softmax(logits[n:].float(), dim=-1).topk(2, dim=-1)
                states = plan.spec.states
                for (state, i), p, t in zip(states, top.values.tolist(), top.indices.tolist(), strict=True):
                    state.top[i] = (t[0], p[0], t[1], p[1])
            output.next_token_logits = logits[:n]
            hs = getattr(output, "hidden_states", None)
            if isinstance(hs, torch.Tensor) and hs.shape[0] == n + extra:
                output.hidden_states = hs[:n]
    if plan is not None and step.sparse_layers:
        step.events.sparse_rows(plan.num_rows * step.sparse_layers)
        if plan.exact.batch_rows:
            step.events.exact_rows(len(plan.exact.batch_rows) * step.sparse_layers)
    step.events.phase("attention", step.attention_s)
    step.events.step("sparse" if plan is not None else "dense", time.perf_counter() - step.started)
