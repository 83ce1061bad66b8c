"""Data- and tensor-parallel rank logic without a multi-rank SGLang run.

SGLang 0.5.23 on this CPU-only machine cannot run ``--tp-size 2`` with the
embedded model (see README, "Scaling out"), so the per-rank behaviour is
checked here with the rank-local shapes a TP rank has:

* the host tier of a TP rank holds exactly its KV heads, byte for byte, and
  the ranks' host tiers together equal one unsharded host tier;
* critical sets chosen per KV head on a rank's shard (its query heads and KV
  heads) equal that head's set chosen on the whole model, for every selector;
* the host-tier budget is split over ``dp_size x tp_size`` processes;
* request-level metric events are counted once per replica (TP rank 0);
* the sidecar labels ``dd_`` series by DP rank and merges TP shards within a rank.
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from dd_sglang.kvcache.host_pool import HostSparseKVPool
from dd_sglang.kvcache.ranks import RankInfo, current_ranks, host_tier_share
from dd_sglang.metrics.backend_events import MetricsEvents
from dd_sglang.metrics.sidecar import create_app
from dd_sglang.prefetch.index import KeyBlockIndex, QuantKeyIndex
from dd_sglang.prefetch.scoring import row_blocks
from dd_sglang.prefetch.selectors import SELECTORS, make_selector
from tests.test_sparse_runtime import FakeAllocator, FakeTree
from tests.test_sparse_runtime import params as sparse_params

# SmolLM2-135M's attention geometry: 9 query heads, 3 KV heads (GQA groups of 3).
HQ, HKV, D, LAYERS = 9, 3, 64, 2


# ---------------------------------------------------------------- RankInfo and the host-tier split
def test_rank_info_validates_each_field():
    assert RankInfo(1, 2, 2, 3, 2).processes == 6
    assert RankInfo(0, 1, 1, 2, 1).primary is False
    with pytest.raises(ValueError, match="dp_rank must be in \\[0, 2\\)"):
        RankInfo(dp_rank=2, dp_size=2)
    with pytest.raises(ValueError, match="tp_size must be >= 1"):
        RankInfo(tp_size=0)
    with pytest.raises(ValueError, match="attn_tp_rank"):
        RankInfo(tp_size=2, attn_tp_rank=2)


def test_current_ranks_outside_a_scheduler_is_rank_zero():
    assert current_ranks() == RankInfo()


@pytest.mark.parametrize(("dp", "tp", "expected"), [(1, 1, 6000), (2, 1, 3000), (2, 3, 1000), (4, 2, 750)])
def test_host_tier_budget_is_split_over_every_process(dp, tp, expected):
    assert host_tier_share(6000, RankInfo(dp_size=dp, tp_size=tp)) == expected


def test_host_tier_split_keeps_token_capacity_per_replica():
    """A TP rank's tokens cost 1/tp of the bytes, so a replica holds the same tokens for any tp."""
    per_token_full = LAYERS * 2 * HKV * D * 2  # bf16
    total = 600 * 64 * per_token_full
    caps = []
    for tp in (1, 3):
        pool = HostSparseKVPool(
            num_layers=LAYERS, num_kv_heads=HKV // tp, head_dim=D, dtype=torch.bfloat16,
            capacity_bytes=host_tier_share(total, RankInfo(dp_size=2, tp_size=tp)), page_size=64,
        )  # fmt: skip
        caps.append(pool.available_size())
    assert caps[0] == caps[1] == (300 - 1) * 64  # half the tokens per DP replica, less the padding page


def test_host_tier_bytes_error_names_the_field():
    with pytest.raises(ValueError, match="sparse.host_tier_bytes"):
        host_tier_share(0, RankInfo())


