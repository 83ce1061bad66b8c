"""SparseRuntime bookkeeping against SGLang-shaped fakes: bytes and slots accounted exactly.

The fakes mirror the SGLang objects the runtime touches (``MHATokenToKVPool``'s
``k_buffer``/``v_buffer`` lists with padding slot 0, the token allocator's
``alloc``/``free``/``available_size``, a ``Req`` with its ``ReqKvInfo``), so every
figure here is computed from real tensors, not mocked.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dd_sglang.kvcache.dualpath import PathState
from dd_sglang.kvcache.params import SparseParams
from dd_sglang.kvcache.sparse_runtime import SparseRuntime

LAYERS, HKV, D, SLOTS = 2, 3, 4, 400
PER_TOKEN = LAYERS * 2 * HKV * D * 4  # float32 K+V bytes of one token


class FakePool:
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.k_buffer = [torch.randn(SLOTS + 1, HKV, D, generator=g) for _ in range(LAYERS)]
        self.v_buffer = [torch.randn(SLOTS + 1, HKV, D, generator=g) for _ in range(LAYERS)]
        self.head_num, self.head_dim, self.v_head_dim, self.layer_num = HKV, D, D, LAYERS


class FakeAllocator:
    device = "cpu"

    def __init__(self, pool):
        self.pool = pool
        self.size = SLOTS
        self.free_slots = list(range(1, SLOTS + 1))

    def available_size(self):
        return len(self.free_slots)

    def alloc(self, n):
        if n > len(self.free_slots):
            return None
        got, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        return torch.tensor(got, dtype=torch.int64)

    def free(self, idx):
        idx = idx.tolist()
        assert 0 not in idx, "freed the padding slot"
        assert not set(idx) & set(self.free_slots), "double free"
        assert len(set(idx)) == len(idx), "double free"
        self.free_slots += idx

    def evict_to_free_tokens(self, tree, n):
        if hasattr(tree, "evict"):
            tree.evict(n - self.available_size(), self)

    def get_kvcache(self):
        return self.pool


class FakeTree:
    def __init__(self):
        self.unlocked = []

    def unlock(self, lock):
        self.unlocked.append(lock)


class PromptTree(FakeTree):
    """A radix tree holding one prompt's ``slots``, pinned by ``holders`` locks; evicts its tail first (leaves)."""

    def __init__(self, slots, holders=1):
        super().__init__()
        self.slots, self.holders, self.evicted, self.locked_nodes = list(slots.tolist()), holders, [], []

    def unlock(self, lock):
        super().unlock(lock)
        self.holders -= 1

    def lock(self, node):
        self.locked_nodes.append(node)
        self.holders += 1
        return SimpleNamespace(node=node)

    def evictable_size(self):
        return 0 if self.holders else len(self.slots)

    def evict(self, n, alloc):
        if self.holders or n <= 0:
            return
        gone, self.slots = self.slots[-n:], self.slots[:-n]
        self.evicted += gone
        alloc.free(torch.tensor(gone))


def params(**kw):
    base = dict(min_sparse_len=50, top_k=8, n_sink=4, n_recent=16, n_keep=3, page_size=8,
                host_tier_bytes=2000 * PER_TOKEN, selector="oracle")  # fmt: skip
    base.update(kw)
    return SparseParams(**base)


def setup(p=None, prompt=100, tree_owned=60):
    """A request with ``prompt`` tokens prefilled; the radix tree owns positions ``[0, tree_owned)``."""
    pool = FakePool()
    alloc = FakeAllocator(pool)
    req_to_token = torch.zeros(4, 1024, dtype=torch.int32)
    rt = SparseRuntime(p or params(), pool, alloc, req_to_token)
    tree_slots = alloc.alloc(tree_owned)  # held by the (fake) radix tree
    own = alloc.alloc(prompt - tree_owned)
    req_to_token[2, :prompt] = torch.cat([tree_slots, own]).int()
    kv = SimpleNamespace(req_pool_idx=2, cache_protected_len=tree_owned, kv_committed_len=prompt,
                         kv_allocated_len=prompt, holds_kv=True)  # fmt: skip
    req = SimpleNamespace(rid="r1", origin_input_ids=list(range(1000, 1000 + prompt)), output_ids=[7], kv=kv,
                          lock="lock-r1", skip_radix_cache_insert=False, extra_key=None, cache_salt=None,
                          finished=lambda: False)  # fmt: skip
    original_k = [k.clone() for k in pool.k_buffer]
    original_v = [v.clone() for v in pool.v_buffer]
    return rt, pool, alloc, req_to_token, req, FakeTree(), original_k, original_v


