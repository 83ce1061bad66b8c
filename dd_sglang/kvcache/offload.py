"""Moving a request's KV between the device tier and the host tier.

:class:`Offloader` does the three moves of the sparse path (the life of a request is
in :mod:`dd_sglang.kvcache.sparse_runtime`'s docstring):

* :meth:`Offloader.offload` (``PREFILL_FULL -> OFFLOADING -> DECODE_SPARSE``): positions
  ``[0, L)`` go to the host tier, the resident set (sinks, the ``n_keep`` largest key norms,
  the window) stays on the device, every other request-owned slot goes back to SGLang;
* :meth:`Offloader.flush_and_slide`: after a decode step, whole pages past the host-tier end
  go to the host tier and the window slides, freeing the slots that fell out of it;
* :meth:`Offloader.free_request_slots`: at release, the decode tail goes to the host tier
  (so the whole KV can serve as a prefix) and the remaining device slots are freed.

Failure leaves the request ``DENSE`` with its KV untouched; the radix tree never points at a
slot freed here (only request-owned slots are freed).
"""

from __future__ import annotations

import logging

import torch

from dd_sglang.kvcache.accounting import RuntimeHooks, SlotTally
from dd_sglang.kvcache.dualpath import PathState
from dd_sglang.kvcache.host_entries import HostPrefixEntries
from dd_sglang.kvcache.params import SparseParams
from dd_sglang.kvcache.sparse_request import RequestTable, SparseRequest

logger = logging.getLogger(__name__)
S = PathState


class DeviceSlots:
    """SGLang's device tier as the offloader uses it.

    Args:
        device_pool: SGLang's device KV pool (``k_buffer``/``v_buffer`` lists of
            ``[slots, num_kv_heads, head_dim]``).
        allocator: SGLang's ``token_to_kv_pool_allocator`` (``alloc``/``free``/``available_size``).
        req_to_token: ``[max_reqs, max_context_len]`` int32, SGLang's ``ReqToTokenPool.req_to_token``.
    """

    def __init__(self, device_pool, allocator, req_to_token: torch.Tensor) -> None:
        self.pool = device_pool
        self.allocator = allocator
        self.req_to_token = req_to_token

    def alloc(self, n: int, tree_cache) -> torch.Tensor | None:
        """``n`` device slots (int64, a copy), evicting radix-tree cache first if needed; None if full."""
        if n == 0:
            return torch.empty(0, dtype=torch.int64)
        if self.allocator.available_size() < n and tree_cache is not None:
            self.allocator.evict_to_free_tokens(tree_cache, n)
        got = self.allocator.alloc(n)
        return None if got is None else got.clone()

    def free(self, slots: torch.Tensor) -> None:
        """Give device ``slots`` (any integer dtype) back to SGLang's allocator."""
        self.allocator.free(slots.long().to(self.allocator.device))


