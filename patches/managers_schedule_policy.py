"""Hook on ``sglang.srt.managers.schedule_policy.PrefillAdder`` (the scheduler process's admission).

* ``PrefillAdder._get_running_request_total_token_offset`` (AROUND): SGLang reserves, for every
  running request, the device slots it may still generate (``min(max_new_tokens - generated,
  4096)``, times the new-token ratio) before it admits a new prefill. With
  ``--radix-cache-backend dualdecoder`` a ``DECODE_SPARSE`` request can add at most
  ``resident_bound`` minus what it holds (:meth:`SparseRuntime.decode_growth_bound`), so its
  reservation is capped there; every other request keeps SGLang's figure.
"""

from __future__ import annotations

from patches import Hook

_MODULE = "sglang.srt.managers.schedule_policy"


def PrefillAdder__get_running_request_total_token_offset(original, self, req):
    from dd_sglang.kvcache import sparse_runtime

    offset = original(self, req)
    runtime = sparse_runtime.current()
    bound = None if runtime is None else runtime.decode_growth_bound(req.rid)
    return offset if bound is None else min(offset, bound)


HOOKS = [
    Hook(
        f"{_MODULE}.PrefillAdder._get_running_request_total_token_offset",
        PrefillAdder__get_running_request_total_token_offset,
        "AROUND",
    )
]