def test_offload_copies_everything_and_keeps_only_the_resident_set():
    rt, pool, alloc, r2t, req, tree, ok, ov = setup()
    row0 = r2t[2, :100].long().clone()
    free_before = alloc.available_size()
    rt.after_extend(SimpleNamespace(reqs=[req]), tree)
    st = rt.requests["r1"]
    assert st.path.state is PathState.DECODE_SPARSE
    assert st.path.history == [PathState.PREFILL_FULL, PathState.OFFLOADING, PathState.DECODE_SPARSE]
    # Host tier: every layer's K/V of all 100 positions, bit for bit; 13 pages of 8 allocated.
    for layer in range(LAYERS):
        hk, hv = rt.host.gather(layer, st.host_slots[:100])
        assert torch.equal(hk, ok[layer][row0]) and torch.equal(hv, ov[layer][row0])
    assert rt.host.used_bytes == 104 * PER_TOKEN
    # Resident set: 4 sinks + 3 largest key norms in [4, 84) + window [84, 100).
    norms = sum(ok[layer][row0[4:84]].norm(dim=-1).sum(-1) for layer in range(LAYERS))
    keep = sorted((norms.topk(3).indices + 4).tolist())
    assert st.keep_pos.tolist() == [0, 1, 2, 3, *keep]
    assert st.win_start == 84
    resident = [0, 1, 2, 3, *keep, *range(84, 100)]
    row = r2t[2, :100].long()
    for p in range(100):
        if p in resident:
            assert row[p] != 0
            for layer in range(LAYERS):  # same K/V, wherever the slot now is
                assert torch.equal(pool.k_buffer[layer][row[p]], ok[layer][row0[p]])
        else:
            assert row[p] == 0  # points at the padding slot
    # Slots: resident positions the tree owned got fresh slots; request-owned non-resident ones were freed.
    tree_resident = sum(1 for p in resident if p < 60)
    owned_gone = sum(1 for p in range(60, 100) if p not in resident)
    assert alloc.available_size() == free_before - tree_resident + owned_gone
    assert st.device_tokens(100) == len(resident)
    assert rt.resident_tokens() == len(resident)
    # The request no longer pins the tree's copy and never inserts its holed row.
    assert tree.unlocked == ["lock-r1"] and req.lock is None
    assert req.kv.cache_protected_len == 0 and req.skip_radix_cache_insert
    # Candidates for the critical set: every host position outside the resident set.
    assert st.host_candidates().tolist() == [p for p in range(100) if p not in resident]


def decode_steps(rt, alloc, pool, r2t, req, tree, n, dense=False):
    """``n`` decode steps as SGLang runs them: one new slot per step, its K/V written, committed. A sparse
    request (the default) stays within the resident bound; ``dense=True``: the request must stay DENSE and
    hold a device slot for every position."""
    bound = rt.params.resident_bound
    for _ in range(n):
        pos = req.kv.kv_committed_len
        slot = alloc.alloc(1)
        r2t[2, pos] = slot.int()
        for layer in range(LAYERS):
            pool.k_buffer[layer][slot] = torch.randn(1, HKV, D)
            pool.v_buffer[layer][slot] = torch.randn(1, HKV, D)
        req.kv.kv_committed_len += 1
        req.kv.kv_allocated_len += 1
        req.output_ids.append(pos)
        rt.after_decode(SimpleNamespace(reqs=[req]), tree)
        st = rt.requests[req.rid]
        if dense:
            assert st.path.state is PathState.DENSE
            assert st.device_tokens(req.kv.kv_committed_len) == req.kv.kv_committed_len and st.host_len == 0
            continue
        assert st.device_tokens(req.kv.kv_committed_len) <= bound
        assert st.win_start <= st.host_len <= req.kv.kv_committed_len


def test_decode_flushes_pages_and_slides_the_window():
    rt, pool, alloc, r2t, req, tree, *_ = setup()
    rt.after_extend(SimpleNamespace(reqs=[req]), tree)
    st = rt.requests["r1"]
    snapshots = {}
    for _ in range(37):
        decode_steps(rt, alloc, pool, r2t, req, tree, 1)
        pos = req.kv.kv_committed_len - 1
        snapshots[pos] = [pool.k_buffer[layer][r2t[2, pos].long()].clone() for layer in range(LAYERS)]
    assert req.kv.kv_committed_len == 137
    assert st.host_len == 132  # 100 + four whole pages of 8 decode tokens; 5 pending on the device
    assert st.win_start == 137 - 16  # the window slid as pages reached the host tier
    for pos, ks in snapshots.items():
        if pos < st.host_len:
            for layer in range(LAYERS):
                assert torch.equal(rt.host.gather(layer, st.host_slots[pos : pos + 1])[0][0], ks[layer])
    # Allocator: 60 tree slots + the resident set, nothing else.
    used = SLOTS - alloc.available_size()
    assert used == 60 + st.device_tokens(137)


def test_release_returns_every_slot_and_keeps_host_pages_as_a_prefix_entry():
    rt, pool, alloc, r2t, req, tree, *_ = setup()
    rt.after_extend(SimpleNamespace(reqs=[req]), tree)
    decode_steps(rt, alloc, pool, r2t, req, tree, 10)
    st = rt.requests["r1"]
    # What SGLang's release_kv_cache does: free_kv_row over [cache_protected_len, owned), then on_release.
    assert rt.free_request_slots(req.kv, [(req.kv.cache_protected_len, req.kv.kv_committed_len)])
    assert rt.free_request_slots(req.kv, [(110, 110)])  # the empty over-allocated tail
    assert SLOTS - alloc.available_size() == 60  # only the tree's slots remain
    assert st.host_len == 110  # the decode tail was flushed before its slots went back
    rt.on_release(req)
    assert st.path.state is PathState.FINISHED and not rt.requests and not rt.by_pool
    assert rt.host.used_bytes == rt.host_entry_tokens() * PER_TOKEN == 112 * PER_TOKEN
    ids = torch.tensor(req.origin_input_ids + req.output_ids[:10])
    assert rt.longest_host_prefix(ids[:110], (None, None))[0] == 110
    assert rt.longest_host_prefix(torch.cat([ids[:50], torch.tensor([5])]), (None, None))[0] == 50
    assert rt.longest_host_prefix(ids[:110], ("lora-a", None))[0] == 0  # namespaces never mix
    rt.reset()
    assert rt.host.used_bytes == 0


