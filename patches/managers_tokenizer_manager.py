"""Hook on ``sglang.srt.managers.tokenizer_manager.TokenizerManager`` (the HTTP server's process).

* ``TokenizerManager._validate_one_request`` (BEFORE): refuse a prompt that
  tokenized to no token (``/generate`` with ``"text": ""``) or holds a token id
  outside the vocabulary, which SGLang 0.5.23 would otherwise hand to the
  scheduler, whose forward pass then crashes and stops the server
  (:func:`dd_sglang.plugin.requests.check_prompt_tokens`); with ``--radix-cache-backend
  dualdecoder``, refuse a prompt longer than the host tier holds, which now bounds it
  instead of the device pool (:func:`~dd_sglang.plugin.requests.check_host_tier_holds`), and
  a prompt past the pool that asks to stay dense (``custom_params.dd_sparse: false``). The
  ``ValueError`` becomes SGLang's usual HTTP 400 with the message.
"""

from __future__ import annotations

from patches import Hook

_MODULE = "sglang.srt.managers.tokenizer_manager"


def TokenizerManager__validate_one_request(self, obj, input_ids, *args, **kwargs):
    from dd_sglang.plugin.requests import check_host_tier_holds, check_prompt_tokens

    check_prompt_tokens(input_ids, self.model_config.vocab_size)
    if input_ids and getattr(self.server_args, "radix_cache_backend", None) == "dualdecoder":
        from dd_sglang.plugin.runtime import current_config

        mc = self.model_config
        itemsize = mc.dtype.itemsize if hasattr(mc.dtype, "itemsize") else 2
        per_token = mc.num_hidden_layers * 2 * mc.get_total_num_kv_heads() * mc.head_dim * itemsize
        check_host_tier_holds(len(input_ids), current_config().sparse.host_tier_bytes, per_token)
        pool = getattr(self.server_args, "max_total_tokens", None)
        sampling = getattr(obj, "sampling_params", None)  # one request's dict (the OpenAI routes build it too)
        custom = sampling.get("custom_params") if isinstance(sampling, dict) else None
        if pool and isinstance(custom, dict) and custom.get("dd_sparse") is False and len(input_ids) >= pool - 6:
            raise ValueError(f"custom_params.dd_sparse: false keeps the whole prompt on the device, whose pool "
                             f"takes prompts below {pool - 6} tokens; this one has {len(input_ids)}")  # fmt: skip


HOOKS = [
    Hook(
        f"{_MODULE}.TokenizerManager._validate_one_request", TokenizerManager__validate_one_request, "BEFORE"
    )
]
