"""Hook on ``sglang.srt.layers.logits_processor.LogitsProcessor`` (the scheduler process's model).

* ``LogitsProcessor.forward`` (AFTER): when the ``dualdecoder`` backend appended
  speculated positions to a decode batch (a second query position per sparse
  request, :mod:`dd_sglang.prefetch.speculators`), record each one's argmax for
  the ``dual_token`` speculator and cut their rows, so SGLang samples exactly
  ``batch_size`` rows as usual, and report the step's time
  (:func:`dd_sglang.attention.step.finish_step`; the step's plan is read from
  the forward batch, the ``logits_metadata`` argument). Otherwise the output
  passes through untouched.
"""

from __future__ import annotations

from patches import Hook

_MODULE = "sglang.srt.layers.logits_processor"


def LogitsProcessor_forward(result, self, *args, **kwargs):
    from dd_sglang.attention.step import finish_step

    fb = args[3] if len(args) > 3 else kwargs.get("logits_metadata")
    finish_step(result, fb)
    return result


HOOKS = [Hook(f"{_MODULE}.LogitsProcessor.forward", LogitsProcessor_forward, "AFTER")]
