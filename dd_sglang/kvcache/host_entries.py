"""Finished requests' host-tier pages kept as a prefix cache, and host-slot allocation that
makes room by evicting them.

When a released sparse request leaves the host tier holding positions ``[0, n)``, those
pages become a :class:`HostEntry` keyed by the request's token ids and its namespace
(SGLang's ``extra_key`` and ``cache_salt``). A later request with the same prefix reloads
them into fresh device slots (:meth:`HostPrefixEntries.load`, DualPath state ``REBUILD``)
instead of recomputing its prefill. Entries are evicted least recently used first, and only
when a live request needs host slots (:meth:`HostPrefixEntries.alloc`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from dd_sglang.kvcache.host_pool import HostSparseKVPool

#: Tokens copied per chunk when a host-tier prefix is loaded back (REBUILD).
REBUILD_CHUNK_TOKENS = 1024


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


class HostPrefixEntries:
    """The host prefix entries of one host tier, least recently used first.

    Args:
        host: the host tier the entries' slots belong to.
        device_pool: SGLang's device KV pool, where :meth:`load` copies entries back to.
    """

    def __init__(self, host: HostSparseKVPool, device_pool) -> None:
        self.host = host
        self.device_pool = device_pool
        self.entries: OrderedDict[int, HostEntry] = OrderedDict()
        self._next_id = 0

    def tokens(self) -> int:
        """Host-tier slots held by the entries."""
        return sum(int(e.owned.numel()) for e in self.entries.values())

    def alloc(self, n_tokens: int) -> torch.Tensor | None:
        """Host slots for ``n_tokens`` (whole pages), evicting entries (LRU first) if needed.

        None, with no entry evicted, when even evicting every entry would not make room.
        """
        need = -(-n_tokens // self.host.page_size) * self.host.page_size
        if need > self.host.available_size() + self.tokens():
            return None
        got = self.host.alloc_tokens(n_tokens)
        while got is None and self.entries:
            _, entry = self.entries.popitem(last=False)
            self.host.free(entry.owned)
            got = self.host.alloc_tokens(n_tokens)
        return got

    def keep(self, ids: list[int], host_slots: torch.Tensor, host_len: int, namespace: tuple) -> None:
        """A released request's host slots ``host_slots`` (positions ``[0, host_len)`` filled) and
        token ids ``ids``: kept as an entry, or freed when empty, short of ids, or redundant."""
        if host_len <= 0:
            self.host.free(host_slots)
            return
        tokens = torch.tensor(ids[:host_len], dtype=torch.int64)
        if tokens.numel() == host_len and self._make_room_for(tokens, namespace):
            self.entries[self._next_id] = HostEntry(tokens, host_slots[:host_len], host_slots, namespace)
            self._next_id += 1
        else:
            self.host.free(host_slots)

    def _make_room_for(self, tokens: torch.Tensor, namespace: tuple) -> bool:
        """Deduplicate the entries before adding ``tokens``.

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

    def clear(self) -> None:
        """Drop every entry, freeing its host slots."""
        for entry in self.entries.values():
            self.host.free(entry.owned)
        self.entries.clear()

    def longest_prefix(self, tokens: torch.Tensor, namespace: tuple) -> tuple[int, int | None]:
        """``(length, entry id)`` of the longest entry prefix of ``tokens`` (``[n]`` int64)."""
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

    def load(self, entry_id: int, start: int, end: int, dst_slots: torch.Tensor) -> None:
        """Copy entry positions ``[start, end)`` into device ``dst_slots`` (``[end - start]``), in
        chunks of :data:`REBUILD_CHUNK_TOKENS`; the entry becomes most recently used."""
        entry = self.entries[entry_id]
        self.entries.move_to_end(entry_id)
        for s in range(start, end, REBUILD_CHUNK_TOKENS):
            e = min(end, s + REBUILD_CHUNK_TOKENS)
            host = entry.host_slots[s:e]
            dev = dst_slots[s - start : e - start]
            for layer in range(self.host.layer_num):
                self.host.load_to_device_per_layer(self.device_pool, host, dev, layer)
