"""Per-request bookkeeping of the sparse path: one :class:`SparseRequest` per admitted
request, and the :class:`RequestTable` that finds them by request id and by
``req_to_token`` row.

A request enters the table when the scheduler first sees it after a prefill batch
(:meth:`dd_sglang.kvcache.admission.Admission.track`), gains a row entry
(``by_pool``) once offloaded, and leaves on release (:meth:`RequestTable.drop`), when
every release listener (the prefetch layer's per-request state) is told.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dd_sglang.kvcache.dualpath import DualPath, PathState

S = PathState

#: min_sparse_len of a request that asked to stay dense (``custom_params.dd_sparse: false``).
DENSE_ONLY = 2**62


@dataclass
class RequestChoices:
    """What one request decodes with: the preset's, or its ``custom_params`` overrides.

    Attributes:
        top_k: critical-set size.
        selector: selector name (:mod:`dd_sglang.prefetch.selectors`).
        trace: it asked for an attention trace (``dd_trace``, :mod:`dd_sglang.prefetch.trace`).
    """

    top_k: int = 0
    selector: str = ""
    trace: bool = False


@dataclass
class RetryMarks:
    """Free slots seen when an offload of the request last failed; it is retried only once more are free.

    Attributes:
        host_free: free host slots when the host tier could not take it (-1: never failed).
        device_free: free device slots when the pool could not give its resident set (-1: never failed).
    """

    host_free: int = -1
    device_free: int = -1


@dataclass
class SparseRequest:
    """Bookkeeping of one admitted request (one SGLang attempt).

    Attributes:
        rid: SGLang request id.
        path: its :class:`DualPath`.
        pool_idx: its ``req_to_token`` row once offloaded, else None.
        host_slots: ``[capacity]`` int64 host-tier slots; position ``p < host_len``
            lives at ``host_slots[p]`` (capacity is whole pages).
        host_len: positions ``[0, host_len)`` are on the host tier.
        keep_pos: ``[n]`` int64 sorted resident positions below the window
            (the sinks and the ``n_keep`` important tokens).
        win_start: positions ``[win_start, kv end)`` are resident (the window).
        released: the device slots outside the resident set have been given up.
        tail_flushed: the decode tail left on the device at release went to the host tier.
        choice: its critical-set size, selector and trace request (:class:`RequestChoices`).
        req: SGLang's ``Req`` (its token ids feed the speculators).
        retry: when a failed offload may be tried again (:class:`RetryMarks`).

    The prefetch layer's per-request state (speculation, chosen sets) is its own,
    dropped through :meth:`RequestTable.add_release_listener`.
    """

    rid: str
    path: DualPath
    pool_idx: int | None = None
    host_slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    host_len: int = 0
    keep_pos: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    win_start: int = 0
    released: bool = False
    tail_flushed: bool = False
    choice: RequestChoices = field(default_factory=RequestChoices)
    req: object = None
    retry: RetryMarks = field(default_factory=RetryMarks)

    def device_positions(self, end: int) -> torch.Tensor:
        """Sorted positions ``< end`` whose KV is on the device (int64)."""
        window = torch.arange(self.win_start, end, dtype=torch.int64)
        return torch.cat([self.keep_pos, window])

    def device_tokens(self, end: int) -> int:
        """Device slots held for positions ``< end``."""
        return int(self.keep_pos.numel()) + max(0, end - self.win_start)

    def host_candidates(self) -> torch.Tensor:
        """Sorted host-tier positions outside the resident set (int64): the critical-set candidates."""
        mask = torch.ones(self.host_len, dtype=torch.bool)
        mask[self.keep_pos[self.keep_pos < self.host_len]] = False
        mask[min(self.win_start, self.host_len) :] = False
        return mask.nonzero().flatten()


class RequestTable:
    """The live requests of one scheduler process.

    Attributes:
        requests: rid -> :class:`SparseRequest`, every tracked request.
        by_pool: ``req_to_token`` row -> the offloaded request holding it.
        kv_len: rid -> positions with KV after the last batch.
        just_released: tracked rids released during the current batch.
        rebuilt: rids whose prefix a REBUILD just loaded (their path starts in ``REBUILD``).
        pressure_marked: rids admitted under the ``pressure`` policy as requests that go sparse right
            after their prefill (:mod:`dd_sglang.kvcache.pressure`); dropped then, or on release.
    """

    def __init__(self) -> None:
        self.requests: dict[str, SparseRequest] = {}
        self.by_pool: dict[int, SparseRequest] = {}
        self.kv_len: dict[str, int] = {}
        self.just_released: set[str] = set()
        self.rebuilt: set[str] = set()
        self.pressure_marked: set[str] = set()
        self._release_listeners: list[Callable[[str], None]] = []

    def sparse_request(self, pool_idx: int) -> SparseRequest | None:
        """The request decoding sparsely in ``req_to_token`` row ``pool_idx``, else None."""
        st = self.by_pool.get(pool_idx)
        return st if st is not None and st.path.state is S.DECODE_SPARSE else None

    def state_counts(self) -> dict[str, int]:
        """Live requests by DualPath state name."""
        counts = {s.value: 0 for s in PathState}
        for st in self.requests.values():
            counts[st.path.state.value] += 1
        return counts

    def kv_end(self, st: SparseRequest) -> int:
        """Positions of ``st`` with KV after the last batch (its window start before any)."""
        return self.kv_len.get(st.rid, st.win_start)

    def resident_tokens(self) -> int:
        """Device slots held by released (sparse) requests, summed."""
        return sum(
            st.device_tokens(self.kv_end(st))
            for st in self.requests.values()
            if st.released and st.pool_idx is not None
        )

    def max_request_device_tokens(self) -> int:
        """Largest device-slot count of one released (sparse) request now."""
        return max(
            (st.device_tokens(self.kv_end(st)) for st in self.requests.values() if st.released), default=0
        )

    def sparse_requests(self):
        """The tracked requests now in ``DECODE_SPARSE``."""
        return (st for st in self.requests.values() if st.path.state is S.DECODE_SPARSE)

    def add_release_listener(self, fn: Callable[[str], None]) -> None:
        """Call ``fn(rid)`` whenever a tracked request is released (finished, aborted, retracted)."""
        if fn not in self._release_listeners:
            self._release_listeners.append(fn)

    def drop(self, rid: str) -> SparseRequest | None:
        """Forget request ``rid`` (SGLang released its row); its :class:`SparseRequest`, or None if untracked.

        Release listeners hear of a tracked request, and it counts as released in this batch.
        """
        st = self.requests.pop(rid, None)
        self.kv_len.pop(rid, None)
        self.rebuilt.discard(rid)
        self.pressure_marked.discard(rid)
        if st is None:
            return None
        for fn in self._release_listeners:
            fn(rid)
        self.just_released.add(rid)
        if st.pool_idx is not None and self.by_pool.get(st.pool_idx) is st:
            del self.by_pool[st.pool_idx]
        return st