def test_rebuild_loads_the_host_prefix_into_device_slots():
    rt, pool, alloc, r2t, req, tree, ok, _ = setup()
    row0 = r2t[2, :100].long().clone()
    rt.after_extend(SimpleNamespace(reqs=[req]), tree)
    rt.free_request_slots(req.kv, [(0, 100)])
    rt.on_release(req)
    (entry_id,) = rt.entries
    dst = alloc.alloc(70)
    rt.rebuild_prefix("r2", entry_id, 30, 100, dst)
    for layer in range(LAYERS):
        assert torch.equal(pool.k_buffer[layer][dst], ok[layer][row0[30:100]])
    assert rt.rebuilt_tokens == 70
    # The next request with that rid starts in REBUILD.
    req2 = SimpleNamespace(**{**vars(req), "rid": "r2", "output_ids": []})
    req2.kv = SimpleNamespace(**{**vars(req.kv), "req_pool_idx": 3})
    rt.after_extend(SimpleNamespace(reqs=[req2]), tree)
    assert rt.requests["r2"].path.history == [PathState.REBUILD, PathState.PREFILL_FULL]


def test_host_tier_full_keeps_the_request_dense_and_loses_nothing():
    rt, pool, alloc, r2t, req, tree, *_ = setup(params(host_tier_bytes=3 * 8 * PER_TOKEN))
    row0 = r2t[2].clone()
    free_before = alloc.available_size()
    rt.after_extend(SimpleNamespace(reqs=[req]), tree)
    st = rt.requests["r1"]
    assert st.path.state is PathState.DENSE
    assert torch.equal(r2t[2], row0) and alloc.available_size() == free_before
    assert rt.host.used_bytes == 0 and tree.unlocked == [] and not req.skip_radix_cache_insert
    assert not rt.free_request_slots(req.kv, [(60, 100)])  # SGLang frees a dense request itself


def test_short_prompt_stays_dense():
    rt, pool, alloc, r2t, req, tree, *_ = setup(params(min_sparse_len=500))
    rt.after_extend(SimpleNamespace(reqs=[req]), tree)
    assert rt.requests["r1"].path.state is PathState.DENSE
    assert rt.state_counts()["DENSE"] == 1


def test_host_entries_are_evicted_lru_first_when_the_tier_fills():
    p = params(host_tier_bytes=(14 + 1) * 8 * PER_TOKEN)  # 14 usable pages: one 100-token request
    rt, pool, alloc, r2t, req, tree, *_ = setup(p)
    rt.after_extend(SimpleNamespace(reqs=[req]), tree)
    rt.free_request_slots(req.kv, [(0, 100)])
    rt.on_release(req)
    assert len(rt.entries) == 1
    # A second request needs the pages: the finished entry goes.
    _, _, alloc2, r2t2, req2, tree2, *_ = setup(p)
    from dd_sglang.kvcache.offload import DeviceSlots

    rt2 = rt
    rt2.offloader.device = DeviceSlots(alloc2.pool, alloc2, r2t2)
    rt2.prefixes.device_pool = alloc2.pool
    req2.rid = "r9"
    rt2.after_extend(SimpleNamespace(reqs=[req2]), tree2)
    assert rt2.requests["r9"].path.state is PathState.DECODE_SPARSE
    assert not rt2.entries


@pytest.mark.parametrize("bad", [{"host_tier_bytes": 8 * PER_TOKEN}])
def test_host_tier_below_two_pages_is_refused(bad):
    with pytest.raises(ValueError, match="host_tier_bytes"):
        setup(params(**bad))


def test_request_overrides_are_validated_with_the_field_named():
    from dd_sglang.kvcache.params import request_overrides

    sel = ("oracle", "recency")
    assert request_overrides(None, sel) == {}
    assert request_overrides({"other": 1}, sel) == {}
    assert request_overrides({"dd_top_k": 8192, "dd_selector": "recency"}, sel) == {
        "top_k": 8192,
        "selector": "recency",
    }
    for bad, needle in [({"dd_top_k": 0}, "dd_top_k must be an integer in [1, 1000000], got 0"),
                        ({"dd_top_k": True}, "dd_top_k"), ({"dd_top_k": 2.5}, "dd_top_k"),
                        ({"dd_selector": "x"}, "dd_selector must be one of ['oracle', 'recency']"),
                        ({"dd_sparse": "no"}, "dd_sparse must be true or false"),
                        ({"DD_TOP_K": 1}, "custom_params.DD_TOP_K is not a dd_sglang override (keys are lower case)"),
                        ('{"dd_top_k": 5}', "custom_params must be a JSON object"),
                        ([1], "custom_params must be a JSON object")]:  # fmt: skip
        with pytest.raises(ValueError) as e:
            request_overrides(bad, sel)
        assert needle in str(e.value)


