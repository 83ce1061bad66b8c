"""What the sparse runtime counts and publishes, kept apart from the work that moves KV.

* :class:`RuntimeHooks`: the metric callbacks the radix-cache factory hands over once
  (transitions, rebuilds, unpins); the runtime's parts call them, none looks them up.
* :class:`SlotTally`: cumulative token counts for ``/stats`` and the bench.
* :class:`DecodeBuffers`: the device bytes the ``dualdecoder`` attention backend publishes
  each decode step (layer ring, critical-set columns, selection state), read by the
  scheduler's metrics (:mod:`dd_sglang.metrics.scheduler_stats`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from dd_sglang.kvcache.dualpath import PathState


@dataclass
class RuntimeHooks:
    """Metric callbacks of one runtime (each None when this process does not publish metrics).

    Attributes:
        on_transition: ``(src, dst)`` for every DualPath transition.
        on_rebuild: the number of tokens each REBUILD loaded back.
        on_unpin: called once per offload that found the device pool too full for its resident
            set and dropped the request's tree lock on its own prompt.
        on_path_change: called with the reason (one of :data:`~dd_sglang.kvcache.dualpath.PATH_CHANGE_REASONS`)
            each time a request changes path: an offload that made it sparse (``length``,
            ``pressure``), a new turn that rebuilds its full KV (``request``).
        on_pressure_offload: called with the trigger (``admission`` or ``retraction``) of each
            offload the ``pressure`` policy made (:mod:`dd_sglang.kvcache.pressure`).
    """

    on_transition: Callable[[PathState, PathState], None] | None = None
    on_rebuild: Callable[[int], None] | None = None
    on_unpin: Callable[[], None] | None = None
    on_path_change: Callable[[str], None] | None = None
    on_pressure_offload: Callable[[str], None] | None = None


@dataclass
class SlotTally:
    """Cumulative counts (tokens) of one runtime.

    Attributes:
        offloaded_tokens: tokens copied to the host tier by offloads.
        rebuilt_tokens: tokens loaded back from host prefix entries (REBUILD).
        reclaimed_slots: device slots given back (freed, or left to the radix tree as evictable cache).
        pressure_offloads: offloads the ``pressure`` policy made (requests, not tokens).
    """

    offloaded_tokens: int = 0
    rebuilt_tokens: int = 0
    reclaimed_slots: int = 0
    pressure_offloads: int = 0


@dataclass
class DecodeBuffers:
    """Device bytes the attention backend publishes each decode step.

    Attributes:
        ring_buffer_bytes: the layer ring: the sparse rows' attention K/V for the layers in flight.
        critical_buffer_bytes: the ring's critical-set columns, part of the above.
        selector_aux: device bytes kept only to choose critical sets, by selector name.
        host_index_bytes: host bytes of the int8 key index ``spec_host`` reads.
    """

    ring_buffer_bytes: int = 0
    critical_buffer_bytes: int = 0
    selector_aux: dict[str, int] = field(default_factory=dict)
    host_index_bytes: int = 0

    def clear_ring(self) -> None:
        """The layer ring was given back: it and its critical-set columns hold no bytes."""
        self.ring_buffer_bytes = self.critical_buffer_bytes = 0
