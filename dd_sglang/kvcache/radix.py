"""``DualDecoderRadixCache``: SGLang's unified radix cache plus the host tier.

Registered as ``--radix-cache-backend dualdecoder`` (``patches/mem_cache_registry.py``)
and built by SGLang's own ``create_unified_radix_cache(ctx, cache_class=...)``
(``sglang/srt/mem_cache/registry.py``), so the device radix tree is SGLang's,
unchanged. What this subclass adds, through the tree-cache methods SGLang's
``release_kv_cache`` and ``match_kv_cache`` call (``sglang/srt/mem_cache/common.py``):

* ``free_kv_row``: a sparse request's row has holes (released positions point
  at padding slot 0); only the slots it still holds are freed, by
  :meth:`SparseRuntime.free_request_slots`.
* ``on_release``: the request's host pages become a host prefix entry.
* ``match_prefix``: when a finished request's host pages hold a longer prefix
  than the device tree, that prefix is loaded back into fresh device slots (in
  chunks) and inserted into the tree (``REBUILD``), then the match is redone;
  SGLang then reports those tokens as cached.
* ``reset`` (``/flush_cache``): host prefix entries are dropped too.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams, MatchResult
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from dd_sglang.kvcache.sparse_runtime import SparseRuntime

logger = logging.getLogger(__name__)


def runtime_of(tree_cache) -> SparseRuntime | None:
    """The :class:`SparseRuntime` the radix-cache factory attached to SGLang's tree cache
    ``tree_cache`` (``scheduler.tree_cache``, ``PrefillAdder.tree_cache``), or None when the
    process does not run ``--radix-cache-backend dualdecoder``."""
    runtime = getattr(tree_cache, "runtime", None)
    return runtime if isinstance(runtime, SparseRuntime) else None


class DualDecoderRadixCache(UnifiedRadixCache):
    """SGLang's ``UnifiedRadixCache`` whose requests may be on the sparse path.

    :attr:`runtime` is attached by the factory after construction; until then
    (and if it is None) every method behaves exactly as the parent's.
    """

    runtime: SparseRuntime | None = None

    def attach_runtime(self, runtime: SparseRuntime) -> None:
        """Hand over the process's runtime (the factory calls this once, right after construction)."""
        self.runtime = runtime

    def free_kv_row(self, kv, ranges: list[tuple[int, int]]) -> None:
        if self.runtime is not None and self.runtime.free_request_slots(kv, ranges):
            return
        super().free_kv_row(kv, ranges)

    def on_release(self, req, *, checkpointed: bool) -> None:
        super().on_release(req, checkpointed=checkpointed)
        if self.runtime is not None:
            self.runtime.on_release(req)

    def reset(self) -> None:
        super().reset()
        if self.runtime is not None:
            self.runtime.reset()

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        result = super().match_prefix(params)
        rt = self.runtime
        if rt is None or self.disable or params.req is None or not rt.entries:
            return result
        key = params.key
        if key.is_bigram or len(key) == 0:
            return result
        n = len(key)
        tokens = torch.from_numpy(np.frombuffer(key.raw_token_ids(), dtype=np.int64)[:n].copy())
        m, entry_id = rt.longest_host_prefix(tokens, (key.extra_key, key.cache_salt))
        m = m // self.page_size * self.page_size
        d = result.device_prefix_len
        if entry_id is None or m - d < rt.params.page_size:
            return result
        lock = self.lock(result.last_device_node)
        try:
            # SGLang's unified insert frees the slots it is handed for the part of the key the tree
            # already holds, so the value covers [0, m) with fresh slots throughout: the first d are
            # freed straight back by the insert, the rest receive the host tier's K/V.
            fresh = rt.alloc_device(m, self)
            if fresh is None:
                logger.info("dualdecoder: no device slots to reload %d host tokens; recomputing", m - d)
                return result
            rt.rebuild_prefix(params.req.rid, entry_id, d, m, fresh[d:])
            res = self.insert(InsertParams(key=key[:m], value=fresh))
            logger.debug("dualdecoder: REBUILD %s: tokens [%d, %d) from the host tier (tree had %d)",
                         params.req.rid, d, m, res.prefix_len)  # fmt: skip
        finally:
            self.unlock(lock)
        return super().match_prefix(params)