def test_the_deleted_switches_are_refused_as_unknown_keys():
    """``dd_speculator`` / ``dd_miss_policy`` (switches measured worse, deleted) are refused like any
    unknown ``dd_`` key, naming the known ones; the scheduler's runtime holds the same check."""
    from dd_sglang.kvcache.params import request_overrides

    for key, value in (("dd_speculator", "ngram"), ("dd_miss_policy", "use_prefetched")):
        with pytest.raises(ValueError) as e:
            request_overrides({key: value, "dd_top_k": 8}, ("oracle",))
        assert f"custom_params.{key} is not a dd_sglang override" in str(e.value)
        assert "['dd_top_k', 'dd_selector', 'dd_sparse', 'dd_policy', 'dd_trace']" in str(e.value)
    rt, *_, req, _tree, _k, _v = setup(params())
    req.sampling_params = SimpleNamespace(custom_params={"dd_miss_policy": "use_prefetched"})
    with pytest.raises(ValueError, match="custom_params.dd_miss_policy is not a dd_sglang override"):
        rt.admission.overrides(req)


def test_the_presets_request_limits_bound_the_overrides():
    """``sparse.request_selectors`` / ``request_max_top_k``: the names a request may give are the listed
    ones plus the preset's own selector (in the registry's order); the largest ``dd_top_k`` is the cap."""
    from dd_sglang.kvcache.params import request_overrides
    from dd_sglang.prefetch.selectors import SELECTORS

    known = tuple(SELECTORS)
    assert params().request_selector_names(known) == known and params().request_top_k_max == 1_000_000
    p = params(selector="spec_host", request_selectors=["recency", "oracle"], request_max_top_k=512)
    assert p.request_selector_names(known) == ("spec_host", "oracle", "recency")
    assert params(request_selectors=[]).request_selector_names(known) == ("oracle",)
    sel = p.request_selector_names(known)
    assert request_overrides({"dd_top_k": 512, "dd_selector": "oracle"}, sel, p.request_top_k_max) == {
        "top_k": 512, "selector": "oracle"}  # fmt: skip
    for bad, needle in [({"dd_top_k": 513}, "custom_params.dd_top_k must be an integer in [1, 512], got 513"),
                        ({"dd_selector": "quest_device"}, "custom_params.dd_selector must be one of "
                         "['spec_host', 'oracle', 'recency'] on this server, got 'quest_device'")]:  # fmt: skip
        with pytest.raises(ValueError) as e:
            request_overrides(bad, sel, p.request_top_k_max)
        assert needle in str(e.value)


def test_the_runtime_holds_a_request_to_the_presets_top_k_cap():
    """The scheduler's runtime holds the same cap as the tokenizer manager, which refuses such a
    request first (HTTP 400): one over it reaching the runtime anyway is refused there too."""
    rt, pool, alloc, r2t, req, tree, *_ = setup(params(request_max_top_k=16))
    req.sampling_params = SimpleNamespace(custom_params={"dd_top_k": 17}, max_new_tokens=8)
    with pytest.raises(ValueError, match=r"dd_top_k must be an integer in \[1, 16\], got 17"):
        rt.after_extend(SimpleNamespace(reqs=[req]), tree)
    assert rt.requests == {}
    req.sampling_params = SimpleNamespace(custom_params={"dd_top_k": 16}, max_new_tokens=8)
    rt.after_extend(SimpleNamespace(reqs=[req]), tree)
    assert rt.requests["r1"].choice.top_k == 16


def test_overrides_reach_the_request_state():
    rt, pool, alloc, r2t, req, tree, *_ = setup()
    req.sampling_params = SimpleNamespace(custom_params={"dd_top_k": 17})
    rt.after_extend(SimpleNamespace(reqs=[req]), tree)
    st = rt.requests["r1"]
    assert st.choice.top_k == 17 and st.choice.selector == "oracle"


def test_dd_sparse_false_keeps_a_long_request_dense_with_its_kv_untouched():
    rt, pool, alloc, r2t, req, tree, ok, _ = setup()
    row = r2t[2, :100].clone()
    req.sampling_params = SimpleNamespace(custom_params={"dd_sparse": False})
    rt.after_extend(SimpleNamespace(reqs=[req]), tree)
    st = rt.requests["r1"]
    assert st.path.state is PathState.DENSE and st.path.history == [PathState.DENSE]
    assert rt.host.used_bytes == 0 and torch.equal(r2t[2, :100], row) and rt.sparse_request(2) is None
    for _ in range(3):  # it never leaves the dense path as it grows
        rt.after_decode(SimpleNamespace(reqs=[req]), tree)
    assert st.path.state is PathState.DENSE


def test_a_request_finished_in_prefill_still_records_its_path():
    seen = []
    rt, pool, alloc, r2t, req, tree, *_ = setup()
    rt.on_transition = lambda a, b: seen.append((a.value, b.value))
    req.finished = lambda: True
    rt.on_release(req)  # SGLang released it inside process_batch_result; nothing was tracked yet
    rt.after_extend(SimpleNamespace(reqs=[req]), tree)
    assert seen == [("PREFILL_FULL", "FINISHED")] and not rt.requests


