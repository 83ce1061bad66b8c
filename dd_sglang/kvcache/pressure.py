"""The ``pressure`` path policy: long requests stay dense until their device KV is needed.

Under ``sparse.policy: pressure`` (or ``custom_params.dd_policy: pressure``) a request whose context
reaches ``min_sparse_len`` stays ``DENSE`` (exact). It leaves the dense path only when SGLang is
about to turn work away for lack of device KV slots; then this module offloads running dense
requests to the host tier (``DENSE -> PREFILL_FULL -> OFFLOADING -> DECODE_SPARSE``, the moves of
:class:`~dd_sglang.kvcache.offload.Offloader`) until the work fits. Nothing polls: SGLang's own
admission and retraction call in, through two hooks (``patches/``):

1. **Admission** (``PrefillAdder._check_prefill_budget``): a waiting request did not fit the
   prefill budget (its input plus ``min(max_new_tokens, 4096)`` plus what every running request may
   still generate). The hook hands :meth:`PressureRelief.plan_admission` the shortfall (tokens);
   it returns the :class:`Candidate` s to make sparse, or None when even all of them together
   would not make the request fit (then nothing moves and SGLang refuses as it would have). The
   candidates are the running ``DENSE`` pressure requests at or past ``min_sparse_len``, each
   worth the slots its offload frees now plus the cut in what SGLang reserves for its generation
   (a sparse request never holds more than ``resident_bound``), and the waiting request itself
   (worth that cut only: admitted as one that goes sparse right after its prefill,
   :meth:`RequestTable.pressure_marked <dd_sglang.kvcache.sparse_request.RequestTable>`).
2. **Retraction** (``ScheduleBatch.check_decode_mem``): the next decode step does not fit the pool
   and SGLang would retract running requests. :meth:`PressureRelief.relieve_retraction` offloads
   candidates one at a time until SGLang's own check passes, so nothing is retracted when offloads
   can make the room.

**Victims** (:func:`choose_victims`), largest gain first (ties: the longer context, then the most
decode left), each fitting the host tier beside the rest of every sparse request's generation.
At admission, once the shortfall can be covered, *every* candidate goes, the waiting request
included: pressure means the batch needs the sparse path's capacity, and a dense long row left
among sparse ones sets the step's cost (measured on the 2-core AMD EPYC host with the fewest
rule: one 4k request left dense among 7 sparse halved the batch's output tokens/s,
``bench/results/admission_policies_fewest_amd_epyc_cpu.json``). Requests admitted while the pool has room
stay dense. At retraction, candidates go one at a time until the step fits.

**Back to exact**: a request made sparse stays sparse until it finishes (a new turn rebuilds its
full KV, ``REBUILD``, as for any sparse request).

Every pressure offload is counted by trigger (``on_pressure_offload("admission" | "retraction")``)
and every path change by reason (``on_path_change("pressure")``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from dd_sglang.kvcache.accounting import RuntimeHooks, SlotTally
from dd_sglang.kvcache.admission import Admission, tokens_left
from dd_sglang.kvcache.dualpath import PathState
from dd_sglang.kvcache.offload import Offloader
from dd_sglang.kvcache.params import SparseParams
from dd_sglang.kvcache.sparse_request import RequestTable

logger = logging.getLogger(__name__)
S = PathState

#: What made SGLang need the room (label values of ``dd_pressure_offloads_total{trigger}``).
TRIGGERS = ("admission", "retraction")


@dataclass(frozen=True)
class Candidate:
    """A request the pressure policy may make sparse, and what that is worth.

    Attributes:
        rid: SGLang request id.
        context_tokens: positions with KV now (tokens).
        tokens_left: tokens it may still generate.
        gain: device slots the waiting work gains from it (tokens): slots freed now plus the cut
            in SGLang's reservation for its generation.
        host_tokens: host-tier slots it needs (its context and generation, whole pages).
        waiting: True for the request being admitted (it goes sparse after its prefill).
        req: SGLang's ``Req`` (None in tests of the choice alone).
    """

    rid: str
    context_tokens: int
    tokens_left: int
    gain: int
    host_tokens: int
    waiting: bool = False
    req: object = None


def choose_victims(candidates: Iterable[Candidate], need: int, host_room: int | None,
                   every: bool = False) -> list[Candidate] | None:  # fmt: skip
    """The requests to make sparse so ``need`` device slots are gained: the fewest, largest gain
    first; with ``every``, once ``need`` is covered, every other candidate the host tier takes too.

    Args:
        candidates: what may be made sparse (:class:`Candidate`).
        need: device slots (tokens) the waiting work lacks; ``<= 0`` needs no one.
        host_room: host-tier slots free for new sparse requests (None: unknown, nobody fits).
        every: take all that fit once ``need`` is covered (the admission rule, module docstring).

    Returns:
        The chosen candidates in offload order (gain descending; ties: longer context, then more
        tokens left, then rid), skipping any the host tier cannot take beside those chosen before;
        ``[]`` when ``need <= 0``; None when all that fit together gain less than ``need``.
    """
    if need <= 0:
        return []
    if host_room is None:
        return None
    order = sorted(candidates, key=lambda c: (-c.gain, -c.context_tokens, -c.tokens_left, c.rid))
    chosen: list[Candidate] = []
    gained = 0
    for c in order:
        if c.gain <= 0 or c.host_tokens > host_room:
            continue
        chosen.append(c)
        host_room -= c.host_tokens
        gained += c.gain
        if gained >= need and not every:
            return chosen
    return chosen if gained >= need else None


class PressureRelief:
    """Offloads running dense requests when SGLang lacks device slots (module docstring).

    Args:
        params: :class:`SparseParams` (``resident_bound``, ``n_sink``, ``n_keep``, ``n_recent``, ``page_size``).
        table: the live requests.
        admission: answers host-tier room (:meth:`Admission.host_room`).
        offloader: the device <-> host moves.
        tally: counters (``pressure_offloads``).
        hooks: metric callbacks (``on_pressure_offload``).
    """

    def __init__(self, params: SparseParams, table: RequestTable, admission: Admission, offloader: Offloader,
                 tally: SlotTally, hooks: RuntimeHooks) -> None:  # fmt: skip
        self.params = params
        self.table = table
        self.admission = admission
        self.offloader = offloader
        self.tally = tally
        self.hooks = hooks

    # ------------------------------------------------------------------ the guard
    def active(self, req=None) -> bool:
        """Whether the ``pressure`` policy may act at all: the preset's ``sparse.policy`` is ``pressure``,
        a tracked request chose it (``custom_params.dd_policy``), or ``req`` (being admitted) asks for it.
        False under ``always`` with no request asking: the hooks (``patches/``) then return SGLang's
        own answer and touch nothing."""
        if self.params.policy == "pressure":
            return True
        if any(st.path.policy == "pressure" for st in self.table.requests.values()):
            return True
        if req is None:
            return False
        try:
            return self.admission.overrides(req).get("policy") == "pressure"
        except ValueError:
            return False

    # ------------------------------------------------------------------ candidates
    def resident_estimate(self, context_tokens: int) -> int:
        """Device slots a request of ``context_tokens`` keeps once offloaded: sinks, kept tokens, window."""
        p = self.params
        return min(context_tokens, p.n_sink + p.n_keep + p.n_recent)

    def _pages(self, tokens: int) -> int:
        page = self.params.page_size
        return -(-tokens // page) * page

    def candidate(self, req, reserve: float = 0.0) -> Candidate | None:
        """``req`` (SGLang's running ``Req``) as a :class:`Candidate`, or None when it may not be offloaded.

        ``reserve``: device slots SGLang reserves for its generation now (tokens; 0 where the
        reservation does not count, as in retraction). It may be offloaded when it is tracked,
        ``DENSE`` under the ``pressure`` policy, at or past its ``min_sparse_len``, holds its KV, is
        not finished, and no earlier offload of it failed at today's free slots (``st.retry``).
        """
        st = self.table.requests.get(req.rid)
        if st is None or st.path.state is not S.DENSE or st.path.policy != "pressure":
            return None
        if req.finished() or not req.kv.holds_kv:
            return None
        kv_len = int(req.kv.kv_committed_len)
        if not st.path.may_go_sparse(kv_len):
            return None
        device = self.offloader.device
        if self.offloader.host.available_size() <= st.retry.host_free:
            return None
        if device.allocator.available_size() <= st.retry.device_free:
            return None
        left = tokens_left(req)
        if left is None:
            return None
        resident = self.resident_estimate(kv_len)
        cut = max(0.0, reserve - max(0, self.params.resident_bound - resident))
        gain = kv_len - resident + int(cut)
        return Candidate(req.rid, kv_len, left, gain, self._pages(kv_len + left), req=req)

    def candidates(self, reqs: Iterable, reserve_of: Callable[[object], float] | None = None) -> list[Candidate]:
        """The :class:`Candidate` s among ``reqs``; ``reserve_of(req)`` gives each one's reservation."""
        out = []
        for req in reqs:
            c = self.candidate(req, 0.0 if reserve_of is None else reserve_of(req))
            if c is not None:
                out.append(c)
        return out

    def has_candidates(self, reqs: Iterable) -> bool:
        """Whether any of ``reqs`` (SGLang's running ``Req`` s) could be offloaded now."""
        if not self.active():
            return False
        return any(self.candidate(req) is not None for req in reqs)

    def waiting_candidate(self, req, max_new: int) -> Candidate | None:
        """The request being admitted as a :class:`Candidate` (it would go sparse after its prefill),
        or None when it may not: not under ``pressure``, shorter than ``min_sparse_len``,
        ``dd_sparse`` false, or invalid overrides. ``max_new``: tokens SGLang reserves for its generation."""
        try:
            over = self.admission.overrides(req)
        except ValueError:
            return None
        if over.get("policy", self.params.policy) != "pressure" or not over.get("sparse", True):
            return None
        n = len(req.origin_input_ids) + len(req.output_ids)
        if n < self.params.min_sparse_len:
            return None
        gain = max_new - min(max_new, self.params.resident_bound)
        return Candidate(req.rid, n, max_new, gain, self._pages(n + max_new), waiting=True, req=req)

    # ------------------------------------------------------------------ admission
    def plan_admission(self, running: Iterable, reserve_of: Callable[[object], float], req, max_new: int,
                       need: int) -> list[Candidate] | None:  # fmt: skip
        """Whom to make sparse so request ``req`` (being admitted, ``max_new`` tokens reserved for its
        generation) fits a prefill budget ``need`` device slots short (:func:`choose_victims` with
        ``every`` over the running candidates and ``req`` itself); None when nothing can make it fit."""
        cands = self.candidates(running, reserve_of)
        own = self.waiting_candidate(req, max_new)
        if own is not None:
            cands.append(own)
        if not cands:
            return None
        return choose_victims(cands, need, self.admission.host_room(), every=True)

    def relieve_admission(self, adder, req, max_new: int, total_tokens: float, refused: tuple,
                          check: Callable[[float], tuple]) -> tuple:  # fmt: skip
        """SGLang's prefill budget refused waiting request ``req``: offload what :meth:`plan_admission`
        chooses among the adder's running requests, cut the adder's reservation for each
        (``adder.memory_budget.total_offset``, as SGLang's ``PrefillAdder.preempt_to_schedule``
        adjusts it), and ask ``check(total_tokens)`` (SGLang's own budget check) once more.

        Args:
            adder: SGLang's ``PrefillAdder`` (``running_batch``, ``preempt_list``,
                ``rem_total_tokens``, ``memory_budget``, ``tree_cache``,
                ``_get_running_request_total_token_offset``).
            req: the waiting request; ``max_new``: tokens SGLang reserves for its generation.
            total_tokens: the budget's figure for ``req`` (tokens) that ``check`` refused.
            refused: that refusal (SGLang's verdict), returned when no plan makes ``req`` fit.
            check: SGLang's ``_check_prefill_budget`` for ``req`` at a given ``total_tokens``.

        Returns:
            ``check``'s new verdict, or ``refused`` when nothing was moved.
        """
        batch = adder.running_batch
        running = [] if batch is None else [r for r in batch.reqs if r not in adder.preempt_list]
        need = int(total_tokens - adder.rem_total_tokens) + 1  # the budget admits total_tokens < remaining
        reserve_of = adder._get_running_request_total_token_offset
        plan = self.plan_admission(running, reserve_of, req, max_new, need)
        if not plan:
            return refused
        for victim in (v for v in plan if not v.waiting):
            before = reserve_of(victim.req)
            if self.offload(victim.req, adder.tree_cache, "admission"):
                adder.memory_budget.total_offset -= before - reserve_of(victim.req)
        waiting = any(v.waiting for v in plan)
        if waiting:
            total_tokens -= max_new - min(max_new, self.params.resident_bound)
        verdict = check(total_tokens)
        if verdict[0] and waiting:
            self.mark_waiting(req.rid)
        return verdict

    def mark_waiting(self, rid: str) -> None:
        """Request ``rid`` was admitted as one that goes sparse right after its prefill."""
        self.table.pressure_marked.add(rid)

    # ------------------------------------------------------------------ the move
    def offload(self, req, tree_cache, trigger: str) -> bool:
        """Offload running request ``req`` for pressure (``trigger``: one of :data:`TRIGGERS`).

        Returns True when it is now ``DECODE_SPARSE``; False when the offload failed and it stays
        ``DENSE`` (its ``retry`` marks keep it from being tried again at today's free slots).

        Raises:
            ValueError: ``trigger`` is not one of :data:`TRIGGERS`.
            KeyError: ``req`` is not tracked.
        """
        if trigger not in TRIGGERS:
            raise ValueError(f"trigger must be one of {list(TRIGGERS)}, got {trigger!r}")
        st = self.table.requests[req.rid]
        if st.path.state is S.DENSE:
            st.path.to(S.PREFILL_FULL)
        ok = self.offloader.offload(req, st, tree_cache, reason="pressure")
        if ok:
            self.tally.pressure_offloads += 1
            if self.hooks.on_pressure_offload is not None:
                self.hooks.on_pressure_offload(trigger)
            logger.debug("dualdecoder: %s offloaded for %s (%d tokens)", req.rid, trigger, st.host_len)
        return ok

    # ------------------------------------------------------------------ retraction
    def relieve_retraction(self, reqs: Iterable, fits: Callable[[], bool], tree_cache) -> bool:
        """Offload candidates among ``reqs`` (the decode batch's ``Req`` s), the most slots first,
        until ``fits()`` (SGLang's own decode-memory check) is True; returns its last answer
        (False, with nothing moved, when there is no candidate)."""
        cands = self.candidates(reqs)
        room = self.admission.host_room()
        if not cands or room is None:
            return False
        for c in sorted(cands, key=lambda c: (-c.gain, -c.tokens_left, c.rid)):
            if c.host_tokens > room:
                continue
            if self.offload(c.req, tree_cache, "retraction"):
                room -= c.host_tokens
                if fits():
                    return True
        return fits()
