"""Device-tier accounting read from a live SGLang ``Scheduler``, published as gauges.

:func:`snapshot` reads, without changing anything:

* ``scheduler.token_to_kv_pool_allocator``: ``size`` (token slots) and
  ``available_size()`` (free slots); SGLang file ``mem_cache/allocator/base.py``.
* its KV pool's ``get_kv_size_bytes()`` -> ``(k_bytes, v_bytes)`` for all layers
  (``mem_cache/memory_pool.py``), and the slot count of the first K buffer.
* ``scheduler.tree_cache.evictable_size()`` (tokens held only by the radix cache).
* ``scheduler.running_batch.reqs``.

Bytes per token slot = (k_bytes + v_bytes) / slots, exact for SGLang's
token-indexed pools, whose every layer buffer has the same number of slots.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class DeviceTierSnapshot:
    """One reading of the device tier. All sizes in bytes unless named ``_tokens``."""

    capacity_bytes: int
    bytes_per_token: int
    slots_total_tokens: int
    used_tokens: int
    evictable_tokens: int
    running_requests: int
    cuda_allocated_bytes: int | None
    host: dict | None = None  # sparse runtime figures (see sparse_snapshot), None without dualdecoder

    @property
    def used_bytes(self) -> int:
        return self.used_tokens * self.bytes_per_token

    @property
    def evictable_bytes(self) -> int:
        return self.evictable_tokens * self.bytes_per_token

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(used_bytes=self.used_bytes, evictable_bytes=self.evictable_bytes)
        return d


def snapshot(scheduler) -> DeviceTierSnapshot:
    """Read the device-tier accounting of ``scheduler`` (an SGLang ``Scheduler``)."""
    allocator = scheduler.token_to_kv_pool_allocator
    pool = allocator.get_kvcache()
    k_bytes, v_bytes = pool.get_kv_size_bytes()
    capacity = int(k_bytes + v_bytes)
    slots = int(pool.k_buffer[0].shape[0]) if getattr(pool, "k_buffer", None) else int(allocator.size)
    per_token = capacity // slots if slots else 0
    used = int(allocator.size - allocator.available_size())
    tree = getattr(scheduler, "tree_cache", None)
    evictable = int(tree.evictable_size()) if tree is not None else 0
    batch = getattr(scheduler, "running_batch", None)
    running = len(batch.reqs) if batch is not None and batch.reqs is not None else 0
    cuda_bytes = None
    import torch

    if torch.cuda.is_available():
        cuda_bytes = int(torch.cuda.memory_allocated())
    return DeviceTierSnapshot(
        capacity, per_token, slots, used, evictable, running, cuda_bytes, sparse_snapshot(tree)
    )


def sparse_snapshot(tree_cache) -> dict | None:
    """Host-tier and sparse-path figures of the ``SparseRuntime`` attached to SGLang's tree cache
    ``tree_cache`` (None without ``--radix-cache-backend dualdecoder``).

    Keys: ``host_capacity_bytes``, ``host_used_bytes``, ``host_prefix_cache_bytes``,
    ``resident_tokens`` (device slots of sparse requests), ``request_device_tokens_max``,
    ``critical_buffer_bytes``, ``ring_buffer_bytes`` (the backend's layer ring),
    ``selector_aux_bytes`` (device selection state by selector), ``host_index_bytes``, ``states`` (requests by DualPath state), ``offloaded_tokens``,
    ``rebuilt_tokens``, ``pressure_offloads`` (offloads the pressure policy made), ``host_bytes_per_token``.
    """
    from dd_sglang.kvcache.radix import runtime_of

    rt = runtime_of(tree_cache)
    if rt is None:
        return None
    per_token = rt.host.get_size_per_token()
    return {
        "host_capacity_bytes": rt.host.capacity_bytes,
        "host_used_bytes": rt.host.used_bytes,
        "host_prefix_cache_bytes": rt.host_entry_tokens() * per_token,
        "host_bytes_per_token": per_token,
        "resident_tokens": rt.resident_tokens(),
        "request_device_tokens_max": rt.max_request_device_tokens(),
        "critical_buffer_bytes": rt.buffers.critical_buffer_bytes if rt.by_pool else 0,
        "ring_buffer_bytes": rt.buffers.ring_buffer_bytes if rt.by_pool else 0,
        "selector_aux_bytes": rt.selector_aux_bytes(),
        "host_index_bytes": rt.buffers.host_index_bytes,
        "states": rt.state_counts(),
        "offloaded_tokens": rt.offloaded_tokens,
        "rebuilt_tokens": rt.rebuilt_tokens,
        "pressure_offloads": rt.pressure_offloads,
    }


class SchedulerMetrics:
    """Publishes :func:`snapshot` into the gauges of :mod:`dd_sglang.metrics.definitions`.

    Args:
        interval_s: minimum seconds between two publications (the hooks call
            :meth:`maybe_update` after every batch and on every idle poll).
        report_requests: True on attention-TP rank 0 only (see definitions).
    """

    def __init__(self, interval_s: float, report_requests: bool):
        self.interval_s = interval_s
        self.report_requests = report_requests
        self._last = 0.0
        self._trims = (0, 0.0)  # the heap trimmer's (trims, seconds) at the last publication

    def maybe_update(self, scheduler, force: bool = False) -> DeviceTierSnapshot | None:
        now = time.monotonic()
        if not force and now - self._last < self.interval_s:
            return None
        self._last = now
        snap = snapshot(scheduler)
        self.publish(snap)
        return snap

    def publish(self, snap: DeviceTierSnapshot) -> None:
        from dd_sglang.metrics import definitions as m
        from dd_sglang.platform.heap import scheduler_trimmer

        trimmer = scheduler_trimmer()
        m.CPU_HEAP_TRIMS.inc(trimmer.trims - self._trims[0])
        m.CPU_HEAP_TRIM_SECONDS.inc(trimmer.seconds - self._trims[1])
        self._trims = (trimmer.trims, trimmer.seconds)

        m.DEVICE_KV_CAPACITY_BYTES.set(snap.capacity_bytes)
        m.DEVICE_KV_USED_BYTES.set(snap.used_bytes)
        m.DEVICE_KV_EVICTABLE_BYTES.set(snap.evictable_bytes)
        h = snap.host
        m.HOST_TIER_CAPACITY_BYTES.set(h["host_capacity_bytes"] if h else 0)
        m.HOST_TIER_USED_BYTES.set(h["host_used_bytes"] if h else 0)
        m.HOST_TIER_PREFIX_CACHE_BYTES.set(h["host_prefix_cache_bytes"] if h else 0)
        m.SPARSE_RESIDENT_BYTES.set(h["resident_tokens"] * snap.bytes_per_token if h else 0)
        m.SPARSE_REQUEST_DEVICE_TOKENS_MAX.set(h["request_device_tokens_max"] if h else 0)
        m.CRITICAL_SET_BUFFER_BYTES.set(h["critical_buffer_bytes"] if h else 0)
        m.LAYER_RING_BUFFER_BYTES.set(h["ring_buffer_bytes"] if h else 0)
        aux = h["selector_aux_bytes"] if h else {}
        for sel in ("oracle", "spec_host", "spec_host_exact", "quest_device", "recency", "host_sync"):
            m.SELECTOR_AUX_BYTES.labels(selector=sel).set(aux.get(sel, 0))
        m.HOST_INDEX_BYTES.set(h["host_index_bytes"] if h else 0)
        if snap.cuda_allocated_bytes is not None:
            m.HBM_USED_BYTES.labels(source="cuda_allocator").set(snap.cuda_allocated_bytes)
        else:
            m.HBM_USED_BYTES.labels(source="cpu_device_pool").set(snap.capacity_bytes)
        if self.report_requests:
            for state in m.DUALPATH_STATES:
                if h is not None:
                    m.DUALPATH_REQUESTS.labels(state=state).set(h["states"][state])
                else:
                    m.DUALPATH_REQUESTS.labels(state=state).set(
                        snap.running_requests if state == "DENSE" else 0
                    )
