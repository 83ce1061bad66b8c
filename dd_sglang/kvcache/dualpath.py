"""The per-request DualPath state machine: which KV path a request is on.

State diagram (DESIGN.md, "DualPath"; the arrows are the only legal transitions)::

        start(context_len)
          | < min_sparse_len            | >= min_sparse_len
          v                             v
        DENSE ----(context grew)---> PREFILL_FULL <------------- REBUILD
          ^  ^                          |      (full KV back)       ^
          |  +--(host tier full)--------+                           | new turn /
          |                             v                           | extend
          +---(offload failed)---- OFFLOADING ---> DECODE_SPARSE ---+

        every state but FINISHED ---> FINISHED   (done, aborted or rejected)

* ``DENSE``: short context; SGLang's dense path, full KV on device.
* ``PREFILL_FULL``: long context being prefilled (or re-extended) densely; the
  full KV is on device.
* ``OFFLOADING``: prefill done; the KV is being copied to the host tier.
* ``DECODE_SPARSE``: decoding from the resident set plus per-step critical sets.
* ``REBUILD``: a new turn arrived on a host-only request; the KV the extend's
  full attention needs is loaded back, in chunks.
* ``FINISHED``: terminal; every resource has been released.

When a long request leaves ``DENSE`` / ``PREFILL_FULL`` for ``OFFLOADING`` depends on its policy
(:data:`PATH_POLICIES`, the preset's ``sparse.policy`` or the request's ``custom_params.dd_policy``):

* ``always``: as soon as its context reaches ``min_sparse_len`` (:meth:`DualPath.wants_sparse`);
  the path change's reason is ``length``.
* ``pressure``: it stays ``DENSE`` past ``min_sparse_len`` (``PREFILL_FULL -> DENSE`` after its
  prefill) and is only *eligible* (:meth:`DualPath.may_go_sparse`); the runtime moves it
  ``DENSE -> PREFILL_FULL -> OFFLOADING -> DECODE_SPARSE`` when SGLang needs its device KV for other
  work (:mod:`dd_sglang.kvcache.pressure`); the reason is ``pressure``. A sparse request stays
  sparse when the pressure leaves (its full KV is rebuilt only by a new turn, ``REBUILD``, whose
  reason is ``request``).

A transition not in :data:`TRANSITIONS` raises :class:`IllegalTransition` and
changes nothing. Every legal transition is logged at debug level and reported
to the ``on_transition(src, dst)`` callback (the plugin counts them in
``dd_dualpath_transitions_total{from,to}``).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from typing import get_args

from dd_sglang.config import PathPolicy

logger = logging.getLogger(__name__)


class PathState(enum.Enum):
    """DualPath states (DESIGN.md); ``value`` is the metric label."""

    DENSE = "DENSE"
    PREFILL_FULL = "PREFILL_FULL"
    OFFLOADING = "OFFLOADING"
    DECODE_SPARSE = "DECODE_SPARSE"
    REBUILD = "REBUILD"
    FINISHED = "FINISHED"


S = PathState
#: Legal transitions: source -> allowed destinations.
TRANSITIONS: dict[PathState, frozenset[PathState]] = {
    S.DENSE: frozenset({S.PREFILL_FULL, S.FINISHED}),
    S.PREFILL_FULL: frozenset({S.OFFLOADING, S.DENSE, S.FINISHED}),
    S.OFFLOADING: frozenset({S.DECODE_SPARSE, S.DENSE, S.FINISHED}),
    S.DECODE_SPARSE: frozenset({S.REBUILD, S.FINISHED}),
    S.REBUILD: frozenset({S.PREFILL_FULL, S.FINISHED}),
    S.FINISHED: frozenset(),
}


#: Path policies: when a request at or past ``min_sparse_len`` leaves the dense path (module docstring);
#: the values of the schema's ``sparse.policy`` (:data:`dd_sglang.config.PathPolicy`, declared there once).
PATH_POLICIES = get_args(PathPolicy)
#: Why a request changed path (module docstring): its length (``always``), the device's need for
#: its KV (``pressure``), or the request itself (a new turn rebuilds its full KV).
PATH_CHANGE_REASONS = ("length", "pressure", "request")


class IllegalTransition(ValueError):
    """A transition outside :data:`TRANSITIONS` was requested."""


TransitionCallback = Callable[[PathState, PathState], None]


class DualPath:
    """The DualPath state of one request.

    Args:
        rid: request id, for logs only (never a metric label).
        context_len: tokens in the request's context at admission (>= 0).
        min_sparse_len: contexts shorter than this stay ``DENSE`` (tokens, >= 1).
        on_transition: called as ``on_transition(src, dst)`` after each legal transition.
        policy: one of :data:`PATH_POLICIES` (module docstring); default ``always``.

    Raises:
        ValueError: ``context_len`` < 0, ``min_sparse_len`` < 1, or ``policy`` not in
            :data:`PATH_POLICIES` (the message names the field and the allowed values).
    """

    __slots__ = ("rid", "min_sparse_len", "policy", "state", "history", "_on_transition")

    def __init__(
        self, rid: str, context_len: int, min_sparse_len: int, on_transition: TransitionCallback | None = None,
        policy: str = "always",
    ):  # fmt: skip
        if context_len < 0:
            raise ValueError(f"context_len must be >= 0, got {context_len}")
        if min_sparse_len < 1:
            raise ValueError(f"min_sparse_len must be >= 1, got {min_sparse_len}")
        if policy not in PATH_POLICIES:
            raise ValueError(f"policy must be one of {list(PATH_POLICIES)}, got {policy!r}")
        self.rid = rid
        self.min_sparse_len = min_sparse_len
        self.policy = policy
        self.state = S.DENSE if context_len < min_sparse_len else S.PREFILL_FULL
        self.history: list[PathState] = [self.state]
        self._on_transition = on_transition

    @classmethod
    def starting_in(
        cls, state: PathState, rid: str, min_sparse_len: int, on_transition: TransitionCallback | None = None,
        policy: str = "always",
    ) -> DualPath:  # fmt: skip
        """A path that starts in ``state`` (``REBUILD`` for a new turn whose prefix is host-only).

        Raises:
            ValueError: ``state`` is ``FINISHED``, ``min_sparse_len`` < 1 or ``policy`` unknown.
        """
        if state is S.FINISHED:
            raise ValueError("a DualPath cannot start FINISHED")
        path = cls(rid, 0, min_sparse_len, on_transition, policy)
        path.state = state
        path.history = [state]
        return path

    def wants_sparse(self, context_len: int) -> bool:
        """True when a context of ``context_len`` tokens goes sparse by its length alone (policy ``always``)."""
        return self.policy == "always" and context_len >= self.min_sparse_len

    def may_go_sparse(self, context_len: int) -> bool:
        """True when a context of ``context_len`` tokens may leave the dense path (``>= min_sparse_len``):
        by length under ``always``, when the device needs its KV under ``pressure``."""
        return context_len >= self.min_sparse_len

    def can(self, dst: PathState) -> bool:
        """True when ``state -> dst`` is legal."""
        return dst in TRANSITIONS[self.state]

    def to(self, dst: PathState) -> None:
        """Move to ``dst``.

        Raises:
            IllegalTransition: ``state -> dst`` is not in :data:`TRANSITIONS`; the state is unchanged.
        """
        src = self.state
        if dst not in TRANSITIONS[src]:
            allowed = sorted(s.value for s in TRANSITIONS[src]) or ["none: terminal"]
            raise IllegalTransition(
                f"request {self.rid}: {src.value} -> {dst.value} is not allowed (allowed: {allowed})"
            )
        self.state = dst
        self.history.append(dst)
        logger.debug("dualpath %s: %s -> %s", self.rid, src.value, dst.value)
        if self._on_transition is not None:
            self._on_transition(src, dst)

    @property
    def finished(self) -> bool:
        return self.state is S.FINISHED