def test_a_tracked_request_released_in_prefill_is_not_counted_twice():
    seen = []
    rt, pool, alloc, r2t, req, tree, *_ = setup()
    rt.on_transition = lambda a, b: seen.append((a.value, b.value))
    req.output_ids = []  # a middle chunk: tracked, not offloaded
    rt.after_extend(SimpleNamespace(reqs=[req]), tree)
    req.finished = lambda: True  # aborted at its last chunk
    rt.on_release(req)
    rt.after_extend(SimpleNamespace(reqs=[req]), tree)
    assert seen == [("PREFILL_FULL", "FINISHED")]


def test_offload_is_retried_only_when_the_host_tier_has_room_again():
    p = params(host_tier_bytes=(10 + 1) * 8 * PER_TOKEN, min_sparse_len=50)  # 80 tokens: too small for 100
    rt, pool, alloc, r2t, req, tree, *_ = setup(p)
    seen = []
    rt.on_transition = lambda a, b: seen.append((a.value, b.value))
    rt.after_extend(SimpleNamespace(reqs=[req]), tree)
    for _ in range(5):  # dense decode steps: SGLang's own slots, the context keeps growing
        r2t[2, req.kv.kv_committed_len] = alloc.alloc(1).int()
        req.kv.kv_committed_len += 1
        rt.after_decode(SimpleNamespace(reqs=[req]), tree)
    assert rt.requests["r1"].path.state is PathState.DENSE
    assert seen == [("PREFILL_FULL", "DENSE")]  # no retry per decode step while nothing was freed


def test_identical_finished_requests_keep_one_host_entry():
    rt, pool, alloc, r2t, req, tree, *_ = setup()
    rt.after_extend(SimpleNamespace(reqs=[req]), tree)
    rt.free_request_slots(req.kv, [(0, 100)])
    rt.on_release(req)
    used = rt.host.used_bytes
    # The same prompt again (another row), released: the host keeps one copy.
    req2 = SimpleNamespace(**{**vars(req), "rid": "r2", "output_ids": [7], "lock": "lock-r2"})
    req2.kv = SimpleNamespace(**{**vars(req.kv), "req_pool_idx": 3, "cache_protected_len": 100})
    r2t[3, :100] = r2t[2, :100]
    r2t[3, :100] = alloc.alloc(100).int()
    rt.after_extend(SimpleNamespace(reqs=[req2]), tree)
    rt.free_request_slots(req2.kv, [(0, 100)])
    rt.on_release(req2)
    assert len(rt.entries) == 1 and rt.host.used_bytes == used


def test_a_request_larger_than_the_whole_tier_evicts_no_prefix_entry():
    """Eviction only when it can make room: a finished entry survives a request that could never fit."""
    p = params(host_tier_bytes=(14 + 1) * 8 * PER_TOKEN)  # 14 usable pages of 8: 112 tokens
    rt, pool, alloc, r2t, req, tree, *_ = setup(p, prompt=60, tree_owned=0)
    rt.after_extend(SimpleNamespace(reqs=[req]), tree)
    rt.free_request_slots(req.kv, [(0, 60)])
    rt.on_release(req)
    assert len(rt.entries) == 1
    assert rt.prefixes.alloc(120) is None  # 15 pages > 14 usable
    assert len(rt.entries) == 1 and rt.host.available_size() == (14 - 8) * 8


def full_pool_with_the_prompt_in_the_tree(holders=1):
    """The whole 100-token prompt tree-owned (as after SGLang's last prefill chunk) and 5 free slots left."""
    rt, pool, alloc, r2t, req, _, ok, ov = setup(tree_owned=100)
    tree = PromptTree(r2t[2, :100].long(), holders=holders)
    req.lock = SimpleNamespace(node="prompt-node")
    alloc.alloc(alloc.available_size() - 5)  # another request's KV
    return rt, pool, alloc, r2t, req, tree, ok, ov


def test_a_full_pool_unpins_the_prompt_and_fills_the_resident_set_from_the_host_tier():
    """Two long prompts prefilled in one batch can leave fewer free slots than the resident set (23
    here, 5 free): the request drops its tree lock, the tree evicts the prompt's tail, and the fresh
    slots (the evicted ones among them) are filled from the host tier, bit for bit."""
    rt, pool, alloc, r2t, req, tree, ok, ov = full_pool_with_the_prompt_in_the_tree()
    unpins = []
    rt.on_unpin = lambda: unpins.append(1)
    row0 = r2t[2, :100].long().clone()
    rt.after_extend(SimpleNamespace(reqs=[req]), tree)
    assert unpins == [1]  # dd_offload_unpinned_total
    st = rt.requests["r1"]
    assert st.path.state is PathState.DECODE_SPARSE
    resident = [*st.keep_pos.tolist(), *range(st.win_start, 100)]
    assert len(resident) == 23 and st.win_start == 84
    assert len(tree.evicted) == 18 and len(tree.unlocked) == 1  # only what the 23 slots needed
    row = r2t[2, :100].long()
    assert set(row[resident].tolist()) & set(tree.evicted)  # evicted slots were reused ...
    for p in range(100):
        if p in resident:
            for layer in range(LAYERS):  # ... and hold the right K/V
                assert torch.equal(pool.k_buffer[layer][row[p]], ok[layer][row0[p]])
                assert torch.equal(pool.v_buffer[layer][row[p]], ov[layer][row0[p]])
        else:
            assert row[p] == 0
    assert alloc.available_size() == 0  # 5 free + 18 evicted = the 23 resident slots
    assert req.lock is None and tree.locked_nodes == [] and req.kv.cache_protected_len == 0
    assert not set(row[resident].tolist()) & set(tree.slots)  # no slot shared with the tree


