"""Hooks on ``sglang.srt.managers.scheduler.Scheduler`` (the scheduler process).

* ``Scheduler.process_batch_result`` (AFTER): after every prefill/decode batch,
  with ``--radix-cache-backend dualdecoder``, let the sparse runtime offload
  requests whose prefill just finished and flush/slide the sparse ones
  (``SparseRuntime.after_extend`` / ``after_decode``; errors there propagate:
  a half-done offload must not be hidden). When that made device slots
  reclaimable, reopen admission (``running_batch.batch_is_full = False``, as
  SGLang does when a request leaves); reopen it too while requests wait and a running
  one could be offloaded for them under the ``pressure`` policy
  (``SparseRuntime.admission_may_reopen``; the admission hook,
  ``patches/managers_schedule_policy.py``, then offloads it). Then refresh the gauges
  (rate-limited by ``metrics.update_interval_s``). After a prefill batch, on the CPU platform,
  return glibc's free heap to the kernel at most every ``DD_SGLANG_CPU_HEAP_TRIM_S`` seconds
  (:func:`dd_sglang.platform.heap.after_prefill_batch`: prompts of every length leave freed
  buffers of new sizes that glibc otherwise keeps, issue 52), with or without the sparse runtime.
* ``Scheduler.init_req_max_new_tokens`` (AROUND): for a prompt longer than the device pool
  (:meth:`SparseRuntime.over_pool`, prefilled through the host tier), SGLang's clip of
  ``max_new_tokens`` to what the pool holds beside the whole prompt is undone: only the context
  (``max_req_len``) bounds it.
* ``Scheduler.on_idle`` (AFTER): the same while idle, so gauges return to the
  idle baseline after the last request; and, on the CPU platform, one heap trim when prefills ran
  since the last (:func:`dd_sglang.platform.heap.when_scheduler_idle`). SGLang returns from
  ``on_idle`` early, without ``maybe_sleep_on_idle``, while requests wait but no batch runs (a
  stall): this call covers that case; when fully idle the trim already ran before the sleep and
  this one finds nothing behind.
* ``Scheduler.maybe_sleep_on_idle`` (BEFORE): with ``--sleep-on-idle`` the
  scheduler blocks here (inside ``on_idle``) until the next request or for up to
  1 s; trim the heap first when prefills ran since the last trim (so an idle
  server's memory is returned before it sleeps, not after), and publish
  unthrottled, so the gauges show the idle state while it sleeps.

A failure inside a metrics update is logged once and never reaches the scheduler loop.
"""

from __future__ import annotations

from patches import Hook

_MODULE = "sglang.srt.managers.scheduler"


def Scheduler_process_batch_result(result, self, *args, **kwargs):
    from dd_sglang.kvcache.radix import runtime_of
    from dd_sglang.plugin.runtime import refresh_scheduler_metrics

    runtime = runtime_of(getattr(self, "tree_cache", None))
    batch = args[0] if args else kwargs.get("batch")
    if runtime is not None and batch is not None and batch.reqs:
        mode = batch.forward_mode
        reclaimed = 0
        if mode.is_decode():
            reclaimed = runtime.after_decode(batch, self.tree_cache)
        elif mode.is_extend():
            reclaimed = runtime.after_extend(batch, self.tree_cache)
        running = getattr(self, "running_batch", None)
        if running is not None and (
            reclaimed
            or (runtime.pressure.active() and getattr(self, "waiting_queue", None)
                and runtime.admission_may_reopen(running.reqs))
        ):  # fmt: skip
            # SGLang closes admission (batch_is_full) when a request did not fit (NO_TOKEN) and
            # only a leaving request reopens it; released device KV is room just the same, and so
            # is the KV of a running request the pressure policy may offload.
            running.batch_is_full = False
    refresh_scheduler_metrics(self)
    if batch is not None and batch.forward_mode.is_extend():
        from dd_sglang.platform.heap import after_prefill_batch

        after_prefill_batch()


def Scheduler_on_idle(result, self, *args, **kwargs):
    from dd_sglang.platform.heap import when_scheduler_idle
    from dd_sglang.plugin.runtime import refresh_scheduler_metrics

    when_scheduler_idle()
    refresh_scheduler_metrics(self)


def Scheduler_maybe_sleep_on_idle(self, *args, **kwargs):
    from dd_sglang.platform.heap import when_scheduler_idle
    from dd_sglang.plugin.runtime import refresh_scheduler_metrics

    when_scheduler_idle()
    if getattr(self, "idle_sleeper", None) is not None:
        refresh_scheduler_metrics(self, force=True)


def Scheduler_init_req_max_new_tokens(original, self, req, *args, **kwargs):
    from dd_sglang.kvcache.radix import runtime_of

    asked = req.sampling_params.max_new_tokens
    asked = 1 << 30 if asked is None else asked  # SGLang's own reading of "no limit"
    result = original(self, req, *args, **kwargs)
    runtime = runtime_of(getattr(self, "tree_cache", None))
    if runtime is not None and runtime.over_pool(req) and not req.finished():
        # SGLang clips the generation to what the pool holds beside the whole prompt (0 here); the
        # request decodes sparsely from its resident set, so only the context bounds it.
        req.sampling_params.max_new_tokens = max(0, min(asked, self.max_req_len - len(req.origin_input_ids) - 1))
    return result


HOOKS = [
    Hook(f"{_MODULE}.Scheduler.process_batch_result", Scheduler_process_batch_result, "AFTER"),
    Hook(f"{_MODULE}.Scheduler.init_req_max_new_tokens", Scheduler_init_req_max_new_tokens, "AROUND"),
    Hook(f"{_MODULE}.Scheduler.on_idle", Scheduler_on_idle, "AFTER"),
    Hook(f"{_MODULE}.Scheduler.maybe_sleep_on_idle", Scheduler_maybe_sleep_on_idle, "BEFORE"),
]