# ---------------------------------------------------------------- TP: host tier per rank
class ShardPool:
    """A device pool holding KV heads ``heads`` of a full pool (what TP rank r's pool holds)."""

    def __init__(self, full, heads: slice):
        self.k_buffer = [k[:, heads].contiguous() for k in full.k_buffer]
        self.v_buffer = [v[:, heads].contiguous() for v in full.v_buffer]
        self.head_num = self.k_buffer[0].shape[1]
        self.head_dim = self.v_head_dim = full.head_dim
        self.layer_num = full.layer_num


def _prefilled(pool, prompt=100, tree_owned=60):
    from dd_sglang.kvcache.sparse_runtime import SparseRuntime

    alloc = FakeAllocator(pool)
    r2t = torch.zeros(4, 1024, dtype=torch.int32)
    heads = pool.head_num
    p = sparse_params(host_tier_bytes=2000 * LAYERS * 2 * heads * 4 * 4)  # same token capacity on every rank
    rt = SparseRuntime(p, pool, alloc, r2t)
    slots = torch.cat([alloc.alloc(tree_owned), alloc.alloc(prompt - tree_owned)])
    r2t[2, :prompt] = slots.int()
    kv = SimpleNamespace(req_pool_idx=2, cache_protected_len=tree_owned, kv_committed_len=prompt,
                         kv_allocated_len=prompt, holds_kv=True)  # fmt: skip
    req = SimpleNamespace(rid="r1", origin_input_ids=list(range(1000, 1000 + prompt)), output_ids=[7], kv=kv,
                          lock="lock", skip_radix_cache_insert=False, extra_key=None, cache_salt=None,
                          finished=lambda: False)  # fmt: skip
    rt.after_extend(SimpleNamespace(reqs=[req]), FakeTree())
    return rt, slots.long()


def test_tp_ranks_host_tiers_hold_their_own_kv_heads():
    """Three TP ranks (one KV head each) of the same request: each host tier holds its head's K/V, the
    same tokens and resident positions on every rank, and together they equal the unsharded host tier."""
    from tests.test_sparse_runtime import FakePool

    full = FakePool()  # 3 KV heads, head_dim 4, float32
    n_keep0 = sparse_params().n_keep
    ref_rt, slots = _prefilled(full)
    ref = ref_rt.requests["r1"]
    for rank in range(3):
        shard = ShardPool(full, slice(rank, rank + 1))
        rt, _ = _prefilled(shard)
        st = rt.requests["r1"]
        assert rt.host.head_num == 1
        assert rt.host.get_size_per_token() * 3 == ref_rt.host.get_size_per_token()
        assert st.host_len == ref.host_len == 100
        assert st.win_start == ref.win_start
        for layer in range(LAYERS):
            hk, hv = rt.host.gather(layer, st.host_slots[:100])
            assert torch.equal(hk[:, 0], full.k_buffer[layer][slots, rank])
            assert torch.equal(hv[:, 0], full.v_buffer[layer][slots, rank])
            rk, _ = ref_rt.host.gather(layer, ref.host_slots[:100])
            assert torch.equal(hk[:, 0], rk[:, rank])
        # Sinks and window are rank-independent; n_keep ranks by the rank's own key norms (it is
        # 0 in the presets: with n_keep > 0 TP ranks would keep different tokens).
        assert st.keep_pos[:4].tolist() == [0, 1, 2, 3]
        assert st.keep_pos.numel() == 4 + n_keep0