def test_a_full_pool_with_a_shared_prompt_stays_dense_and_keeps_its_lock():
    """Another request pins the same prompt: nothing is evictable, the request keeps its KV and a lock."""
    rt, pool, alloc, r2t, req, tree, *_ = full_pool_with_the_prompt_in_the_tree(holders=2)
    unpins, seen = [], []
    rt.on_unpin = lambda: unpins.append(1)
    rt.on_transition = lambda a, b: seen.append((a.value, b.value))
    row0 = r2t[2].clone()
    rt.after_extend(SimpleNamespace(reqs=[req]), tree)
    assert unpins == []
    assert rt.requests["r1"].path.state is PathState.DENSE
    assert torch.equal(r2t[2], row0) and alloc.available_size() == 5 and tree.evicted == []
    assert tree.locked_nodes == ["prompt-node"] and req.lock.node == "prompt-node" and tree.holders == 2
    assert rt.host.used_bytes == 0 and not req.skip_radix_cache_insert
    # Dense decode steps do not retry the offload (each try copies the whole context to the host
    # tier) while the pool has no more free slots than at the failure ...
    del seen[:]
    for _ in range(3):
        r2t[2, req.kv.kv_committed_len] = alloc.alloc(1).int()
        req.kv.kv_committed_len += 1
        rt.after_decode(SimpleNamespace(reqs=[req]), tree)
    assert seen == [] and rt.requests["r1"].path.state is PathState.DENSE
    # ... and do once another request's slots come back.
    alloc.free(torch.arange(101, 201))  # 100 of the other request's slots (the prompt holds 1-100)
    r2t[2, req.kv.kv_committed_len] = alloc.alloc(1).int()
    req.kv.kv_committed_len += 1
    rt.after_decode(SimpleNamespace(reqs=[req]), tree)
    assert seen == [("DENSE", "PREFILL_FULL"), ("PREFILL_FULL", "OFFLOADING"), ("OFFLOADING", "DECODE_SPARSE")]


def test_decode_growth_bound_is_the_resident_bound_minus_what_a_sparse_request_holds():
    """What SGLang's admission may reserve for a running sparse request (device slots it can still add)."""
    rt, pool, alloc, r2t, req, tree, *_ = setup()
    req.sampling_params = SimpleNamespace(max_new_tokens=1024)
    assert rt.decode_growth_bound("r1") is None  # not admitted yet
    rt.after_extend(SimpleNamespace(reqs=[req]), tree)
    st = rt.requests["r1"]
    bound = rt.params.resident_bound  # 4 + 3 + 16 + 8 = 31
    assert rt.decode_growth_bound("r1") == bound - st.device_tokens(100) == 31 - 23
    decode_steps(rt, alloc, pool, r2t, req, tree, 5)
    assert rt.decode_growth_bound("r1") == 31 - st.device_tokens(req.kv.kv_committed_len) == 31 - 23  # window slid
    # The host tier (2,000 tokens, 112 used) cannot take 4,096 - 6 more tokens: the window could
    # stop sliding, so SGLang's own estimate stands.
    req.sampling_params.max_new_tokens = 4096
    assert rt.decode_growth_bound("r1") is None
    req.sampling_params.max_new_tokens = None
    assert rt.decode_growth_bound("r1") is None


def test_a_dense_request_keeps_sglangs_admission_estimate():
    rt, pool, alloc, r2t, req, tree, *_ = setup(params(min_sparse_len=500))
    req.sampling_params = SimpleNamespace(max_new_tokens=64)
    rt.after_extend(SimpleNamespace(reqs=[req]), tree)
    assert rt.requests["r1"].path.state is PathState.DENSE
    assert rt.decode_growth_bound("r1") is None


def test_admission_hook_caps_only_sparse_requests():
    """patches/managers_schedule_policy.py: min(SGLang's offset, the bound); SGLang's offset otherwise."""
    from patches.managers_schedule_policy import PrefillAdder__get_running_request_total_token_offset as hook

    rt, pool, alloc, r2t, req, tree, *_ = setup()
    req.sampling_params = SimpleNamespace(max_new_tokens=512)
    rt.after_extend(SimpleNamespace(reqs=[req]), tree)
    other = SimpleNamespace(rid="dense-one")
    sglang = lambda adder, r: 512 * 0.7  # noqa: E731 - SGLang's estimate, max_new x new_token_ratio
    adder = SimpleNamespace(tree_cache=SimpleNamespace(runtime=rt))  # the dualdecoder radix cache holds it
    assert hook(sglang, adder, req) == 8  # 31 - 23
    assert hook(sglang, adder, other) == 512 * 0.7
    assert hook(lambda adder, r: 5, adder, req) == 5  # never more than SGLang's own
    plain = SimpleNamespace(tree_cache=SimpleNamespace())  # another radix cache: no dualdecoder runtime
    assert hook(sglang, plain, req) == 512 * 0.7


