"""Hook on ``sglang.srt.layers.logits_processor.LogitsProcessor`` (the scheduler process's model).

* ``LogitsProcessor.forward`` (AFTER): when the ``dualdecoder`` backend appended
  speculated positions to a decode batch (a second query position per sparse
  request, :mod:`dd_sglang.prefetch.speculators`), record each one's argmax for
  the ``dual_token`` speculator and cut their rows, so SGLang samples exactly
  ``batch_size`` rows as usual, and report the step's time
  (:func:`dd_sglang.attention.step.finish_step`; the step's plan is read from
  the forward batch, the ``logits_metadata`` argument). Otherwise the output
  passes through untouched.
* ``LogitsProcessor._compute_lm_head`` (AROUND): on a CPU with a bfloat16 lm_head
  on SGLang's plain product (no LoRA, no quantised method, no float32 lm_head,
  no RL on-policy target), the product runs through the weight packed once in
  oneDNN's layout (:func:`dd_sglang.platform.linear.packed_linear`, the same
  bits); otherwise SGLang's method runs.
"""

from __future__ import annotations

from patches import Hook

_MODULE = "sglang.srt.layers.logits_processor"


def LogitsProcessor_forward(result, self, *args, **kwargs):
    from dd_sglang.attention.step import finish_step

    fb = args[3] if len(args) > 3 else kwargs.get("logits_metadata")
    finish_step(result, fb)
    return result


def LogitsProcessor__compute_lm_head(original, self, hidden_states, lm_head, embedding_bias=None, **kwargs):
    from sglang.srt.layers.logits_processor import should_apply_lm_head_quant_method

    from dd_sglang.platform.linear import packed_linear

    plain = (
        hidden_states.device.type == "cpu"
        and not (hasattr(lm_head, "set_lora") and hasattr(lm_head, "apply_lora"))
        and hasattr(lm_head, "weight")
        and not should_apply_lm_head_quant_method(lm_head, getattr(lm_head, "quant_method", None))
        and not self.use_fp32_lm_head
        and getattr(self, "rl_on_policy_target", None) is None
    )
    if plain:  # SGLang's branch: torch.matmul(hidden_states.to(weight dtype), lm_head.weight.T)
        out = packed_linear(lm_head, hidden_states.to(lm_head.weight.dtype), None)
        if out is not None:
            return out
    return original(self, hidden_states, lm_head, embedding_bias, **kwargs)


HOOKS = [
    Hook(f"{_MODULE}.LogitsProcessor.forward", LogitsProcessor_forward, "AFTER"),
    Hook(f"{_MODULE}.LogitsProcessor._compute_lm_head", LogitsProcessor__compute_lm_head, "AROUND"),
]
SYMBOLS = (f"{_MODULE}.should_apply_lm_head_quant_method",)
