"""Hooks on ``sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager``.

* ``update_weights_from_disk`` / ``_distributed`` / ``_tensor`` / ``_ipc``,
  ``end_weight_update`` and ``resume_memory_occupation`` (AFTER): the model's
  weights may have changed in place, so every packed CPU linear weight is dropped
  (:func:`dd_sglang.platform.linear.invalidate_packs`) and packed again from the
  new values on its next use. The scheduler runs no forward during an update.
"""

from __future__ import annotations

from patches import Hook

_CLASS = "sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager"


#: The updater's methods after which the weights may have changed.
METHODS = (
    "update_weights_from_disk",
    "update_weights_from_distributed",
    "update_weights_from_tensor",
    "update_weights_from_ipc",
    "end_weight_update",
    "resume_memory_occupation",
)


def _invalidating(method: str):
    """The AFTER hook of ``SchedulerWeightUpdaterManager.<method>``: drop every packed weight, return
    the method's result. Named after the symbol (``SchedulerWeightUpdaterManager_<method>``)."""

    def hook(result, self, *args, **kwargs):
        from dd_sglang.platform.linear import invalidate_packs

        invalidate_packs()
        return result

    hook.__name__ = hook.__qualname__ = f"SchedulerWeightUpdaterManager_{method}"
    return hook


HOOKS = [Hook(f"{_CLASS}.{method}", _invalidating(method), "AFTER") for method in METHODS]