def test_admission_reserves_only_the_resident_bound_for_a_request_that_will_go_sparse():
    """patches/managers_schedule_policy.py's second hook: the total a new request must fit shrinks by
    SGLang's generation reservation minus the resident bound, for long requests only."""
    from patches.managers_schedule_policy import PrefillAdder__check_prefill_budget as hook

    rt, *_ = setup()  # min_sparse_len 50, resident bound 31, host tier 2,000 tokens

    def req(n, max_new=512, custom=None):
        return SimpleNamespace(origin_input_ids=list(range(n)), output_ids=[],
                               sampling_params=SimpleNamespace(max_new_tokens=max_new, custom_params=custom))  # fmt: skip

    assert rt.admission_new_tokens(req(100), 512) == 31
    assert rt.admission_new_tokens(req(100), 20) == 20  # never more than SGLang's
    assert rt.admission_new_tokens(req(40), 512) is None  # stays dense: too short
    assert rt.admission_new_tokens(req(100, custom={"dd_sparse": False}), 512) is None
    assert rt.admission_new_tokens(req(100, custom={"dd_top_k": -1}), 512) is None  # SGLang rejects it
    assert rt.admission_new_tokens(req(1500), 512) is None  # the host tier cannot take 1,500 + 512
    seen = {}

    def sglang(adder, r, *, extend_input_len, total_tokens, swa_host_hit_length, chunk_limit):
        seen["total"] = total_tokens
        return True, chunk_limit

    kw = dict(extend_input_len=100, swa_host_hit_length=0, chunk_limit=None)
    adder = SimpleNamespace(tree_cache=SimpleNamespace(runtime=rt))  # the dualdecoder radix cache holds it
    hook(sglang, adder, req(100), total_tokens=100 + 512 + 1, **kw)
    assert seen["total"] == 100 + 31 + 1
    hook(sglang, adder, req(40), total_tokens=40 + 512 + 1, **kw)
    assert seen["total"] == 40 + 512 + 1
    hook(sglang, SimpleNamespace(tree_cache=None), req(100), total_tokens=613, **kw)
    assert seen["total"] == 613


def chunked_prefill_through_the_host(prompt=500, chunk=150, abort_after=None):
    """A prompt longer than the 400-slot pool, prefilled in ``chunk``-token chunks as SGLang runs them
    (slots allocated, K/V written, committed, then ``after_extend``); the K/V written per position is
    kept to check the host tier against. ``abort_after``: stop after that many chunks."""
    p = params()
    pool = FakePool()
    alloc = FakeAllocator(pool)
    r2t = torch.zeros(4, 1024, dtype=torch.int32)
    rt = SparseRuntime(p, pool, alloc, r2t)
    assert rt.pool_input_limit == SLOTS - 6
    kv = SimpleNamespace(req_pool_idx=2, cache_protected_len=0, kv_committed_len=0, kv_allocated_len=0, holds_kv=True)
    req = SimpleNamespace(rid="long", origin_input_ids=list(range(prompt)), output_ids=[], kv=kv, lock=None,
                          skip_radix_cache_insert=False, extra_key=None, cache_salt=None, finished=lambda: False)  # fmt: skip
    assert rt.over_pool(req)
    written_k, written_v, tree = {}, {}, FakeTree()
    for n, start in enumerate(range(0, prompt, chunk)):
        if abort_after is not None and n == abort_after:
            break
        end = min(start + chunk, prompt)
        slots = alloc.alloc(end - start)
        assert slots is not None, "the pool must hold a chunk beside the sinks"
        r2t[2, start:end] = slots.int()
        for pos, slot in zip(range(start, end), slots.tolist(), strict=True):
            written_k[pos] = [torch.randn(HKV, D) for _ in range(LAYERS)]
            written_v[pos] = [torch.randn(HKV, D) for _ in range(LAYERS)]
            for layer in range(LAYERS):
                pool.k_buffer[layer][slot] = written_k[pos][layer]
                pool.v_buffer[layer][slot] = written_v[pos][layer]
        kv.kv_committed_len = kv.kv_allocated_len = end
        if end == prompt:
            req.output_ids.append(7)  # the last chunk samples the first token
        rt.after_extend(SimpleNamespace(reqs=[req]), tree)
        st = rt.requests["long"]
        if end < prompt:  # a middle chunk: everything but the 4 sinks is on the host tier only
            assert st.path.state is PathState.PREFILL_FULL and st.released and st.host_len == end
            assert SLOTS - alloc.available_size() == 4 and st.device_tokens(end) == 4
            assert (r2t[2, 4:end] == 0).all() and (r2t[2, :4] != 0).all() and req.skip_radix_cache_insert
    return rt, pool, alloc, r2t, req, written_k, written_v


