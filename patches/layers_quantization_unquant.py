"""Hook on ``sglang.srt.layers.quantization.unquant.UnquantizedLinearMethod`` (the scheduler process's model).

* ``UnquantizedLinearMethod.apply`` (AROUND): on a CPU with bfloat16 weights,
  the product runs through the layer's weight packed once in oneDNN's layout
  (:func:`dd_sglang.platform.linear.packed_linear`: the same bits as SGLang's
  ``F.linear``, checked per weight before first use). Everywhere else (CUDA,
  float32, SGLang's own AMX backend, packing off) SGLang's method runs unchanged.
  A CPU bfloat16 product of more rows (a prefill chunk) runs SGLang's method on
  its rows padded to a row bucket (:func:`dd_sglang.platform.linear.bucketed_linear`),
  so oneDNN builds and caches primitives for few row counts.
"""

from __future__ import annotations

from patches import Hook

_MODULE = "sglang.srt.layers.quantization.unquant"


def UnquantizedLinearMethod_apply(original, self, layer, x, bias=None):
    from dd_sglang.platform.linear import bucketed_linear, packed_linear

    out = packed_linear(layer, x, bias)
    if out is None:
        out = bucketed_linear(layer, x, lambda xp: original(self, layer, xp, bias))
    return original(self, layer, x, bias) if out is None else out


HOOKS = [Hook(f"{_MODULE}.UnquantizedLinearMethod.apply", UnquantizedLinearMethod_apply, "AROUND")]
