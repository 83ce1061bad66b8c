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
2. ``OFFLOADING`` (:meth:`offload`): every layer's K/V of positions
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

If the host tier cannot take a request (after evicting finished entries),
or the device cannot give the few slots the resident set needs, the request
stays ``DENSE`` with its KV untouched: nothing is lost and nothing crashes.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dd_sglang.kvcache.dualpath import DualPath, PathState
from dd_sglang.kvcache.host_pool import HostSparseKVPool
from dd_sglang.kvcache.params import SparseParams, request_overrides

logger = logging.getLogger(__name__)
S = PathState

#: min_sparse_len of a request that asked to stay dense (``custom_params.dd_sparse: false``).
DENSE_ONLY = 2**62

#: Tokens copied per chunk when a host-tier prefix is loaded back (REBUILD).
REBUILD_CHUNK_TOKENS = 1024


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
        top_k, selector, speculator: this request's critical-set size, selector and
            speculator (the preset's, or the request's ``custom_params`` overrides).
        miss_policy: the request's ``dd_miss_policy`` override, or None (the preset's).
        req: SGLang's ``Req`` (its token ids feed the speculators).

    The prefetch layer's per-request state (speculation, chosen sets) is its own,
    dropped through :meth:`SparseRuntime.add_release_listener`.
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
    top_k: int = 0
    selector: str = ""
    speculator: str = "none"
    miss_policy: str | None = None
    req: object = None
    host_free_at_failure: int = -1  # free host slots when an offload last failed (-1: never)
    device_free_at_failure: int = -1  # free device slots when an offload last found none for its resident set

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