def test_a_prompt_longer_than_the_pool_is_prefilled_through_the_host_tier_exactly():
    """Each middle chunk moves to the host tier (bit for bit) and frees its slots, so the device never
    holds more than a chunk plus the sinks; after the last chunk the request decodes sparsely from the
    usual resident set (sinks, the n_keep largest key norms read from the host tier, the window)."""
    rt, pool, alloc, r2t, req, wk, wv = chunked_prefill_through_the_host()
    st = rt.requests["long"]
    assert st.path.state is PathState.DECODE_SPARSE and st.host_len == 500
    for layer in range(LAYERS):
        hk, hv = rt.host.gather(layer, st.host_slots[:500])
        assert torch.equal(hk, torch.stack([wk[p][layer] for p in range(500)]))
        assert torch.equal(hv, torch.stack([wv[p][layer] for p in range(500)]))
    norms = sum(torch.stack([wk[p][layer] for p in range(4, 484)]).norm(dim=-1).sum(-1) for layer in range(LAYERS))
    keep = sorted((norms.topk(3).indices + 4).tolist())
    assert st.keep_pos.tolist() == [0, 1, 2, 3, *keep] and st.win_start == 484
    resident = [0, 1, 2, 3, *keep, *range(484, 500)]
    row = r2t[2, :500].long()
    for p in range(500):
        if p in resident:
            for layer in range(LAYERS):
                assert torch.equal(pool.k_buffer[layer][row[p]], wk[p][layer])
                assert torch.equal(pool.v_buffer[layer][row[p]], wv[p][layer])
        else:
            assert row[p] == 0
    assert SLOTS - alloc.available_size() == len(resident)
    assert rt.free_request_slots(req.kv, [(0, 500)])
    rt.on_release(req)
    assert alloc.available_size() == SLOTS


def test_a_prompt_aborted_during_its_prefill_through_the_host_tier_leaves_both_tiers_at_baseline():
    rt, pool, alloc, r2t, req, *_ = chunked_prefill_through_the_host(abort_after=2)
    assert rt.host.used_bytes > 0
    assert rt.free_request_slots(req.kv, [(0, req.kv.kv_committed_len)])  # SGLang's release_kv_cache
    rt.on_release(req)
    assert alloc.available_size() == SLOTS and rt.host.used_bytes == 0 and not rt.entries


def test_the_admission_of_a_prompt_longer_than_the_pool_is_one_chunk_at_a_time():
    """The next chunk is what the pool's remaining tokens hold beside the resident bound (whole pages),
    at most SGLang's chunk limit; None (wait) when under a page or the host tier cannot hold the prompt."""
    rt, *_ = setup()
    req = SimpleNamespace(origin_input_ids=list(range(1000)), kv=SimpleNamespace(req_pool_idx=None))
    bound = rt.params.resident_bound  # 4 + 3 + 16 + 8
    assert rt.over_pool(req) and not rt.over_pool(SimpleNamespace(origin_input_ids=list(range(393))))
    assert rt.over_pool_chunk(req, 1000, 4096, 400) == (400 - bound - 8) // 8 * 8
    assert rt.over_pool_chunk(req, 1000, 64, 400) == 64
    assert rt.over_pool_chunk(req, 30, 64, 400) == 30  # the last piece, whatever its size
    assert rt.over_pool_chunk(req, 1000, 4096, bound + 8 + 7) is None
    big = SimpleNamespace(origin_input_ids=list(range(2001)), kv=SimpleNamespace(req_pool_idx=None))
    assert rt.over_pool_chunk(big, 2001, 64, 400) is None  # the 2,000-token host tier cannot hold it


def test_a_prompt_past_the_pool_goes_through_the_host_tier_even_when_it_asked_to_stay_dense():
    """The tokenizer refuses ``dd_sparse: false`` past the pool it knows; if one reaches the scheduler
    anyway (a pool SGLang profiled smaller than the flag), its chunks still leave the device."""
    p = params()
    pool = FakePool()
    alloc = FakeAllocator(pool)
    r2t = torch.zeros(4, 1024, dtype=torch.int32)
    rt = SparseRuntime(p, pool, alloc, r2t)
    kv = SimpleNamespace(req_pool_idx=2, cache_protected_len=0, kv_committed_len=150, kv_allocated_len=150, holds_kv=True)
    req = SimpleNamespace(rid="d", origin_input_ids=list(range(500)), output_ids=[], kv=kv, lock=None,
                          skip_radix_cache_insert=False, extra_key=None, cache_salt=None, finished=lambda: False,
                          sampling_params=SimpleNamespace(custom_params={"dd_sparse": False}))  # fmt: skip
    r2t[2, :150] = alloc.alloc(150).int()
    rt.after_extend(SimpleNamespace(reqs=[req]), FakeTree())
    st = rt.requests["d"]
    assert st.path.history == [PathState.DENSE, PathState.PREFILL_FULL] and st.host_len == 150
    assert SLOTS - alloc.available_size() == 4


def test_trace_override_needs_the_servers_trace_directory(monkeypatch):
    """``dd_trace``: a bool, and true only where the server was started with ``DD_SGLANG_TRACE_DIR``
    (the refusal names the variable); false is always accepted."""
    from dd_sglang.kvcache.params import TRACE_DIR_ENV, request_overrides

    sel = ("host_sync",)
    monkeypatch.delenv(TRACE_DIR_ENV, raising=False)
    with pytest.raises(ValueError, match=f"custom_params.dd_trace: this server writes no attention traces .*{TRACE_DIR_ENV}"):
        request_overrides({"dd_trace": True}, sel)
    assert request_overrides({"dd_trace": False}, sel) == {"trace": False}
    monkeypatch.setenv(TRACE_DIR_ENV, "/tmp/traces")
    assert request_overrides({"dd_trace": True, "dd_top_k": 64}, sel) == {"trace": True, "top_k": 64}
    with pytest.raises(ValueError, match="custom_params.dd_trace must be true or false, got 1"):
        request_overrides({"dd_trace": 1}, sel)
