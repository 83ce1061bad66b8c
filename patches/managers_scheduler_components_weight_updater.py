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


def _invalidate(result):
    from dd_sglang.platform.linear import invalidate_packs

    invalidate_packs()
    return result


def SchedulerWeightUpdaterManager_update_weights_from_disk(result, self, *args, **kwargs):
    return _invalidate(result)


def SchedulerWeightUpdaterManager_update_weights_from_distributed(result, self, *args, **kwargs):
    return _invalidate(result)


def SchedulerWeightUpdaterManager_update_weights_from_tensor(result, self, *args, **kwargs):
    return _invalidate(result)


def SchedulerWeightUpdaterManager_update_weights_from_ipc(result, self, *args, **kwargs):
    return _invalidate(result)


def SchedulerWeightUpdaterManager_end_weight_update(result, self, *args, **kwargs):
    return _invalidate(result)


def SchedulerWeightUpdaterManager_resume_memory_occupation(result, self, *args, **kwargs):
    return _invalidate(result)


HOOKS = [
    Hook(f"{_CLASS}.{fn.__name__.split('_', 1)[1]}", fn, "AFTER")
    for fn in (
        SchedulerWeightUpdaterManager_update_weights_from_disk,
        SchedulerWeightUpdaterManager_update_weights_from_distributed,
        SchedulerWeightUpdaterManager_update_weights_from_tensor,
        SchedulerWeightUpdaterManager_update_weights_from_ipc,
        SchedulerWeightUpdaterManager_end_weight_update,
        SchedulerWeightUpdaterManager_resume_memory_occupation,
    )
]