class Offloader:
    """The device <-> host moves of one scheduler process's sparse requests.

    Args:
        params: :class:`SparseParams`.
        device: the device tier (:class:`DeviceSlots`).
        prefixes: the host prefix entries, which own the host tier and give host slots.
        table: the live requests (an offloaded request is entered by its ``req_to_token`` row).
        tally: counters this class adds to (offloaded tokens, reclaimed slots).
        hooks: metric callbacks (``on_unpin``).
    """

    def __init__(self, params: SparseParams, device: DeviceSlots, prefixes: HostPrefixEntries,
                 table: RequestTable, tally: SlotTally, hooks: RuntimeHooks) -> None:  # fmt: skip
        self.params = params
        self.device = device
        self.prefixes = prefixes
        self.host = prefixes.host
        self.table = table
        self.tally = tally
        self.hooks = hooks

    # ------------------------------------------------------------------ host tier
    def ensure_host_capacity(self, st: SparseRequest, n_positions: int) -> bool:
        """Grow ``st.host_slots`` to cover ``n_positions``; False (nothing changed) when the tier is full."""
        missing = n_positions - st.host_slots.numel()
        if missing <= 0:
            return True
        got = self.prefixes.alloc(missing)
        if got is None:
            return False
        st.host_slots = torch.cat([st.host_slots, got])
        return True

    def copy_to_host(self, row: torch.Tensor, st: SparseRequest, start: int, end: int) -> None:
        """Copy every layer's K/V of positions ``[start, end)`` (device slots ``row[start:end]``) to the host tier."""
        dev = row[start:end].long()
        self.host.backup_from_device_all_layer(self.device.pool, st.host_slots[start:end], dev)

    # ------------------------------------------------------------------ offload
    def keep_positions(self, row: torch.Tensor, lo: int, hi: int, st: SparseRequest | None = None,
                       on_host: int = 0) -> torch.Tensor:  # fmt: skip
        """``n_keep`` positions in ``[lo, hi)`` with the largest key L2 norm summed over layers and heads.

        ``on_host``: positions below it have no device slot (a chunked prefill through the host tier);
        then every key is read from ``st``'s host slots, which hold ``[0, hi)`` by now."""
        n = min(self.params.n_keep, max(hi - lo, 0))
        if n == 0:
            return torch.empty(0, dtype=torch.int64)
        score = torch.zeros(hi - lo, dtype=torch.float32)
        if on_host:
            for layer in range(self.host.layer_num):
                score += self.host.gather(layer, st.host_slots[lo:hi])[0].float().norm(dim=-1).sum(dim=-1)
        else:
            slots = row[lo:hi].long()
            for k_buf in self.device.pool.k_buffer:
                score += k_buf[slots].float().norm(dim=-1).sum(dim=-1).cpu()
        return torch.sort(score.topk(n).indices + lo).values

    def _load_from_host(self, st: SparseRequest, pos: torch.Tensor, dst: torch.Tensor) -> None:
        """Every layer's K/V of positions ``pos`` from ``st``'s host slots into device slots ``dst``."""
        for layer in range(self.host.layer_num):
            self.host.load_to_device_per_layer(self.device.pool, st.host_slots[pos], dst, layer)

    def _copy_on_device(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Every layer's K/V of device slots ``src`` into device slots ``dst`` (int64, same length)."""
        for k_buf, v_buf in zip(self.device.pool.k_buffer, self.device.pool.v_buffer, strict=True):
            k_buf[dst] = k_buf[src]
            v_buf[dst] = v_buf[src]

    def _restore_from_host(self, st: SparseRequest, row: torch.Tensor, pos: torch.Tensor, tree_cache) -> bool:
        """Fresh device slots for the resident positions ``pos`` (``[n]`` int64) that only the host tier
        holds, filled from it; ``row`` (a copy of the request's ``req_to_token`` row) updated in place.
        False, nothing allocated, when the pool cannot give them."""
        n = int(pos.numel())
        if n == 0:
            return True
        fresh = self.device.alloc(n, tree_cache)
        if fresh is None:
            return False
        self._load_from_host(st, pos, fresh)
        row[pos] = fresh.to(row.dtype)
        return True

    def offload_chunk(self, req, st: SparseRequest, tree_cache) -> bool:
        """After a middle chunk of a prompt longer than the device pool (chunked prefill through the host
        tier): every position the request holds on the device goes to the host tier and its slots go
        back to SGLang, so the device holds at most one chunk of it at a time.

        Positions ``[st.host_len, E)`` (``E``: the KV computed so far, ``kv_committed_len``) are copied
        to the host tier (every layer); request-owned slots are freed, the row points at SGLang's
        padding slot 0 there, the request drops its tree lock and is never inserted into the radix tree
        (``skip_radix_cache_insert``; a matched prefix stays the tree's evictable cache). The request
        stays ``PREFILL_FULL``; it is entered by its row (``released``, window start ``E``), so the
        ``dualdecoder`` extend reads ``[0, E)`` from the host tier
        (:func:`dd_sglang.attention.extend.extend_after_prefix`) and a release frees only its device slots.

        The sinks (``n_sink`` first positions) keep device slots from the first chunk on (copies of
        their own when the tree owns them). The host slots for the whole prompt are taken at the first
        chunk. Returns False, nothing changed, when the host tier cannot hold the prompt (or, at the
        first chunk, the pool cannot give the sinks' copies).
        """
        kv = req.kv
        pool_idx, end = kv.req_pool_idx, int(kv.kv_committed_len)
        if not self.ensure_host_capacity(st, len(req.origin_input_ids)):
            return False
        row_view = self.device.req_to_token[pool_idx]
        start = st.host_len
        row = row_view[:end].clone()
        self.copy_to_host(row, st, start, end)
        st.host_len = end
        self.tally.offloaded_tokens += end - start
        cpl = int(kv.cache_protected_len)
        first = start == 0
        if first:  # the sinks stay resident from the first chunk on: the last one needs no slot for them
            sink = min(self.params.n_sink, end)
            st.keep_pos = torch.arange(sink, dtype=torch.int64)
            n_tree = min(sink, cpl)  # tree-owned sinks: the request takes copies of its own (never inserted)
            if n_tree:
                fresh = self.device.alloc(n_tree, tree_cache)
                if fresh is None:
                    self.host.free(st.host_slots)
                    st.host_slots, st.host_len, st.keep_pos = torch.empty(0, dtype=torch.int64), 0, st.keep_pos[:0]
                    return False
                self._copy_on_device(row[:n_tree].long(), fresh)
                row[:n_tree] = fresh.to(row.dtype)
                row_view[:n_tree] = row[:n_tree]
            start = sink
        gone = torch.arange(max(start, cpl), end, dtype=torch.int64)
        if gone.numel():
            self.device.free(row[gone])
        row_view[start:end] = 0  # SGLang's padding slot
        if req.lock is not None:
            tree_cache.unlock(req.lock)
            req.lock = None
        kv.cache_protected_len = 0
        req.skip_radix_cache_insert = True
        st.pool_idx = pool_idx
        st.win_start = end
        st.released = True
        self.table.by_pool[pool_idx] = st
        self.tally.reclaimed_slots += int(gone.numel())
        return True

    def offload(self, req, st: SparseRequest, tree_cache, reason: str = "length") -> bool:
        """PREFILL_FULL -> OFFLOADING -> DECODE_SPARSE for ``req`` (see the module docstring).

        ``reason``: why it leaves the dense path (``length`` or ``pressure``), reported to
        ``hooks.on_path_change`` when it does.

        Returns True when the request is now sparse; False when it stays ``DENSE``
        (host tier full, or no device slots for the resident copies), KV untouched.
        """
        p = self.params
        kv = req.kv
        pool_idx = kv.req_pool_idx
        L = int(kv.kv_committed_len)
        row_view = self.device.req_to_token[pool_idx]
        if not self.ensure_host_capacity(st, L):
            if st.retry.host_free < 0:
                logger.info("dualdecoder: host tier full, %s stays dense (%d tokens)", req.rid, L)
            # Retried (after decode steps) only once the tier has more free slots than now.
            st.retry.host_free = self.host.available_size()
            st.path.to(S.DENSE)
            return False
        st.path.to(S.OFFLOADING)
        row = row_view[:L].clone()
        on_host = st.host_len  # > 0 after a chunked prefill through the host tier: [0, on_host) has no slot
        self.copy_to_host(row, st, on_host, L)
        st.host_len = L
        n_sink = min(p.n_sink, L)
        w = max(n_sink, L - p.n_recent)
        keep = torch.cat([torch.arange(n_sink, dtype=torch.int64), self.keep_positions(row, n_sink, w, st, on_host)])
        resident = torch.cat([keep, torch.arange(w, L, dtype=torch.int64)])
        cpl = int(kv.cache_protected_len)
        tree_owned = resident[resident < cpl]
        restored = resident[(resident < on_host) & (row[resident] == 0)]  # host-only (n_keep positions)
        if not self._restore_from_host(st, row, restored, tree_cache):
            logger.info("dualdecoder: no device slots for %d kept positions of %s; keeping none", restored.numel(),
                        req.rid)  # fmt: skip
            keep = keep[~torch.isin(keep, restored)]
            resident = torch.cat([keep, torch.arange(w, L, dtype=torch.int64)])
            restored = restored[:0]
        row_view[restored] = row[restored]
        if not self._move_tree_owned(req, st, row, tree_owned, tree_cache):
            logger.info("dualdecoder: no device slots for the resident set, %s stays dense", req.rid)
            # Retried (after decode steps) only once the pool has more free slots than now.
            st.retry.device_free = self.device.allocator.available_size()
            self.host.free(st.host_slots)
            st.host_slots, st.host_len = torch.empty(0, dtype=torch.int64), 0
            st.path.to(S.DENSE)
            return False
        row_view[tree_owned] = row[tree_owned]
        self._release_outside(req, row, row_view, resident, max(cpl, on_host), tree_cache)
        st.pool_idx = pool_idx
        st.keep_pos = keep
        st.win_start = w
        st.released = True
        self.table.by_pool[pool_idx] = st
        self.table.kv_len[req.rid] = L
        self.tally.offloaded_tokens += L - on_host
        self.tally.reclaimed_slots += (L - on_host) - int((resident >= on_host).sum())
        st.path.to(S.DECODE_SPARSE)
        if self.hooks.on_path_change is not None:
            self.hooks.on_path_change(reason)
        return True

    def _release_outside(self, req, row: torch.Tensor, row_view: torch.Tensor, resident: torch.Tensor,
                         cpl: int, tree_cache) -> None:  # fmt: skip
        """Give up the device slots of ``req``'s ``L = len(row)`` positions outside ``resident``.

        Request-owned slots (positions from ``cpl``: SGLang's ``cache_protected_len``, or the end of a
        chunked prefill's host-only part, which has no slot) go back to SGLang; their ``req_to_token``
        entries (``row_view``) point at SGLang's padding slot 0. The
        tree keeps its copy of the prompt as evictable cache: the request no longer pins it, and
        its row (now with holes) is never inserted into the tree.
        """
        L = int(row.numel())
        kv = req.kv
        is_resident = torch.zeros(L, dtype=torch.bool)
        is_resident[resident] = True
        owned_gone = (~is_resident).nonzero().flatten()
        owned_gone = owned_gone[owned_gone >= cpl]
        if owned_gone.numel():
            self.device.free(row[owned_gone])
        row_view[:L][~is_resident] = 0  # SGLang's padding slot
        if req.lock is not None:
            tree_cache.unlock(req.lock)
            req.lock = None
        kv.cache_protected_len = 0
        req.skip_radix_cache_insert = True  # the row now has holes; never insert it

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
        fresh = self.device.alloc(n, tree_cache)
        from_host = False
        if fresh is None:
            fresh = self._alloc_unpinned(req, n, tree_cache)
            if fresh is None:
                return False
            from_host = True
        if n == 0:
            return True
        if from_host:
            self._load_from_host(st, pos, fresh)
        else:
            self._copy_on_device(row[pos].long(), fresh)
        row[pos] = fresh.to(row.dtype)
        return True

    def _alloc_unpinned(self, req, n: int, tree_cache) -> torch.Tensor | None:
        """``n`` device slots after dropping ``req``'s tree lock on its own prompt (see
        :meth:`_move_tree_owned`); None, with the lock taken again, when even that cannot give them."""
        if req.lock is None or tree_cache is None:
            return None
        node = req.lock.node
        tree_cache.unlock(req.lock)
        req.lock = None
        if self.device.allocator.available_size() + tree_cache.evictable_size() < n:
            req.lock = tree_cache.lock(node)
            return None
        fresh = self.device.alloc(n, tree_cache)
        if fresh is None:  # the tree's evictable count was exact, so this is not expected
            raise RuntimeError(f"dualdecoder: {n} slots reported evictable could not be allocated")
        if self.hooks.on_unpin is not None:
            self.hooks.on_unpin()
        logger.info("dualdecoder: %s unpinned its prompt for %d resident slots (pool full)", req.rid, n)
        return fresh

    # ------------------------------------------------------------------ decode
    def flush_and_slide(self, st: SparseRequest, kv_len: int) -> None:
        """After a decode step of ``st`` (``kv_len`` positions with KV): whole pages past the host-tier end
        go to the host tier, and the window slides over what the host tier now holds."""
        p = self.params
        pending = kv_len - st.host_len
        if pending >= p.page_size:
            n = pending // p.page_size * p.page_size
            if self.ensure_host_capacity(st, st.host_len + n):
                row = self.device.req_to_token[st.pool_idx]
                self.copy_to_host(row, st, st.host_len, st.host_len + n)
                st.host_len += n
        new_w = max(st.win_start, min(st.host_len, kv_len - p.n_recent))
        if new_w > st.win_start:
            row = self.device.req_to_token[st.pool_idx]
            gone = row[st.win_start : new_w].long()
            self.device.free(gone)
            row[st.win_start : new_w] = 0
            self.tally.reclaimed_slots += new_w - st.win_start
            st.win_start = new_w

    # ------------------------------------------------------------------ release
    def free_request_slots(self, kv, ranges: list[tuple[int, int]]) -> bool:
        """Free the device slots a released request holds in row-position ``ranges``.

        Called by the radix cache's ``free_kv_row``. Returns False when the row is
        not a released sparse request (the caller then frees as SGLang does).
        On the first call the decode tail still on the device is copied to the host
        tier, so the finished request's whole KV can be reused as a prefix.
        """
        st = self.table.by_pool.get(kv.req_pool_idx)
        if st is None or not st.released:
            return False
        row = self.device.req_to_token[kv.req_pool_idx]
        if not st.tail_flushed:
            st.tail_flushed = True
            end = int(kv.kv_committed_len)
            if end > st.host_len and self.ensure_host_capacity(st, end):
                self.copy_to_host(row, st, st.host_len, end)
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
                self.device.free(row[pos])
                row[pos] = 0
        return True
