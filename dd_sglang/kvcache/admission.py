"""What a request may choose and what SGLang's admission reserves for it.

* :class:`RequestLimits`: the selectors this server lets a request name in ``custom_params``
  (the preset's ``sparse`` keys).
* :class:`Admission`: enters a request into the :class:`~dd_sglang.kvcache.sparse_request.RequestTable`
  with its DualPath and choices (:meth:`Admission.track`), and answers SGLang's admission
  hooks (``patches/managers_schedule_policy.py``): the device slots a request being admitted
  (:meth:`Admission.admission_new_tokens`) or a running sparse one
  (:meth:`Admission.decode_growth_bound`) still needs, bounded by ``resident_bound`` as long
  as the host tier can take every sparse request's generation.
"""

from __future__ import annotations

from dataclasses import dataclass

from dd_sglang.kvcache.accounting import RuntimeHooks
from dd_sglang.kvcache.dualpath import DualPath, PathState
from dd_sglang.kvcache.host_entries import HostPrefixEntries
from dd_sglang.kvcache.params import SparseParams, request_overrides
from dd_sglang.kvcache.sparse_request import DENSE_ONLY, RequestChoices, RequestTable, SparseRequest

S = PathState


@dataclass
class RequestLimits:
    """What requests may ask for through ``custom_params``.

    Attributes:
        selectors: selector names a request may choose with ``custom_params.dd_selector``.
    """

    selectors: tuple[str, ...] = ("oracle",)


class Admission:
    """Request admission of one scheduler process.

    Args:
        params: :class:`SparseParams`.
        limits: :class:`RequestLimits`.
        table: the live requests.
        prefixes: the host prefix entries (the host tier they may be evicted from counts as room).
        hooks: metric callbacks (each new :class:`DualPath` reports its transitions to ``on_transition``).
    """

    def __init__(self, params: SparseParams, limits: RequestLimits, table: RequestTable,
                 prefixes: HostPrefixEntries, hooks: RuntimeHooks) -> None:  # fmt: skip
        self.params = params
        self.limits = limits
        self.table = table
        self.prefixes = prefixes
        self.hooks = hooks

    def overrides(self, req) -> dict:
        """``req``'s ``custom_params`` overrides, checked against this server's limits
        (:func:`~dd_sglang.kvcache.params.request_overrides`; raises its ``ValueError``)."""
        custom = getattr(getattr(req, "sampling_params", None), "custom_params", None)
        lim = self.limits
        return request_overrides(custom, lim.selectors, self.params.request_top_k_max)

    def track(self, req) -> SparseRequest:
        """``req``'s :class:`SparseRequest`, entered into the table on first sight."""
        table = self.table
        st = table.requests.get(req.rid)
        if st is None:
            n = len(req.origin_input_ids) + max(len(req.output_ids) - 1, 0)
            over = self.overrides(req)
            # dd_sparse false: no context is long enough to leave the dense path.
            min_len = self.params.min_sparse_len if over.get("sparse", True) else DENSE_ONLY
            policy = over.get("policy", self.params.policy)
            on_transition = self.hooks.on_transition
            path = DualPath(req.rid, n, min_len, on_transition, policy)
            if req.rid in table.rebuilt:
                table.rebuilt.discard(req.rid)
                path = DualPath.starting_in(S.REBUILD, req.rid, min_len, on_transition, policy)
                if self.hooks.on_path_change is not None:  # the new turn brings its full KV back
                    self.hooks.on_path_change("request")
            st = SparseRequest(
                req.rid,
                path,
                choice=RequestChoices(
                    top_k=over.get("top_k", self.params.top_k),
                    selector=over.get("selector", self.params.selector),
                    trace=over.get("trace", False),
                ),
                req=req,
            )
            table.requests[req.rid] = st
        return st

    def decode_growth_bound(self, rid: str) -> int | None:
        """Most device slots request ``rid`` can still add (tokens), or None when SGLang's own estimate must stand.

        A ``DECODE_SPARSE`` request never holds more than ``params.resident_bound`` device slots
        (its window slides as pages flush to the host tier), so its future growth is that bound
        minus what it holds now, however many tokens it may still generate. SGLang's admission
        (``PrefillAdder._get_running_request_total_token_offset``,
        ``sglang/srt/managers/schedule_policy.py``) reserves ``min(max_new_tokens - generated,
        4096)`` slots for every running request instead, which keeps long sparse requests from
        being admitted next to each other (a 2,048-token ``max_tokens`` reserves 2,048 slots).
        None when ``rid`` is not sparse, or when the host tier (free slots plus finished entries
        it may evict) cannot take the rest of every sparse request's generation: a window that
        cannot flush stops sliding and grows by a slot a step.
        """
        st = self.table.requests.get(rid)
        if st is None or st.path.state is not S.DECODE_SPARSE:
            return None
        if not self.host_takes(0):
            return None
        return max(0, self.params.resident_bound - st.device_tokens(self.table.kv_end(st)))

    def admission_new_tokens(self, req, max_new: int) -> int | None:
        """Device slots to reserve for a request being admitted, instead of SGLang's ``max_new``.

        ``req``: SGLang's ``Req``; ``max_new``: the tokens SGLang reserves for its generation
        (``min(max_new_tokens - generated, 4096)``, ``PrefillAdder.add_one_req``). A request whose
        context reaches ``min_sparse_len`` goes sparse right after its prefill (before its second
        token), and then never holds more than ``resident_bound`` slots: that bound is reserved.
        None (SGLang's figure stands) for a request that stays dense (shorter, or
        ``custom_params.dd_sparse`` false, or under the ``pressure`` policy, which keeps it dense
        after its prefill unless :mod:`~dd_sglang.kvcache.pressure` admits it as a sparse one, or
        invalid overrides, which SGLang rejects anyway) and when the host tier cannot take its
        whole context and generation beside the rest of every sparse request's.
        """
        n = len(req.origin_input_ids) + len(req.output_ids)
        try:
            over = self.overrides(req)
        except ValueError:
            return None
        if n < self.params.min_sparse_len or not over.get("sparse", True):
            return None
        if over.get("policy", self.params.policy) != "always" and req.rid not in self.table.pressure_marked:
            return None
        if not self.host_takes(n + max_new):
            return None
        return min(max_new, self.params.resident_bound)

    def host_takes(self, extra: int) -> bool:
        """Whether the host tier (free slots plus finished entries it may evict) can take ``extra``
        tokens more than the rest of every sparse request's generation (whole pages each). False
        when a sparse request's ``max_new_tokens`` is unknown."""
        page = self.params.page_size
        room = self.host_room()
        return room is not None and -(-extra // page) * page <= room

    def host_room(self) -> int | None:
        """Host-tier slots (free plus finished entries it may evict) left after the rest of every
        sparse request's generation (whole pages each); None when a sparse request's
        ``max_new_tokens`` is unknown."""
        page = self.params.page_size
        need = 0
        for other in self.table.sparse_requests():
            left = tokens_left(other.req)
            if left is None:
                return None
            need += -(-left // page) * page
        return self.prefixes.host.available_size() + self.prefixes.tokens() - need


def tokens_left(req) -> int | None:
    """Tokens SGLang's ``Req`` ``req`` may still generate (``max_new_tokens`` minus its outputs), None if unknown."""
    params = getattr(req, "sampling_params", None)
    max_new = getattr(params, "max_new_tokens", None)
    if max_new is None:
        return None
    return max(0, int(max_new) - len(req.output_ids))
