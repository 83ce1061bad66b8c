"""A custom logit processor that forces a request's output to given token ids (teacher forcing).

SGLang applies custom logit processors to each request's next-token logits
before sampling (``--enable-custom-logit-processor``; the request sends
``custom_logit_processor: ForceTokens.to_str()`` and the ids in
``sampling_params.custom_params["force_ids"]``). Output token ``j`` becomes
``force_ids[j]``: the decode follows the real text while the speculators still
guess from the model, which is DESIGN.md's "teacher-forced real text" regime.
The class is pickled by reference, so the server imports it from ``bench``
(the server's working directory is the project root).
"""

from __future__ import annotations

import torch
from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor


class ForceTokens(CustomLogitProcessor):
    """Set every logit to -inf except ``force_ids[len(req.output_ids)]`` (while ids remain)."""

    def __call__(self, logits: torch.Tensor, custom_param_list=None) -> torch.Tensor:
        for i, params in enumerate(custom_param_list or []):
            ids, req = params.get("force_ids"), params.get("__req__")
            if not ids or req is None:
                continue
            j = len(req.output_ids)
            if j < len(ids):
                logits[i].fill_(float("-inf"))
                logits[i, int(ids[j])] = 0.0
        return logits
