"""Hook on ``sglang.srt.managers.schedule_batch.ScheduleBatch`` (the scheduler process's decode batch).

* ``ScheduleBatch.check_decode_mem`` (AROUND): before each decode step
  (``Scheduler.update_running_batch``) SGLang asks whether the step's new tokens fit the device
  pool, and retracts running requests when they do not. With ``--radix-cache-backend
  dualdecoder`` and running ``DENSE`` requests under the ``pressure`` policy, a failed check
  first offloads those requests to the host tier, the most slots first, until SGLang's own check
  passes (:meth:`PressureRelief.relieve_retraction
  <dd_sglang.kvcache.pressure.PressureRelief.relieve_retraction>`): nothing is retracted
  when offloads make the room. Only the whole-batch check is touched (``selected_indices``
  None); the calls inside ``retract_decode`` run unchanged, and so does every call while no
  request is under ``pressure`` (:meth:`PressureRelief.active
  <dd_sglang.kvcache.pressure.PressureRelief.active>`: the preset's ``always`` and no
  ``custom_params.dd_policy``).
"""

from __future__ import annotations

from patches import Hook

_MODULE = "sglang.srt.managers.schedule_batch"


def ScheduleBatch_check_decode_mem(original, self, selected_indices=None):
    from dd_sglang.kvcache.radix import runtime_of

    runtime = runtime_of(getattr(self, "tree_cache", None))
    if runtime is None or selected_indices is not None or not runtime.pressure.active():
        return original(self, selected_indices)  # policy always (no request asked otherwise): SGLang's answer
    fits = original(self, selected_indices)
    if fits:
        return fits
    return runtime.pressure.relieve_retraction(self.reqs, lambda: original(self), self.tree_cache)


HOOKS = [Hook(f"{_MODULE}.ScheduleBatch.check_decode_mem", ScheduleBatch_check_decode_mem, "AROUND")]
