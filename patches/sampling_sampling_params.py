"""Hook on ``sglang.srt.sampling.sampling_params.SamplingParams`` (tokenizer-manager process).

* ``SamplingParams.verify`` (AFTER): validate a request's dd overrides in
  ``custom_params`` (``dd_top_k``, ``dd_sparse``, ``dd_selector``, ``dd_policy``, ``dd_trace``;
  :func:`dd_sglang.kvcache.params.request_overrides`, within the preset's
  ``sparse.request_selectors`` and ``sparse.request_max_top_k``). A bad value raises the
  ``ValueError`` SGLang's own checks raise, so the client gets HTTP 400 naming
  the field and its allowed values, before the request is queued or holds any KV.
"""

from __future__ import annotations

from patches import Hook

_MODULE = "sglang.srt.sampling.sampling_params"


def SamplingParams_verify(result, self, *args, **kwargs):
    from dd_sglang.kvcache.params import request_overrides
    from dd_sglang.plugin.runtime import request_limits

    request_overrides(self.custom_params, *request_limits())


HOOKS = [Hook(f"{_MODULE}.SamplingParams.verify", SamplingParams_verify, "AFTER")]
