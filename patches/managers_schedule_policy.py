"""Hook on ``sglang.srt.managers.schedule_policy.PrefillAdder`` (the scheduler process's admission).

* ``PrefillAdder._get_running_request_total_token_offset`` (AROUND): SGLang reserves, for every
  running request, the device slots it may still generate (``min(max_new_tokens - generated,
  4096)``, times the new-token ratio) before it admits a new prefill. With
  ``--radix-cache-backend dualdecoder`` a ``DECODE_SPARSE`` request can add at most
  ``resident_bound`` minus what it holds (:meth:`SparseRuntime.decode_growth_bound`), so its
  reservation is capped there; every other request keeps SGLang's figure.
* ``PrefillAdder._check_prefill_budget`` (AROUND): a request being admitted must fit with its
  input plus ``min(max_new_tokens - generated, 4096)`` (``add_one_req``). One that goes sparse
  after its prefill never holds more than its resident bound afterwards, so only that bound is
  counted for its generation (:meth:`SparseRuntime.admission_new_tokens`); the budget's own
  check then runs unchanged. When it refuses (SGLang would answer ``NO_TOKEN``) and the
  ``pressure`` policy has running dense requests to offload (:mod:`dd_sglang.kvcache.pressure`),
  those the plan chooses are offloaded now, the adder's reservation for each is cut to what it
  can still add (``memory_budget.total_offset``, as SGLang's own ``preempt_to_schedule`` adjusts
  it), and the check runs once more; a plan that makes the waiting request itself go sparse
  after its prefill counts only ``resident_bound`` for its generation.

  A prompt longer than the device pool takes (:meth:`SparseRuntime.over_pool`) is admitted one chunk
  at a time, each chunk prefilled through the host tier (:meth:`Offloader.offload_chunk`): it needs
  its next chunk plus its resident bound (:meth:`SparseRuntime.over_pool_chunk`, which also holds
  it back while the host tier cannot take its prompt), and the chunk limit SGLang then cuts the
  prefill to is that chunk.

Both read the runtime from the adder's own ``tree_cache`` (the ``dualdecoder`` radix cache holds it).
"""

from __future__ import annotations

from patches import Hook

_MODULE = "sglang.srt.managers.schedule_policy"


def PrefillAdder__get_running_request_total_token_offset(original, self, req):
    from dd_sglang.kvcache.radix import runtime_of

    offset = original(self, req)
    runtime = runtime_of(self.tree_cache)
    bound = None if runtime is None else runtime.decode_growth_bound(req.rid)
    return offset if bound is None else min(offset, bound)


def PrefillAdder__check_prefill_budget(original, self, req, *args, total_tokens, **kwargs):
    from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS

    from dd_sglang.kvcache.radix import runtime_of

    runtime = runtime_of(self.tree_cache)
    if runtime is None:
        return original(self, req, *args, total_tokens=total_tokens, **kwargs)
    if runtime.over_pool(req):
        chunk = runtime.over_pool_chunk(req, kwargs["extend_input_len"], kwargs.get("chunk_limit"),
                                        getattr(self.memory_budget, "remaining_total", 0))  # fmt: skip
        if chunk is None:
            return False, None
        total = chunk + runtime.params.resident_bound
        return original(self, req, *args, total_tokens=total, **{**kwargs, "chunk_limit": chunk})
    max_new = min(max(req.sampling_params.max_new_tokens - len(req.output_ids), 0), CLIP_MAX_NEW_TOKENS)
    cap = runtime.admission_new_tokens(req, max_new)
    if cap is not None:
        total_tokens -= max_new - cap
    verdict = original(self, req, *args, total_tokens=total_tokens, **kwargs)
    if verdict[0] or cap is not None or not runtime.pressure.active(req):
        return verdict  # admitted, or nothing the pressure policy may move (always: main's behaviour)
    return runtime.pressure.relieve_admission(
        self, req, max_new, total_tokens, verdict,
        lambda total: original(self, req, *args, total_tokens=total, **kwargs),
    )  # fmt: skip


HOOKS = [
    Hook(
        f"{_MODULE}.PrefillAdder._get_running_request_total_token_offset",
        PrefillAdder__get_running_request_total_token_offset,
        "AROUND",
    ),
    Hook(f"{_MODULE}.PrefillAdder._check_prefill_budget", PrefillAdder__check_prefill_budget, "AROUND"),
]
