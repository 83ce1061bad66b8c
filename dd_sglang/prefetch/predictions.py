"""The prefetch layer's state that outlives a step: per-request predictions and the next step's sets.

* :class:`RequestPrediction`: one sparse request's speculation state and how far each key index
  covers its host-tier positions; kept in the :class:`PredictionStore` until the request is released.
* :class:`NextSets`: the critical sets the lookahead selectors chose during this step for the
  next one (``[layers, rows, Hkv, k]``), filled layer by layer and read by the next step's plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dd_sglang.prefetch.speculators import SpecState


@dataclass
class RequestPrediction:
    """The prefetch layer's state of one sparse request (dropped by :meth:`PredictionStore.release`).

    Attributes:
        spec: the speculator's state.
        indexed: positions of the request in the key index, by location
            (``"host"``, ``"device"``).
    """

    spec: SpecState = field(default_factory=SpecState)
    indexed: dict = field(default_factory=dict)


@dataclass
class NextSets:
    """Critical sets chosen during a step for the next one (lookahead rows), filled layer by layer.

    ``rids``: the rows' request ids in selection order; ``pos`` / ``slots``: ``[layers,
    len(rids), num_kv_heads, k]`` int64 positions and host slots, allocated at the first
    :meth:`put_layers` (``k``: the largest ``top_k`` among the rows; columns past a row's own are
    padding); ``filled``: the layers stored so far.
    """

    rids: tuple[str, ...] = ()
    k: int = 1
    layers: int = 0
    pos: torch.Tensor | None = None
    slots: torch.Tensor | None = None
    filled: set[int] = field(default_factory=set)

    def put(self, layer: int, dest: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor) -> None:
        """Store the sets of rows ``dest`` (``[n]`` int64 indices into :attr:`rids`) for ``layer``
        (``pos`` / ``slots``: ``[n, Hkv, w]``, ``w <= k``)."""
        self.put_layers(layer, dest, pos[None], slots[None])

    def put_layers(self, l0: int, dest: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor) -> None:
        """Store the sets of rows ``dest`` for layers ``[l0, l0 + L)`` (``pos`` / ``slots``: ``[L, n, Hkv,
        w]``, ``w <= k``) in one indexed write each.

        Raises:
            ValueError: the layers fall outside ``[0, layers)``.
        """
        l1 = l0 + pos.shape[0]
        self._check(l0, l1)
        self._alloc(pos.shape[2])
        w = pos.shape[3]
        self.pos[l0:l1, dest, :, :w] = pos
        self.slots[l0:l1, dest, :, :w] = slots
        self.filled.update(range(l0, l1))

    def direct(self, l0: int, l1: int, dest: torch.Tensor, w: int, hkv: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Views ``pos[l0:l1]`` / ``slots[l0:l1]`` (contiguous ``[l1 - l0, len(rids), hkv, k]``) for a
        selection of every row in order at the full width (``dest`` is ``0..len(rids)-1``, ``w == k``)
        to write straight into, counted as filled; None otherwise (then :meth:`put_layers`).

        Raises:
            ValueError: the layers fall outside ``[0, layers)``.
        """
        self._check(l0, l1)
        n = len(self.rids)
        if w != self.k or dest.numel() != n or not torch.equal(dest, torch.arange(n)):
            return None
        self._alloc(hkv)
        self.filled.update(range(l0, l1))
        return self.pos[l0:l1], self.slots[l0:l1]

    def _check(self, l0: int, l1: int) -> None:
        if l0 < 0 or l1 > self.layers:
            raise ValueError(f"layers [{l0}, {l1}) outside [0, {self.layers})")

    def _alloc(self, hkv: int) -> None:
        if self.pos is None:
            shape = (self.layers, len(self.rids), hkv, self.k)
            self.pos = torch.zeros(shape, dtype=torch.int64)
            self.slots = torch.zeros(shape, dtype=torch.int64)


class PredictionStore:
    """Per-request prediction state, and the sets chosen for the next step.

    :meth:`release` is registered with the KV-cache runtime as a release callback: a request's
    state leaves with it.
    """

    def __init__(self):
        self.requests: dict[str, RequestPrediction] = {}
        self.next_sets = NextSets()

    def get(self, rid: str) -> RequestPrediction:
        """The request's state, created on first use."""
        st = self.requests.get(rid)
        if st is None:
            st = self.requests[rid] = RequestPrediction()
        return st

    def release(self, rid: str) -> None:
        """Forget a request (it finished, was aborted or retracted)."""
        self.requests.pop(rid, None)
