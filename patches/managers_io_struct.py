"""Hook on ``sglang.srt.managers.io_struct.GenerateReqInput`` (the HTTP server's process).

* ``GenerateReqInput._handle_parallel_sampling`` (AFTER): once SGLang has read
  ``n`` (its ``parallel_sample_num``), refuse a value outside ``[1, 128]``
  before the request is fanned out into ``n`` copies
  (:func:`dd_sglang.plugin.requests.check_parallel_samples`). The
  ``ValueError`` becomes SGLang's usual HTTP 400 naming ``n``.
"""

from __future__ import annotations

from patches import Hook

_MODULE = "sglang.srt.managers.io_struct"


def GenerateReqInput__handle_parallel_sampling(result, self, *args, **kwargs):
    from dd_sglang.plugin.requests import check_parallel_samples

    check_parallel_samples(self.parallel_sample_num)


HOOKS = [
    Hook(
        f"{_MODULE}.GenerateReqInput._handle_parallel_sampling",
        GenerateReqInput__handle_parallel_sampling,
        "AFTER",
    )
]
