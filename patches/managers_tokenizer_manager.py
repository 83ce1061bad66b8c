"""Hook on ``sglang.srt.managers.tokenizer_manager.TokenizerManager`` (the HTTP server's process).

* ``TokenizerManager._validate_one_request`` (AROUND): before SGLang's own checks, refuse a prompt that
  tokenized to no token (``/generate`` with ``"text": ""``) or holds a token id
  outside the vocabulary, which SGLang 0.5.23 would otherwise hand to the
  scheduler, whose forward pass then crashes and stops the server
  (:func:`dd_sglang.plugin.requests.check_prompt_tokens`); after them (so SGLang's own
  messages, e.g. the context length, come first), with ``--radix-cache-backend dualdecoder``,
  refuse a prompt past the device pool (``--max-total-tokens - 6``; SGLang's own bound) that the
  host tier cannot hold, which now bounds it instead of the pool
  (:func:`~dd_sglang.plugin.requests.check_host_tier_holds`), or that asks to stay dense
  (``custom_params.dd_sparse: false``); a prompt the pool takes is served as before (densely
  when the tier is full). The
  ``ValueError`` becomes SGLang's usual HTTP 400 with the message.
"""

from __future__ import annotations

from patches import Hook

_MODULE = "sglang.srt.managers.tokenizer_manager"


def TokenizerManager__validate_one_request(original, self, obj, input_ids, *args, **kwargs):
    from dd_sglang.plugin.requests import check_host_tier_holds, check_prompt_tokens

    check_prompt_tokens(input_ids, self.model_config.vocab_size)
    result = original(self, obj, input_ids, *args, **kwargs)  # SGLang's own limits (the context) first
    pool = getattr(self.server_args, "max_total_tokens", None)
    if not input_ids or not pool or getattr(self.server_args, "radix_cache_backend", None) != "dualdecoder":
        return result
    from dd_sglang.kvcache.params import kv_bytes_per_token, sglang_input_limits

    limit = sglang_input_limits(pool)[1]
    if len(input_ids) < limit:
        return result  # the pool takes it: served as before
    from dd_sglang.plugin.runtime import current_config

    mc = self.model_config  # past the pool: prefilled through the host tier, which must hold it
    per_token = kv_bytes_per_token(mc.num_hidden_layers, mc.get_total_num_kv_heads(), mc.head_dim, mc.dtype.itemsize)
    check_host_tier_holds(len(input_ids), current_config().sparse.host_tier_bytes, per_token)
    sampling = getattr(obj, "sampling_params", None)  # one request's dict (the OpenAI routes build it too)
    custom = sampling.get("custom_params") if isinstance(sampling, dict) else None
    if isinstance(custom, dict) and custom.get("dd_sparse") is False:
        raise ValueError(f"custom_params.dd_sparse: false keeps the whole prompt on the device, whose pool "
                         f"takes prompts below {limit} tokens; this one has {len(input_ids)}")  # fmt: skip
    return result


HOOKS = [
    Hook(
        f"{_MODULE}.TokenizerManager._validate_one_request", TokenizerManager__validate_one_request, "AROUND"
    )
]