# ---------------------------------------------------------------- TP: critical sets per KV head
@pytest.mark.parametrize("name", sorted(SELECTORS))
@pytest.mark.parametrize("tp", [1, 3])
def test_critical_sets_on_a_tp_shard_equal_the_full_models_per_kv_head(name, tp):
    """Rank r of tp holds query heads [r*Hq/tp, (r+1)*Hq/tp) and KV heads [r*Hkv/tp, ...) of every
    token, and its own block index over them: its selection for local KV head h is the full model's
    selection for KV head r*Hkv/tp + h."""
    g = torch.Generator().manual_seed(7)
    d, page, lens, his, k = 16, 64, [600, 300], [560, 260], 24
    need = [-(-n // page) for n in lens]
    n_pages = sum(need) + 2
    host_k = torch.randn(LAYERS, n_pages * page, HKV, d, generator=g)
    order = torch.randperm(n_pages, generator=g).tolist()
    slots, start = [], 0
    for n in need:  # shuffled whole pages, as HostSparseKVPool allocates
        slots.append(torch.cat([torch.arange(p * page, (p + 1) * page) for p in order[start : start + n]]))
        start += n
    rows = row_blocks(slots, [4, 4], his, [torch.arange(4), torch.arange(4)])
    q = torch.randn(len(lens), HQ, d, generator=g)

    def select(q_, host_k_):
        index = (QuantKeyIndex if SELECTORS[name].index_location == "host" else KeyBlockIndex)(host_k_)
        for sl, n in zip(slots, lens, strict=True):
            index.update(sl, 0, n)
        return make_selector(name).select(q_, rows, host_k_[1], k, d**-0.5, index, 1)

    full_pos, full_slots = select(q, host_k)
    hq, hkv = HQ // tp, HKV // tp
    for rank in range(tp):
        pos, sl = select(
            q[:, rank * hq : (rank + 1) * hq].contiguous(),
            host_k[:, :, rank * hkv : (rank + 1) * hkv].contiguous(),
        )
        assert pos.shape == (len(lens), hkv, k)
        for r in range(len(lens)):
            for h in range(hkv):
                assert set(pos[r, h].tolist()) == set(full_pos[r, rank * hkv + h].tolist()), (
                    name,
                    rank,
                    r,
                    h,
                )
                assert set(sl[r, h].tolist()) == set(full_slots[r, rank * hkv + h].tolist())


# ---------------------------------------------------------------- metrics
class _Counter:
    def __init__(self):
        self.values: dict[tuple, float] = {}

    def labels(self, **kw):
        key = tuple(sorted(kw.items()))
        parent = self

        class _Child:
            def inc(self, n=1.0):
                parent.values[key] = parent.values.get(key, 0.0) + n

            def observe(self, v):
                parent.values[key] = parent.values.get(key, 0.0) + 1

        return _Child()

    def inc(self, n=1.0):
        self.values[()] = self.values.get((), 0.0) + n

    def observe(self, v):
        self.values[()] = self.values.get((), 0.0) + 1


def _fake_metrics():
    names = ["SPARSE_DECODE_ROWS", "PREFETCH_COLD", "PREFETCH_HITS", "PREFETCH_LOOKUPS", "PREFETCH_MASS_PREFETCHED",
             "PREFETCH_MASS_TOP_K", "PREFETCH_LAYER_HIT_RATE", "SPEC_PROPOSED", "SPEC_ACCEPTED", "PREFETCH_MISSES",
             "PREFETCH_REPAIRED_TOKENS", "TRANSFER_BYTES", "STEP_PHASE_SECONDS", "DECODE_STEPS",
             "DECODE_STEP_SECONDS"]  # fmt: skip
    return SimpleNamespace(**{n: _Counter() for n in names})


def _replay(events: MetricsEvents) -> None:
    events.sparse_rows(30)
    events.cold("spec_host", 2)
    events.prefetch("spec_host", "dual_token", 3, hits=200, lookups=256, mass_prefetched=0.9, mass_top_k=1.0)
    events.speculation("dual_token", accepted=True)
    events.miss("verify", 3, repaired_tokens=5)
    events.copied(4096)
    events.phase("select", 0.25)
    events.step("sparse", 0.5)


def test_request_level_events_count_once_per_replica():
    """Two TP ranks replay the same step: per-request counts from rank 0 only; per-KV-head sums from both."""
    m = _fake_metrics()
    _replay(MetricsEvents(primary=True, metrics=m))
    _replay(MetricsEvents(primary=False, metrics=m))
    assert m.SPARSE_DECODE_ROWS.values == {(): 30}
    assert m.PREFETCH_COLD.values == {(("selector", "spec_host"),): 2}
    assert m.SPEC_PROPOSED.values == {(("speculator", "dual_token"),): 1}
    assert m.SPEC_ACCEPTED.values == {(("speculator", "dual_token"),): 1}
    assert m.PREFETCH_MISSES.values == {(("policy", "verify"),): 3}
    assert m.STEP_PHASE_SECONDS.values == {(("phase", "select"),): 0.25}
    assert m.DECODE_STEPS.values == {(("kind", "sparse"),): 1}
    assert m.DECODE_STEP_SECONDS.values == {(("kind", "sparse"),): 0.5}
    lab = (("selector", "spec_host"), ("speculator", "dual_token"))
    assert m.PREFETCH_HITS.values == {lab: 400} and m.PREFETCH_LOOKUPS.values == {lab: 512}
    assert m.PREFETCH_REPAIRED_TOKENS.values == {(): 10}
    assert m.TRANSFER_BYTES.values == {(): 8192}


WRITER = """
import sys
from dd_sglang.metrics import definitions as m
from dd_sglang.metrics.ranks import register_process
dp, tp, used = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
if dp >= 0:
    register_process(sys.argv[4], dp, tp)
m.HOST_TIER_USED_BYTES.set(used)
m.SPARSE_REQUEST_DEVICE_TOKENS_MAX.set(used // 1000)
if tp == 0:
    m.DUALPATH_REQUESTS.labels(state="DECODE_SPARSE").set(dp + 1)
    m.HOST_TIER_REBUILT_TOKENS.inc(10 * (dp + 1))
m.TRANSFER_COPY_SECONDS.observe(0.002)
"""


def test_sidecar_labels_dd_series_by_dp_rank_and_merges_tp_shards(tmp_path):
    """Processes (dp, tp): (0, 0), (0, 1), (1, 0), (1, 1) and one that registered no rank."""
    writers = [(0, 0, 1000), (0, 1, 3000), (1, 0, 5000), (1, 1, 7000), (-1, 0, 11000)]
    for dp, tp, used in writers:
        subprocess.run(
            [sys.executable, "-c", WRITER, str(dp), str(tp), str(used), str(tmp_path)],
            env={"PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PATH": ""},
            check=True,
        )
    client = TestClient(create_app(sglang_url="http://127.0.0.1:9", multiproc_dir=str(tmp_path)))
    samples = {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(client.get("/metrics").text)
        for s in family.samples
    }

    def value(name, dp_rank, **labels):
        return samples[(name, frozenset({**labels, "dp_rank": str(dp_rank)}.items()))]

    # Byte gauges: livesum over a rank's TP shards; the unregistered process counts as rank 0.
    assert value("dd_host_tier_used_bytes", 0) == 1000 + 3000 + 11000
    assert value("dd_host_tier_used_bytes", 1) == 5000 + 7000
    assert value("dd_sparse_request_device_tokens_max", 0) == 11  # livemax
    assert value("dd_sparse_request_device_tokens_max", 1) == 7
    assert value("dd_dualpath_requests", 0, state="DECODE_SPARSE") == 1
    assert value("dd_dualpath_requests", 1, state="DECODE_SPARSE") == 2
    assert value("dd_host_tier_rebuilt_tokens_total", 0) == 10
    assert value("dd_host_tier_rebuilt_tokens_total", 1) == 20
    assert value("dd_transfer_copy_seconds_count", 0) == 3
    assert value("dd_transfer_copy_seconds_bucket", 1, le="0.005") == 2
    assert value("dd_transfer_copy_seconds_bucket", 1, le="0.001") == 0
    assert not [k for k in samples if k[0].startswith("dd_") and "dp_rank" not in dict(k[1])]
    stats = client.get("/stats").json()
    assert sorted(s["value"] for s in stats["metrics"]["dd_host_tier_used_bytes"]) == [12000.0, 15000.0]