@dataclass
class HostEntry:
    """A finished request's host-tier pages, reusable as a prefix.

    ``tokens`` and ``host_slots`` are ``[n]`` int64 (position -> token id / host slot);
    ``owned`` is every slot the entry holds (whole pages, ``>= n``).
    """

    tokens: torch.Tensor
    host_slots: torch.Tensor
    owned: torch.Tensor
    namespace: tuple


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
        selectors: selector names a request may choose with ``custom_params.dd_selector``.
        speculators: speculator names a request may choose with ``custom_params.dd_speculator``.
        speculator: the preset's speculator (``experimental.speculator``).
        experimental_overrides: the preset's ``experimental.request_overrides``: requests may
            set ``custom_params.dd_speculator`` and ``dd_miss_policy``.

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
        selectors: tuple[str, ...] = ("oracle",),
        speculators: tuple[str, ...] = ("none",),
        speculator: str = "none",
        experimental_overrides: bool = False,
    ):
        v_dim = getattr(device_pool, "v_head_dim", device_pool.head_dim)
        if v_dim != device_pool.head_dim:
            raise ValueError(
                f"dualdecoder host tier needs equal K/V head sizes, got {device_pool.head_dim}/{v_dim}"
            )
        self.params = params
        self.device_pool = device_pool
        self.allocator = allocator
        self.req_to_token = req_to_token
        self.on_transition = on_transition
        self.on_rebuild = on_rebuild
        self.on_unpin = on_unpin
        self.selectors = selectors
        self.speculators = speculators
        self.speculator = speculator
        self.experimental_overrides = experimental_overrides
        self.host = HostSparseKVPool(
            num_layers=len(device_pool.k_buffer),
            num_kv_heads=device_pool.head_num,
            head_dim=device_pool.head_dim,
            dtype=device_pool.k_buffer[0].dtype,
            capacity_bytes=params.host_tier_bytes,
            page_size=params.page_size,
            pin_memory=True,
        )
        self.requests: dict[str, SparseRequest] = {}
        self.by_pool: dict[int, SparseRequest] = {}
        self.entries: OrderedDict[int, HostEntry] = OrderedDict()
        self._next_entry = 0
        self._rebuilt: set[str] = set()
        self._kv_len: dict[str, int] = {}  # rid -> positions with KV after the last batch
        self._just_released: set[str] = set()  # tracked rids released during the current batch
        # Counters for /stats and the bench (tokens).
        self.offloaded_tokens = 0
        self.rebuilt_tokens = 0
        # Published by the attention backend each decode step (bytes).
        self.ring_buffer_bytes = 0  # the layer ring: the sparse rows' attention K/V for the layers in flight
        self.critical_buffer_bytes = 0  # the ring's critical-set columns, part of the above
        self.selector_aux: dict[str, int] = {}  # device bytes kept only to choose critical sets, by selector
        self.host_index_bytes = 0  # host bytes of the int8 key index spec_host reads
        self.reclaimed_slots = 0  # device slots given back (freed or left evictable), cumulative
        self._release_listeners: list[Callable[[str], None]] = []

    # ------------------------------------------------------------------ lookups
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

    def resident_tokens(self) -> int:
        """Device slots held by released (sparse) requests, summed."""
        return sum(
            st.device_tokens(self._kv_end(st))
            for st in self.requests.values()
            if st.released and st.pool_idx is not None
        )

    def max_request_device_tokens(self) -> int:
        """Largest device-slot count of one released (sparse) request now."""
        return max(
            (st.device_tokens(self._kv_end(st)) for st in self.requests.values() if st.released), default=0
        )

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
        st = self.requests.get(rid)
        if st is None or st.path.state is not S.DECODE_SPARSE:
            return None
        if not self._host_takes(0):
            return None
        return max(0, self.params.resident_bound - st.device_tokens(self._kv_end(st)))

    def admission_new_tokens(self, req, max_new: int) -> int | None:
        """Device slots to reserve for a request being admitted, instead of SGLang's ``max_new``.

        ``req``: SGLang's ``Req``; ``max_new``: the tokens SGLang reserves for its generation
        (``min(max_new_tokens - generated, 4096)``, ``PrefillAdder.add_one_req``). A request whose
        context reaches ``min_sparse_len`` goes sparse right after its prefill (before its second
        token), and then never holds more than ``resident_bound`` slots: that bound is reserved.
        None (SGLang's figure stands) for a request that stays dense (shorter, or
        ``custom_params.dd_sparse`` false, or invalid overrides, which SGLang rejects anyway) and
        when the host tier cannot take its whole context and generation beside the rest of every
        sparse request's.
        """
        n = len(req.origin_input_ids) + len(req.output_ids)
        try:
            over = self._overrides(req)
        except ValueError:
            return None
        if n < self.params.min_sparse_len or not over.get("sparse", True):
            return None
        if not self._host_takes(n + max_new):
            return None
        return min(max_new, self.params.resident_bound)

    def _overrides(self, req) -> dict:
        """``req``'s ``custom_params`` overrides, checked against this server's limits
        (:func:`~dd_sglang.kvcache.params.request_overrides`; raises its ``ValueError``)."""
        custom = getattr(getattr(req, "sampling_params", None), "custom_params", None)
        return request_overrides(custom, self.selectors, self.speculators, self.params.request_top_k_max,
                                 self.experimental_overrides)  # fmt: skip

    def _host_takes(self, extra: int) -> bool:
        """Whether the host tier (free slots plus finished entries it may evict) can take ``extra``
        tokens more than the rest of every sparse request's generation (whole pages each). False
        when a sparse request's ``max_new_tokens`` is unknown."""
        page = self.params.page_size
        need = -(-extra // page) * page
        for other in self.requests.values():
            if other.path.state is S.DECODE_SPARSE:
                left = _tokens_left(other.req)
                if left is None:
                    return False
                need += -(-left // page) * page
        return need <= self.host.available_size() + self.host_entry_tokens()

    def selector_aux_bytes(self) -> dict[str, int]:
        """Device bytes of selection state by selector (published by the attention backend)."""
        return dict(self.selector_aux)

    def add_release_listener(self, fn: Callable[[str], None]) -> None:
        """Call ``fn(rid)`` whenever a tracked request is released (finished, aborted, retracted)."""
        if fn not in self._release_listeners:
            self._release_listeners.append(fn)

    def _kv_end(self, st: SparseRequest) -> int:
        return self._kv_len.get(st.rid, st.win_start)

    # ------------------------------------------------------------------ admission
    def _path_for(self, req) -> SparseRequest:
        st = self.requests.get(req.rid)
        if st is None:
            n = len(req.origin_input_ids) + max(len(req.output_ids) - 1, 0)
            over = self._overrides(req)
            # dd_sparse false: no context is long enough to leave the dense path.
            min_len = self.params.min_sparse_len if over.get("sparse", True) else DENSE_ONLY
            path = DualPath(req.rid, n, min_len, self.on_transition)
            if req.rid in self._rebuilt:
                self._rebuilt.discard(req.rid)
                path = DualPath.starting_in(S.REBUILD, req.rid, min_len, self.on_transition)
            st = SparseRequest(
                req.rid,
                path,
                top_k=over.get("top_k", self.params.top_k),
                selector=over.get("selector", self.params.selector),
                speculator=over.get("speculator", self.speculator),
                miss_policy=over.get("miss_policy"),
                req=req,
            )
            self.requests[req.rid] = st
        return st

    def after_extend(self, batch, tree_cache) -> int:
        """After a prefill/extend batch: track each request; offload those whose prefill is done.

        Returns the number of device slots the offloads made reclaimable (freed, or left to the
        radix tree as evictable cache).
        """
        before = self.reclaimed_slots
        for req in batch.reqs:
            if req.finished():
                # Finished in this prefill (max_tokens=1, an immediate stop, an abort): SGLang has
                # already released it; record its path so the transition metrics see it.
                if req.rid not in self.requests and req.rid not in self._just_released:
                    path = self._path_for(req).path
                    self.requests.pop(req.rid, None)
                    self._rebuilt.discard(req.rid)
                    if path.state is S.REBUILD:
                        path.to(S.PREFILL_FULL)
                    path.to(S.FINISHED)
                continue
            if not req.kv.holds_kv:
                continue
            st = self._path_for(req)
            if st.path.state is S.REBUILD:
                st.path.to(S.PREFILL_FULL)
            if len(req.output_ids) == 0:  # a middle prefill chunk
                continue
            self._kv_len[req.rid] = int(req.kv.kv_committed_len)
            if st.path.state is S.PREFILL_FULL:
                if st.path.wants_sparse(int(req.kv.kv_committed_len)):
                    self.offload(req, st, tree_cache)
                else:  # a reloaded prefix of a request that asked to stay dense (dd_sparse false)
                    st.path.to(S.DENSE)
        self._just_released.clear()
        return self.reclaimed_slots - before

    def after_decode(self, batch, tree_cache) -> int:
        """After a decode batch: flush full pages of sparse requests, or offload grown dense ones.

        Returns the number of device slots made reclaimable (see :meth:`after_extend`).
        """
        before = self.reclaimed_slots
        for req in batch.reqs:
            if req.finished() or not req.kv.holds_kv:
                continue
            st = self.requests.get(req.rid)
            if st is None:
                continue
            kv_len = int(req.kv.kv_committed_len)
            self._kv_len[req.rid] = kv_len
            if st.path.state is S.DECODE_SPARSE:
                self._flush_and_slide(req, st, kv_len)
            elif (
                st.path.state is S.DENSE
                and st.path.wants_sparse(kv_len)
                and self.host.available_size() > st.host_free_at_failure
                and self.allocator.available_size() > st.device_free_at_failure
            ):
                st.path.to(S.PREFILL_FULL)
                self.offload(req, st, tree_cache)
        self._just_released.clear()
        return self.reclaimed_slots - before

    # ------------------------------------------------------------------ host tier
    def _host_alloc(self, n_tokens: int) -> torch.Tensor | None:
        """Host slots for ``n_tokens`` (whole pages), evicting finished entries (LRU first) if needed.

        None, with no entry evicted, when even evicting every entry would not make room.
        """
        need = -(-n_tokens // self.host.page_size) * self.host.page_size
        if need > self.host.available_size() + self.host_entry_tokens():
            return None
        got = self.host.alloc_tokens(n_tokens)
        while got is None and self.entries:
            _, entry = self.entries.popitem(last=False)
            self.host.free(entry.owned)
            got = self.host.alloc_tokens(n_tokens)
        return got

    def _ensure_host_capacity(self, st: SparseRequest, n_positions: int) -> bool:
        missing = n_positions - st.host_slots.numel()
        if missing <= 0:
            return True
        got = self._host_alloc(missing)
        if got is None:
            return False
        st.host_slots = torch.cat([st.host_slots, got])
        return True

    def _copy_to_host(self, row: torch.Tensor, st: SparseRequest, start: int, end: int) -> None:
        dev = row[start:end].long()
        self.host.backup_from_device_all_layer(self.device_pool, st.host_slots[start:end], dev)

    # ------------------------------------------------------------------ offload
    def _keep_positions(self, row: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """``n_keep`` positions in ``[lo, hi)`` with the largest key L2 norm summed over layers and heads."""
        n = min(self.params.n_keep, max(hi - lo, 0))
        if n == 0:
            return torch.empty(0, dtype=torch.int64)
        slots = row[lo:hi].long()
        score = torch.zeros(hi - lo, dtype=torch.float32)
        for k_buf in self.device_pool.k_buffer:
            score += k_buf[slots].float().norm(dim=-1).sum(dim=-1).cpu()
        return torch.sort(score.topk(n).indices + lo).values

    def alloc_device(self, n: int, tree_cache) -> torch.Tensor | None:
        """``n`` device slots (int64, a copy), evicting radix-tree cache first if needed; None if full."""
        if n == 0:
            return torch.empty(0, dtype=torch.int64)
        if self.allocator.available_size() < n and tree_cache is not None:
            self.allocator.evict_to_free_tokens(tree_cache, n)
        got = self.allocator.alloc(n)
        return None if got is None else got.clone()

    def offload(self, req, st: SparseRequest, tree_cache) -> bool:
        """PREFILL_FULL -> OFFLOADING -> DECODE_SPARSE for ``req`` (see the module docstring).

        Returns True when the request is now sparse; False when it stays ``DENSE``
        (host tier full, or no device slots for the resident copies), KV untouched.
        """
        p = self.params
        kv = req.kv
        pool_idx = kv.req_pool_idx
        L = int(kv.kv_committed_len)
        row_view = self.req_to_token[pool_idx]
        if not self._ensure_host_capacity(st, L):
            if st.host_free_at_failure < 0:
                logger.info("dualdecoder: host tier full, %s stays dense (%d tokens)", req.rid, L)
            # Retried (after decode steps) only once the tier has more free slots than now.
            st.host_free_at_failure = self.host.available_size()
            st.path.to(S.DENSE)
            return False
        st.path.to(S.OFFLOADING)
        row = row_view[:L].clone()
        self._copy_to_host(row, st, 0, L)
        st.host_len = L
        n_sink = min(p.n_sink, L)
        w = max(n_sink, L - p.n_recent)
        keep = torch.cat([torch.arange(n_sink, dtype=torch.int64), self._keep_positions(row, n_sink, w)])
        resident = torch.cat([keep, torch.arange(w, L, dtype=torch.int64)])
        cpl = int(kv.cache_protected_len)
        tree_owned = resident[resident < cpl]
        if not self._move_tree_owned(req, st, row, tree_owned, tree_cache):
            logger.info("dualdecoder: no device slots for the resident set, %s stays dense", req.rid)
            # Retried (after decode steps) only once the pool has more free slots than now.
            st.device_free_at_failure = self.allocator.available_size()
            self.host.free(st.host_slots)
            st.host_slots, st.host_len = torch.empty(0, dtype=torch.int64), 0
            st.path.to(S.DENSE)
            return False
        row_view[tree_owned] = row[tree_owned]
        # Release: request-owned slots outside the resident set go back to SGLang.
        is_resident = torch.zeros(L, dtype=torch.bool)
        is_resident[resident] = True
        owned_gone = (~is_resident).nonzero().flatten()
        owned_gone = owned_gone[owned_gone >= cpl]
        if owned_gone.numel():
            self.allocator.free(row[owned_gone].long().to(self.allocator.device))
        row_view[:L][~is_resident] = 0  # SGLang's padding slot
        # The tree keeps its copy of the prompt as evictable cache; the request no longer pins it.
        if req.lock is not None:
            tree_cache.unlock(req.lock)
            req.lock = None
        kv.cache_protected_len = 0
        req.skip_radix_cache_insert = True  # the row now has holes; never insert it
        st.pool_idx = pool_idx
        st.keep_pos = keep
        st.win_start = w
        st.released = True
        self.by_pool[pool_idx] = st
        self._kv_len[req.rid] = L
        self.offloaded_tokens += L
        self.reclaimed_slots += L - int(resident.numel())
        st.path.to(S.DECODE_SPARSE)
        return True

    def _move_tree_owned(self, req, st: SparseRequest, row: torch.Tensor, pos: torch.Tensor, tree_cache) -> bool:
        """Give the resident positions ``pos`` (``[n]`` int64) whose slots the radix tree owns fresh slots.

        ``row``: the request's ``[L]`` slot row (a copy of ``req_to_token``'s), updated in place. First choice:
        ``n`` free slots (radix cache evicted as needed, the request's own prompt still locked),
        filled from the old slots on the device. When the pool cannot give them (e.g. two long
        prompts prefilled in one batch fill it), the request's tree lock is dropped first, so the
        tree may evict the request's own copy of the prompt; the fresh slots are then filled from
        the host tier, which already holds positions ``[0, L)``. The lock is dropped only when
        the pool's free plus evictable slots (``tree_cache.evictable_size()``, SGLang
        ``base_prefix_cache.py``) cover ``n``; otherwise it is taken again on the same node
        and False is returned with nothing evicted that the request needs.

        Raises:
            RuntimeError: slots the tree reported evictable could not be allocated (not expected:
                SGLang evicts every unlocked node before giving up).
        """
        n = int(pos.numel())
        fresh = self.alloc_device(n, tree_cache)
        from_host = False
        if fresh is None:
            if req.lock is None or tree_cache is None:
                return False
            node = req.lock.node
            tree_cache.unlock(req.lock)
            req.lock = None
            if self.allocator.available_size() + tree_cache.evictable_size() < n:
                req.lock = tree_cache.lock(node)
                return False
            fresh = self.alloc_device(n, tree_cache)
            if fresh is None:  # the tree's evictable count was exact, so this is not expected
                raise RuntimeError(f"dualdecoder: {n} slots reported evictable could not be allocated")
            from_host = True
            if self.on_unpin is not None:
                self.on_unpin()
            logger.info("dualdecoder: %s unpinned its prompt for %d resident slots (pool full)", req.rid, n)
        if n == 0:
            return True
        if from_host:
            for layer in range(self.host.layer_num):
                self.host.load_to_device_per_layer(self.device_pool, st.host_slots[pos], fresh, layer)
        else:
            src = row[pos].long()
            for k_buf, v_buf in zip(self.device_pool.k_buffer, self.device_pool.v_buffer, strict=True):
                k_buf[fresh] = k_buf[src]
                v_buf[fresh] = v_buf[src]
        row[pos] = fresh.to(row.dtype)
        return True

    def _flush_and_slide(self, req, st: SparseRequest, kv_len: int) -> None:
        p = self.params
        pending = kv_len - st.host_len
        if pending >= p.page_size:
            n = pending // p.page_size * p.page_size
            if self._ensure_host_capacity(st, st.host_len + n):
                row = self.req_to_token[st.pool_idx]
                self._copy_to_host(row, st, st.host_len, st.host_len + n)
                st.host_len += n
        new_w = max(st.win_start, min(st.host_len, kv_len - p.n_recent))
        if new_w > st.win_start:
            row = self.req_to_token[st.pool_idx]
            gone = row[st.win_start : new_w].long()
            self.allocator.free(gone.to(self.allocator.device))
            row[st.win_start : new_w] = 0
            self.reclaimed_slots += new_w - st.win_start
            st.win_start = new_w

    # ------------------------------------------------------------------ release
    def free_request_slots(self, kv, ranges: list[tuple[int, int]]) -> bool:
        """Free the device slots a released request holds in row-position ``ranges``.

        Called by the radix cache's ``free_kv_row``. Returns False when the row is
        not a released sparse request (the caller then frees as SGLang does).
        On the first call the decode tail still on the device is copied to the host
        tier, so the finished request's whole KV can be reused as a prefix.
        """
        st = self.by_pool.get(kv.req_pool_idx)
        if st is None or not st.released:
            return False
        row = self.req_to_token[kv.req_pool_idx]
        if not st.tail_flushed:
            st.tail_flushed = True
            end = int(kv.kv_committed_len)
            if end > st.host_len and self._ensure_host_capacity(st, end):
                self._copy_to_host(row, st, st.host_len, end)
                st.host_len = end
        gone = []
        for start, end in ranges:
            if end <= start:
                continue
            k = st.keep_pos[(st.keep_pos >= start) & (st.keep_pos < end)]
            gone.append(k)
            lo = max(start, st.win_start)
            if lo < end:
                gone.append(torch.arange(lo, end, dtype=torch.int64))
        if gone:
            pos = torch.cat(gone)
            if pos.numel():
                self.allocator.free(row[pos].long().to(self.allocator.device))
                row[pos] = 0
        return True

    def on_release(self, req) -> None:
        """SGLang released the request's row (finished, aborted or retracted).

        A released sparse request's host pages become a host prefix entry keyed by
        its token ids; the request's state is dropped and its path ends ``FINISHED``.
        """
        st = self.requests.pop(req.rid, None)
        self._kv_len.pop(req.rid, None)
        self._rebuilt.discard(req.rid)
        if st is None:
            return
        for fn in self._release_listeners:
            fn(req.rid)
        self._just_released.add(req.rid)
        if st.pool_idx is not None and self.by_pool.get(st.pool_idx) is st:
            del self.by_pool[st.pool_idx]
        if st.host_slots.numel():
            n = st.host_len
            if n > 0:
                ids = list(req.origin_input_ids) + list(req.output_ids)
                tokens = torch.tensor(ids[:n], dtype=torch.int64)
                namespace = (req.extra_key, req.cache_salt)
                if tokens.numel() == n and self._keep_entry(tokens, namespace):
                    self.entries[self._next_entry] = HostEntry(
                        tokens, st.host_slots[:n], st.host_slots, namespace
                    )
                    self._next_entry += 1
                else:
                    self.host.free(st.host_slots)
            else:
                self.host.free(st.host_slots)
        st.path.to(S.FINISHED)

    def _keep_entry(self, tokens: torch.Tensor, namespace: tuple) -> bool:
        """Deduplicate the host prefix cache before adding ``tokens``.

        An existing entry that already holds all of ``tokens`` makes the new one
        redundant (False; the existing entry becomes most recently used). Existing
        entries that are prefixes of ``tokens`` are dropped: the new entry serves them.
        """
        for eid, e in list(self.entries.items()):
            if e.namespace != namespace:
                continue
            m = min(e.tokens.numel(), tokens.numel())
            if not torch.equal(e.tokens[:m], tokens[:m]):
                continue
            if e.tokens.numel() >= tokens.numel():
                self.entries.move_to_end(eid)
                return False
            del self.entries[eid]
            self.host.free(e.owned)
        return True

    def reset(self) -> None:
        """Drop every host prefix entry (SGLang's ``/flush_cache``; only called with no running request)."""
        for entry in self.entries.values():
            self.host.free(entry.owned)
        self.entries.clear()
        self._rebuilt.clear()

    def host_entry_tokens(self) -> int:
        """Host-tier slots held by finished-request prefix entries."""
        return sum(int(e.owned.numel()) for e in self.entries.values())

    # ------------------------------------------------------------------ rebuild (new turn)
    def longest_host_prefix(self, tokens: torch.Tensor, namespace: tuple) -> tuple[int, int | None]:
        """``(length, entry id)`` of the longest host entry prefix of ``tokens`` (``[n]`` int64)."""
        best, best_id = 0, None
        for eid, e in self.entries.items():
            if e.namespace != namespace:
                continue
            m = min(e.tokens.numel(), tokens.numel())
            if m <= best:
                continue
            diff = (e.tokens[:m] != tokens[:m]).nonzero()
            common = int(diff[0]) if diff.numel() else m
            if common > best:
                best, best_id = common, eid
        return best, best_id

    def rebuild_prefix(self, rid: str, entry_id: int, start: int, end: int, dst_slots: torch.Tensor) -> None:
        """REBUILD: copy host entry positions ``[start, end)`` into device ``dst_slots``, in chunks.

        ``dst_slots``: ``[end - start]`` device slots the caller allocated. The request
        ``rid`` starts its DualPath in ``REBUILD`` when it is admitted.
        """
        entry = self.entries[entry_id]
        self.entries.move_to_end(entry_id)
        t0 = time.perf_counter()
        for s in range(start, end, REBUILD_CHUNK_TOKENS):
            e = min(end, s + REBUILD_CHUNK_TOKENS)
            host = entry.host_slots[s:e]
            dev = dst_slots[s - start : e - start]
            for layer in range(self.host.layer_num):
                self.host.load_to_device_per_layer(self.device_pool, host, dev, layer)
        self.rebuilt_tokens += end - start
        if self.on_rebuild is not None:
            self.on_rebuild(end - start)
        self._rebuilt.add(rid)
        logger.debug(
            "dualdecoder: rebuilt %d tokens for %s in %.3f s", end - start, rid, time.perf_counter() - t0
        )


def _tokens_left(req) -> int | None:
    """Tokens SGLang's ``Req`` ``req`` may still generate (``max_new_tokens`` minus its outputs), None if unknown."""
    params = getattr(req, "sampling_params", None)
    max_new = getattr(params, "max_new_tokens", None)
    if max_new is None:
        return None
    return max(0, int(max_new) - len(req.output_ids))

