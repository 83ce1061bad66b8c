"""Hook on ``sglang.srt.managers.tokenizer_manager.TokenizerManager`` (the HTTP server's process).

* ``TokenizerManager._validate_one_request`` (BEFORE): refuse a prompt that
  tokenized to no token (``/generate`` with ``"text": ""``) or holds a token id
  outside the vocabulary, which SGLang 0.5.23 would otherwise hand to the
  scheduler, whose forward pass then crashes and stops the server
  (:func:`dd_sglang.plugin.requests.check_prompt_tokens`). The ``ValueError``
  becomes SGLang's usual HTTP 400 with the message.
"""

from __future__ import annotations

from patches import Hook

_MODULE = "sglang.srt.managers.tokenizer_manager"


def TokenizerManager__validate_one_request(self, obj, input_ids, *args, **kwargs):
    from dd_sglang.plugin.requests import check_prompt_tokens

    check_prompt_tokens(input_ids, self.model_config.vocab_size)


HOOKS = [
    Hook(
        f"{_MODULE}.TokenizerManager._validate_one_request", TokenizerManager__validate_one_request, "BEFORE"
    )
]
