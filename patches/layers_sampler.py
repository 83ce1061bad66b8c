"""Hook on ``sglang.srt.layers.sampler.Sampler`` (the scheduler process's model).

* ``Sampler.forward`` (AROUND): on a step whose sparse rows sample with
  ``experimental.sampling: coupled``, SGLang's sampler runs as usual and those rows'
  tokens are replaced by the coupled draw the step stashed on the logits output
  (:func:`dd_sglang.attention.coupling.sample`); any other call runs SGLang's
  sampler untouched.
"""

from __future__ import annotations

from patches import Hook

_MODULE = "sglang.srt.layers.sampler"


def Sampler_forward(original, self, logits_output, sampling_info, *args, **kwargs):
    from dd_sglang.attention.coupling import sample

    return sample(original, self, logits_output, sampling_info, *args, **kwargs)


HOOKS = [Hook(f"{_MODULE}.Sampler.forward", Sampler_forward, "AROUND")]
