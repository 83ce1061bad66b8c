"""The sparse path's KV bookkeeping inside SGLang's scheduler process.

One :class:`SparseRuntime` per scheduler process owns the host tier
(:class:`~dd_sglang.kvcache.host_pool.HostSparseKVPool`), the DualPath state of
every admitted request, and the device-slot bookkeeping of sparse requests.
The scheduler hooks (``patches/managers_scheduler.py``) call
:meth:`SparseRuntime.after_extend` and :meth:`SparseRuntime.after_decode`
after each batch; the radix cache (:mod:`dd_sglang.kvcache.radix`) calls
:meth:`free_request_slots`, :meth:`on_release` and :meth:`rebuild_prefix`; the
``dualdecoder`` attention backend reads :meth:`sparse_request` per decode row.

Life of a long request (``len(prompt) >= min_sparse_len``):

1. ``PREFILL_FULL``: SGLang prefills it densely; after the last prefill
   chunk SGLang's checkpoint has put the prompt's KV into the radix tree.
2. ``OFFLOADING`` (:meth:`Offloader.offload <dd_sglang.kvcache.offload.Offloader.offload>`): every layer's K/V of positions
   ``[0, L)`` is copied to the host tier. The resident set is
   ``n_sink`` first positions, ``n_keep`` positions with the largest key norm,
   and the last ``n_recent`` positions (the window). Resident positions whose
   slots the radix tree owns are copied to fresh device slots (the tree may
   evict its copy); when the pool is too full for those, the request first
   drops its tree lock so the tree can evict its own prompt, and the fresh
   slots are filled from the host tier; request-owned slots outside the resident set go back to
   SGLang's allocator; the request drops its tree lock, so the tree's copy of
   the prompt becomes evictable cache; released positions in the request's
   ``req_to_token`` row point at SGLang's padding slot 0. The radix tree never
   points at a slot this module freed: it only frees request-owned slots.
3. ``DECODE_SPARSE``: new decode tokens get device slots from SGLang as
   usual; once ``page_size`` of them are past the host-tier end they are
   copied to the host tier and the window slides, freeing the device slots
   that fell out of it. A sparse request never holds more than
   ``n_sink + n_keep + n_recent + page_size`` device slots.
4. ``FINISHED`` (:meth:`on_release`): the request's remaining device slots
   are freed by the radix cache's ``free_kv_row`` (through
   :meth:`free_request_slots`); its host pages, keyed by its token ids, stay
   in the host prefix index so a later request with the same prefix reloads
   them (:meth:`rebuild_prefix`, state ``REBUILD``) instead of recomputing.

The work is split by concept: :mod:`~dd_sglang.kvcache.sparse_request` (per-request
bookkeeping, the request table), :mod:`~dd_sglang.kvcache.admission` (tracking, overrides,
what SGLang's admission reserves), :mod:`~dd_sglang.kvcache.offload` (the device <-> host
moves), :mod:`~dd_sglang.kvcache.host_entries` (the host prefix cache),
:mod:`~dd_sglang.kvcache.pressure` (the ``pressure`` policy's offloads, called from SGLang's
admission and retraction) and :mod:`~dd_sglang.kvcache.accounting` (callbacks, counters,
published bytes). This class wires them once and runs the per-batch lifecycle.

Under the ``pressure`` policy (``sparse.policy`` or ``custom_params.dd_policy``) step 2 does not
follow step 1 by itself: the request stays ``DENSE`` after its prefill, and is offloaded only
when SGLang's admission or retraction needs its device slots (:mod:`~dd_sglang.kvcache.pressure`),
or right after its prefill when it was admitted as one that goes sparse.

If the host tier cannot take a request (after evicting finished entries),
or the device cannot give the few slots the resident set needs, the request
stays ``DENSE`` with its KV untouched: nothing is lost and nothing crashes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from dd_sglang.kvcache.accounting import DecodeBuffers, RuntimeHooks, SlotTally
from dd_sglang.kvcache.admission import Admission, RequestLimits
from dd_sglang.kvcache.dualpath import PathState
from dd_sglang.kvcache.host_entries import REBUILD_CHUNK_TOKENS, HostEntry, HostPrefixEntries
from dd_sglang.kvcache.host_pool import HostSparseKVPool
from dd_sglang.kvcache.offload import DeviceSlots, Offloader
from dd_sglang.kvcache.params import SparseParams, sglang_input_limits
from dd_sglang.kvcache.pressure import PressureRelief
from dd_sglang.kvcache.sparse_request import DENSE_ONLY, RequestTable, SparseRequest

__all__ = ["DENSE_ONLY", "REBUILD_CHUNK_TOKENS", "HostEntry", "SparseRequest", "SparseRuntime"]

logger = logging.getLogger(__name__)
S = PathState


class SparseRuntime:
    """Host tier + DualPath bookkeeping of one scheduler process.

    Args:
        params: :class:`SparseParams`.
        device_pool: SGLang's device KV pool (``MHATokenToKVPool``: ``k_buffer``/``v_buffer``
            lists of ``[slots, num_kv_heads, head_dim]``, ``layer_num``, ``head_num``,
            ``head_dim``, ``dtype``).
        allocator: SGLang's ``token_to_kv_pool_allocator`` (``alloc``/``free``/``available_size``).
        req_to_token: ``[max_reqs, max_context_len]`` int32, SGLang's ``ReqToTokenPool.req_to_token``.
        on_transition: ``(src, dst)`` callback for every DualPath transition (metrics).
        on_rebuild: called with the number of tokens each REBUILD loaded back (metrics).
        on_unpin: called once per offload that found the device pool too full for its resident
            set and dropped the request's tree lock on its own prompt (metrics).
        on_path_change: called with the reason of each path change (``length``, ``pressure``,
            ``request``; metrics).
        on_pressure_offload: called with the trigger (``admission``, ``retraction``) of each
            offload the ``pressure`` policy made (metrics).
        selectors: selector names a request may choose with ``custom_params.dd_selector``.

    Attributes:
        params, host: the parameters and the host tier.
        table: the live requests (:class:`RequestTable`).
        prefixes: finished requests' host pages (:class:`HostPrefixEntries`).
        admission: tracking and admission answers (:class:`Admission`).
        offloader: the device <-> host moves (:class:`Offloader`).
        pressure: the ``pressure`` policy's offloads (:class:`~dd_sglang.kvcache.pressure.PressureRelief`).
        hooks, tally, buffers: metric callbacks, counters, and the bytes the attention backend
            publishes each decode step (:mod:`dd_sglang.kvcache.accounting`).

    Raises:
        ValueError: the device pool's K and V head sizes differ (the host tier stores one
            head size), or ``host_tier_bytes`` is below two pages (message names the field).
    """

    def __init__(
        self,
        params: SparseParams,
        device_pool,
        allocator,
        req_to_token: torch.Tensor,
        on_transition: Callable[[PathState, PathState], None] | None = None,
        on_rebuild: Callable[[int], None] | None = None,
        on_unpin: Callable[[], None] | None = None,
        on_path_change: Callable[[str], None] | None = None,
        on_pressure_offload: Callable[[str], None] | None = None,
        selectors: tuple[str, ...] = ("oracle",),
    ):
        v_dim = getattr(device_pool, "v_head_dim", device_pool.head_dim)
        if v_dim != device_pool.head_dim:
            raise ValueError(
                f"dualdecoder host tier needs equal K/V head sizes, got {device_pool.head_dim}/{v_dim}"
            )
        self.params = params
        self.host = HostSparseKVPool(
            num_layers=len(device_pool.k_buffer),
            num_kv_heads=device_pool.head_num,
            head_dim=device_pool.head_dim,
            dtype=device_pool.k_buffer[0].dtype,
            capacity_bytes=params.host_tier_bytes,
            page_size=params.page_size,
            pin_memory=True,
        )
        self.hooks = RuntimeHooks(on_transition, on_rebuild, on_unpin, on_path_change, on_pressure_offload)
        self.tally = SlotTally()
        self.buffers = DecodeBuffers()
        self.table = RequestTable()
        self.prefixes = HostPrefixEntries(self.host, device_pool)
        limits = RequestLimits(selectors)
        self.admission = Admission(params, limits, self.table, self.prefixes, self.hooks)
        device = DeviceSlots(device_pool, allocator, req_to_token)
        self.offloader = Offloader(params, device, self.prefixes, self.table, self.tally, self.hooks)
        self.pressure = PressureRelief(params, self.table, self.admission, self.offloader, self.tally, self.hooks)
        #: Device pool size in tokens (SGLang's allocator): prompts from :meth:`pool_input_limit` on are
        #: prefilled through the host tier.
        self.pool_tokens = int(getattr(allocator, "size", 0) or 0)

    # ------------------------------------------------------------------ names kept from one class
    requests = property(lambda self: self.table.requests, doc="rid -> :class:`SparseRequest`.")
    by_pool = property(lambda self: self.table.by_pool, doc="``req_to_token`` row -> offloaded request.")
    entries = property(lambda self: self.prefixes.entries, doc="Host prefix entries by id, LRU first.")
    offloaded_tokens = property(lambda self: self.tally.offloaded_tokens, doc="Tokens offloaded, cumulative.")
    rebuilt_tokens = property(lambda self: self.tally.rebuilt_tokens, doc="Tokens rebuilt, cumulative.")
    reclaimed_slots = property(lambda self: self.tally.reclaimed_slots, doc="Device slots given back.")
    pressure_offloads = property(lambda self: self.tally.pressure_offloads, doc="Offloads made for pressure.")

    @property
    def on_transition(self):
        """``(src, dst)`` callback of the DualPaths made from now on."""
        return self.hooks.on_transition

    @on_transition.setter
    def on_transition(self, fn) -> None:
        self.hooks.on_transition = fn

    @property
    def on_unpin(self):
        """Called once per offload that unpinned its own prompt."""
        return self.hooks.on_unpin

    @on_unpin.setter
    def on_unpin(self, fn) -> None:
        self.hooks.on_unpin = fn

    # ------------------------------------------------------------------ lookups
    def sparse_request(self, pool_idx: int) -> SparseRequest | None:
        """The request decoding sparsely in ``req_to_token`` row ``pool_idx``, else None."""
        return self.table.sparse_request(pool_idx)

    def state_counts(self) -> dict[str, int]:
        """Live requests by DualPath state name."""
        return self.table.state_counts()

    def resident_tokens(self) -> int:
        """Device slots held by released (sparse) requests, summed."""
        return self.table.resident_tokens()

    def max_request_device_tokens(self) -> int:
        """Largest device-slot count of one released (sparse) request now."""
        return self.table.max_request_device_tokens()

    def host_entry_tokens(self) -> int:
        """Host-tier slots held by finished-request prefix entries."""
        return self.prefixes.tokens()

    def selector_aux_bytes(self) -> dict[str, int]:
        """Device bytes of selection state by selector (published by the attention backend)."""
        return dict(self.buffers.selector_aux)

    def add_release_listener(self, fn: Callable[[str], None]) -> None:
        """Call ``fn(rid)`` whenever a tracked request is released (finished, aborted, retracted)."""
        self.table.add_release_listener(fn)

    # ------------------------------------------------------------------ admission
    def decode_growth_bound(self, rid: str) -> int | None:
        """See :meth:`Admission.decode_growth_bound`."""
        return self.admission.decode_growth_bound(rid)

    def admission_new_tokens(self, req, max_new: int) -> int | None:
        """See :meth:`Admission.admission_new_tokens`."""
        return self.admission.admission_new_tokens(req, max_new)

    @property
    def pool_input_limit(self) -> int:
        """Prompt tokens from which SGLang would refuse a request in this pool: its own
        ``max_req_input_len`` for a pool of :attr:`pool_tokens` (:func:`sglang_input_limits`; the
        context bound left out)."""
        return sglang_input_limits(self.pool_tokens)[1]

    def over_pool(self, req) -> bool:
        """Whether ``req``'s prompt is longer than the device pool takes (:attr:`pool_input_limit`):
        it is prefilled chunk by chunk through the host tier (:meth:`Offloader.offload_chunk`) and
        then decodes sparsely, whatever its policy."""
        return self.pool_tokens > 0 and len(req.origin_input_ids) >= self.pool_input_limit

    def over_pool_chunk(self, req, extend_input_len: int, chunk_limit: int | None, remaining: float) -> int | None:
        """The next chunk (tokens) of an :meth:`over_pool` request that the pool's ``remaining`` tokens
        (SGLang's ``PrefillBudget.remaining_total``) can take beside the request's resident bound, at
        most ``chunk_limit`` (SGLang's chunk budget) and ``extend_input_len``; None (wait) when under
        one page, or when the host tier (free plus finished entries) cannot hold the prompt yet."""
        if req.kv.req_pool_idx is None:  # not started: the whole prompt must find host slots
            free = self.host.available_size() + self.prefixes.tokens()
            if free < len(req.origin_input_ids):
                return None
        page = self.params.page_size
        room = int(remaining) - self.params.resident_bound - page
        chunk = min(extend_input_len, chunk_limit if chunk_limit is not None else extend_input_len, room)
        if chunk < extend_input_len:
            chunk = chunk // page * page
        return chunk if chunk >= min(page, extend_input_len) else None

    def alloc_device(self, n: int, tree_cache) -> torch.Tensor | None:
        """``n`` device slots (int64, a copy), evicting radix-tree cache first if needed; None if full."""
        return self.offloader.device.alloc(n, tree_cache)

    # ------------------------------------------------------------------ per batch
    def after_extend(self, batch, tree_cache) -> int:
        """After a prefill/extend batch: track each request; offload those whose prefill is done.

        Returns the number of device slots the offloads made reclaimable (freed, or left to the
        radix tree as evictable cache).
        """
        before = self.tally.reclaimed_slots
        table = self.table
        for req in batch.reqs:
            if req.finished():
                # Finished in this prefill (max_tokens=1, an immediate stop, an abort): SGLang has
                # already released it; record its path so the transition metrics see it.
                if req.rid not in table.requests and req.rid not in table.just_released:
                    path = self.admission.track(req).path
                    table.requests.pop(req.rid, None)
                    table.rebuilt.discard(req.rid)
                    table.pressure_marked.discard(req.rid)
                    if path.state is S.REBUILD:
                        path.to(S.PREFILL_FULL)
                    path.to(S.FINISHED)
                continue
            if not req.kv.holds_kv:
                continue
            st = self.admission.track(req)
            if st.path.state is S.REBUILD:
                st.path.to(S.PREFILL_FULL)
            if len(req.output_ids) == 0:  # a middle prefill chunk
                if self.over_pool(req) and st.path.state in (S.PREFILL_FULL, S.DENSE):
                    if st.path.state is S.DENSE:  # dd_sparse false: the pool cannot keep it dense anyway
                        st.path.to(S.PREFILL_FULL)
                    if not self.offloader.offload_chunk(req, st, tree_cache):
                        logger.warning("dualdecoder: the host tier cannot take %s's prompt (%d tokens); its chunk "
                                       "stays on the device", req.rid, len(req.origin_input_ids))  # fmt: skip
                continue
            table.kv_len[req.rid] = int(req.kv.kv_committed_len)
            if st.path.state is S.PREFILL_FULL:
                kv_len = int(req.kv.kv_committed_len)
                marked = req.rid in table.pressure_marked
                table.pressure_marked.discard(req.rid)
                if st.path.wants_sparse(kv_len) or st.host_len:  # host_len: prefilled through the host tier
                    self.offloader.offload(req, st, tree_cache)
                elif marked and st.path.may_go_sparse(kv_len):  # admitted as a sparse one (pressure)
                    self.pressure.offload(req, tree_cache, "admission")
                else:  # policy pressure with room, or dd_sparse false (a reloaded prefix of one)
                    st.path.to(S.DENSE)
        table.just_released.clear()
        return self.tally.reclaimed_slots - before

    def after_decode(self, batch, tree_cache) -> int:
        """After a decode batch: flush full pages of sparse requests, or offload grown dense ones.

        Returns the number of device slots made reclaimable (see :meth:`after_extend`).
        """
        before = self.tally.reclaimed_slots
        device = self.offloader.device
        for req in batch.reqs:
            if req.finished() or not req.kv.holds_kv:
                continue
            st = self.table.requests.get(req.rid)
            if st is None:
                continue
            kv_len = int(req.kv.kv_committed_len)
            self.table.kv_len[req.rid] = kv_len
            if st.path.state is S.DECODE_SPARSE:
                self.offloader.flush_and_slide(st, kv_len)
            elif (
                st.path.state is S.DENSE
                and st.path.wants_sparse(kv_len)
                and self.host.available_size() > st.retry.host_free
                and device.allocator.available_size() > st.retry.device_free
            ):
                st.path.to(S.PREFILL_FULL)
                self.offloader.offload(req, st, tree_cache)
        self.table.just_released.clear()
        return self.tally.reclaimed_slots - before

    # ------------------------------------------------------------------ pressure
    def admission_may_reopen(self, running_reqs) -> bool:
        """Whether a running request could be offloaded for a waiting one (``pressure`` policy): then
        SGLang's closed admission (``batch_is_full``) is worth trying again."""
        return self.pressure.has_candidates(running_reqs)

    def sparse_reservation(self, max_new: int) -> int:
        """Device slots to reserve for the generation of a request admitted as one that goes sparse
        after its prefill (``max_new``: SGLang's figure, tokens)."""
        return min(max_new, self.params.resident_bound)

    # ------------------------------------------------------------------ release
    def free_request_slots(self, kv, ranges: list[tuple[int, int]]) -> bool:
        """See :meth:`Offloader.free_request_slots` (the radix cache's ``free_kv_row`` calls this)."""
        return self.offloader.free_request_slots(kv, ranges)

    def on_release(self, req) -> None:
        """SGLang released the request's row (finished, aborted or retracted).

        A released sparse request's host pages become a host prefix entry keyed by
        its token ids (those of one released during a prefill through the host tier are freed);
        the request's state is dropped and its path ends ``FINISHED``.
        """
        st = self.table.drop(req.rid)
        if st is None:
            return
        if st.path.state is S.PREFILL_FULL and st.host_slots.numel():
            # Released mid-way through a prefill through the host tier (aborted): its pages are freed,
            # not kept as a prefix entry, so both tiers are back where they were before it.
            self.host.free(st.host_slots)
            st.host_slots, st.host_len = torch.empty(0, dtype=torch.int64), 0
        if st.host_slots.numel():
            ids = list(req.origin_input_ids) + list(req.output_ids)
            self.prefixes.keep(ids, st.host_slots, st.host_len, (req.extra_key, req.cache_salt))
        st.path.to(S.FINISHED)

    def reset(self) -> None:
        """Drop every host prefix entry (SGLang's ``/flush_cache``; only called with no running request)."""
        self.prefixes.clear()
        self.table.rebuilt.clear()

    # ------------------------------------------------------------------ rebuild (new turn)
    def longest_host_prefix(self, tokens: torch.Tensor, namespace: tuple) -> tuple[int, int | None]:
        """``(length, entry id)`` of the longest host entry prefix of ``tokens`` (``[n]`` int64)."""
        return self.prefixes.longest_prefix(tokens, namespace)

    def rebuild_prefix(self, rid: str, entry_id: int, start: int, end: int, dst_slots: torch.Tensor) -> None:
        """REBUILD: copy host entry positions ``[start, end)`` into device ``dst_slots``, in chunks.

        ``dst_slots``: ``[end - start]`` device slots the caller allocated. The request
        ``rid`` starts its DualPath in ``REBUILD`` when it is admitted.
        """
        t0 = time.perf_counter()
        self.prefixes.load(entry_id, start, end, dst_slots)
        self.tally.rebuilt_tokens += end - start
        if self.hooks.on_rebuild is not None:
            self.hooks.on_rebuild(end - start)
        self.table.rebuilt.add(rid)
        logger.debug(
            "dualdecoder: rebuilt %d tokens for %s in %.3f s", end - start, rid, time.perf_counter() - t0
        )
