"""The ``pressure`` path policy: the decision, the victim choice, the admission and retraction hooks.

Against the SGLang-shaped fakes of ``tests/test_sparse_runtime.py`` (real tensors, a real slot
allocator): every slot count asserted here is worked out by hand from the sizes below, not read
back from the code under test. The preset there: ``min_sparse_len`` 50, ``n_sink`` 4, ``n_keep`` 3,
``n_recent`` 16, ``page_size`` 8 (resident bound 31), a 400-slot device pool, a 2,000-token host tier.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import get_args

import pytest
import torch

from dd_sglang.config import PathPolicy, parse_config
from dd_sglang.kvcache.dualpath import PATH_CHANGE_REASONS, PATH_POLICIES, DualPath, PathState
from dd_sglang.kvcache.params import SparseParams, request_overrides
from dd_sglang.kvcache.pressure import TRIGGERS, Candidate, choose_victims
from dd_sglang.kvcache.sparse_runtime import SparseRuntime
from patches.managers_schedule_batch import ScheduleBatch_check_decode_mem as decode_mem_hook
from patches.managers_schedule_policy import PrefillAdder__check_prefill_budget as hook
from patches.managers_schedule_policy import (
    PrefillAdder__get_running_request_total_token_offset as offset_hook,
)
from tests.test_sparse_runtime import PER_TOKEN, SLOTS, FakeAllocator, FakePool, decode_steps, params

S = PathState


# ---------------------------------------------------------------------------------------------- decision
def test_always_goes_sparse_by_length_and_pressure_only_becomes_eligible():
    always = DualPath("a", 10, 50)
    pressure = DualPath("p", 10, 50, policy="pressure")
    assert not always.wants_sparse(49) and always.wants_sparse(50)
    assert not pressure.wants_sparse(50) and not pressure.wants_sparse(10**6)
    assert not pressure.may_go_sparse(49) and pressure.may_go_sparse(50)
    assert always.may_go_sparse(50)


def test_an_unknown_policy_is_refused_naming_the_field_and_values():
    with pytest.raises(ValueError, match=r"policy must be one of \['always', 'pressure'\], got 'lazy'"):
        DualPath("r", 10, 50, policy="lazy")
    with pytest.raises(ValueError, match=r"custom_params.dd_policy must be one of \['always', 'pressure'\]"):
        request_overrides({"dd_policy": "sometimes"}, ("oracle",))
    assert request_overrides({"dd_policy": "pressure"}, ("oracle",)) == {"policy": "pressure"}


def test_the_schema_the_state_machine_and_the_metrics_agree_on_names():
    from dd_sglang.metrics.definitions import PATH_CHANGE_REASONS as metric_reasons
    from dd_sglang.metrics.definitions import PRESSURE_TRIGGERS

    assert get_args(PathPolicy) == PATH_POLICIES
    assert metric_reasons == PATH_CHANGE_REASONS
    assert PRESSURE_TRIGGERS == TRIGGERS


def test_the_cpu_preset_keeps_always_and_the_key_reaches_the_runtime_params():
    from dd_sglang.config import load_config

    assert load_config().sparse.policy == "always"
    cfg = parse_config({"sparse": {"policy": "pressure"}})
    assert SparseParams.from_config(cfg).policy == "pressure"


# ---------------------------------------------------------------------------------------------- victims
def cand(rid, gain, context=100, left=10, host=16, waiting=False):
    return Candidate(rid, context, left, gain, host, waiting)


def test_victims_are_the_fewest_that_cover_the_need_largest_gain_first():
    cs = [cand("a", 100), cand("b", 300), cand("c", 250)]
    assert [c.rid for c in choose_victims(cs, 280, 1000)] == ["b"]
    assert [c.rid for c in choose_victims(cs, 500, 1000)] == ["b", "c"]
    assert [c.rid for c in choose_victims(cs, 650, 1000)] == ["b", "c", "a"]
    assert choose_victims(cs, 651, 1000) is None  # all together fall short: nobody is offloaded
    assert choose_victims(cs, 0, 1000) == []
    assert choose_victims(cs, 10, None) is None  # host room unknown
    # every: once the need is covered, all the host tier takes go too (the admission rule)
    assert [c.rid for c in choose_victims(cs, 280, 1000, every=True)] == ["b", "c", "a"]
    assert [c.rid for c in choose_victims(cs, 280, 40, every=True)] == ["b", "c"]  # 16 host slots each: "a" no longer fits
    assert choose_victims(cs, 651, 1000, every=True) is None


def test_victims_must_fit_the_host_tier_and_ties_go_to_the_longer_context():
    cs = [cand("big", 300, host=500), cand("x", 250, host=100), cand("y", 200, host=100)]
    assert [c.rid for c in choose_victims(cs, 400, 300)] == ["x", "y"]  # "big" does not fit 300 host slots
    tie = [cand("short", 50, context=60), cand("long", 50, context=90), cand("mid", 50, context=70, left=99)]
    assert [c.rid for c in choose_victims(tie, 50, 1000)] == ["long"]
    assert [c.rid for c in choose_victims(tie, 100, 1000)] == ["long", "mid"]
    assert choose_victims([cand("nothing", 0)], 1, 1000) is None


# ---------------------------------------------------------------------------------------------- runtime
def runtime(policy="pressure"):
    pool = FakePool()
    alloc = FakeAllocator(pool)
    r2t = torch.zeros(8, 1024, dtype=torch.int32)
    seen = {"changes": [], "offloads": []}
    rt = SparseRuntime(params(policy=policy), pool, alloc, r2t,
                       on_path_change=seen["changes"].append, on_pressure_offload=seen["offloads"].append)  # fmt: skip
    return rt, pool, alloc, r2t, seen


def request(alloc, r2t, row, n, rid, max_new=64, custom=None):
    """A request of ``n`` prompt tokens in ``req_to_token`` row ``row``, prefilled (first token out); every
    slot request-owned (no radix-tree prefix)."""
    slots = alloc.alloc(n)
    r2t[row, :n] = slots.int()
    kv = SimpleNamespace(req_pool_idx=row, cache_protected_len=0, kv_committed_len=n, kv_allocated_len=n,
                         holds_kv=True)  # fmt: skip
    return SimpleNamespace(rid=rid, origin_input_ids=list(range(1000 * row, 1000 * row + n)), output_ids=[7], kv=kv,
                           lock=None, skip_radix_cache_insert=False, extra_key=None, cache_salt=None,
                           finished=lambda: False,
                           sampling_params=SimpleNamespace(max_new_tokens=max_new, custom_params=custom))  # fmt: skip


def waiting_request(n, max_new):
    return SimpleNamespace(rid="w", origin_input_ids=list(range(n)), output_ids=[],
                           sampling_params=SimpleNamespace(max_new_tokens=max_new, custom_params=None))  # fmt: skip


TREE = SimpleNamespace()  # no radix tree holds anything in these tests


def test_pressure_keeps_a_long_request_dense_with_its_kv_untouched():
    rt, pool, alloc, r2t, seen = runtime()
    a = request(alloc, r2t, 2, 200, "a")
    row = r2t[2, :200].clone()
    rt.after_extend(SimpleNamespace(reqs=[a]), TREE)
    decode_steps(rt, alloc, pool, r2t, a, TREE, 3, dense=True)  # grows past min_sparse_len further: still dense
    st = rt.requests["a"]
    assert st.path.history == [S.PREFILL_FULL, S.DENSE]
    assert torch.equal(r2t[2, :200], row) and rt.host.used_bytes == 0
    assert alloc.available_size() == SLOTS - 203
    assert seen == {"changes": [], "offloads": []}
    assert rt.admission_new_tokens(a, 64) is None  # SGLang reserves its whole generation
    assert rt.admission_may_reopen([a])


def test_always_still_goes_sparse_by_length():
    rt, pool, alloc, r2t, seen = runtime("always")
    a = request(alloc, r2t, 2, 200, "a")
    rt.after_extend(SimpleNamespace(reqs=[a]), TREE)
    assert rt.requests["a"].path.state is S.DECODE_SPARSE
    assert seen == {"changes": ["length"], "offloads": []}
    assert not rt.admission_may_reopen([a])


def test_a_request_may_ask_for_pressure_on_an_always_server():
    rt, pool, alloc, r2t, seen = runtime("always")
    a = request(alloc, r2t, 2, 200, "a", custom={"dd_policy": "pressure"})
    rt.after_extend(SimpleNamespace(reqs=[a]), TREE)
    assert rt.requests["a"].path.state is S.DENSE and rt.admission_may_reopen([a])


class FakeAdder:
    """SGLang's ``PrefillAdder`` as the hook sees it: the running reservation (SGLang's formula,
    ``ignore_eos`` ratio 1, through dd's own offset hook) and a live budget (free slots less it)."""

    def __init__(self, rt, alloc, running):
        self.tree_cache = SimpleNamespace(runtime=rt)
        self.running_batch = SimpleNamespace(reqs=running)
        self.preempt_list = []
        self.alloc = alloc
        self.memory_budget = SimpleNamespace(total_offset=0)
        self.memory_budget.total_offset = sum(self._get_running_request_total_token_offset(r) for r in running)

    def _get_running_request_total_token_offset(self, r):
        return offset_hook(lambda adder, q: min(q.sampling_params.max_new_tokens - len(q.output_ids), 4096), self, r)

    @property
    def rem_total_tokens(self):
        return self.alloc.available_size() - self.memory_budget.total_offset


def budget(adder, r, *, extend_input_len, total_tokens, swa_host_hit_length, chunk_limit):
    """``PrefillBudget.check_prefill``: admit when the total is below what remains."""
    return (True, chunk_limit) if total_tokens < adder.rem_total_tokens else (False, None)


KW = dict(extend_input_len=150, swa_host_hit_length=0, chunk_limit=None)


def test_admission_offloads_a_running_dense_request_so_the_waiting_one_fits():
    rt, pool, alloc, r2t, seen = runtime()
    a = request(alloc, r2t, 2, 200, "a")  # 64 max_new, one token out: SGLang reserves 63
    rt.after_extend(SimpleNamespace(reqs=[a]), TREE)
    adder = FakeAdder(rt, alloc, [a])
    assert adder.rem_total_tokens == 400 - 200 - 63
    w = waiting_request(150, 64)
    # 150 + 64 + 8 (a page) = 222 does not fit 137. Offloading "a" frees 200 - 23 resident slots and cuts its
    # reservation from 63 to 31 - 23 = 8: 377 free, 369 left after reservations.
    assert hook(budget, adder, w, total_tokens=222, **KW) == (True, None)
    st = rt.requests["a"]
    assert st.path.history == [S.PREFILL_FULL, S.DENSE, S.PREFILL_FULL, S.OFFLOADING, S.DECODE_SPARSE]
    assert alloc.available_size() == 377
    assert adder.memory_budget.total_offset == 8
    assert seen == {"changes": ["pressure"], "offloads": ["admission"]}
    # Once pressure is met, every candidate goes, the waiting request included: it is admitted as
    # one that goes sparse right after its prefill (one offload now, its own after the prefill).
    assert rt.pressure_offloads == 1 and "w" in rt.table.pressure_marked
    assert not rt.admission_may_reopen([a])


def test_admission_admits_the_waiting_request_as_a_sparse_one_when_nothing_runs():
    rt, pool, alloc, r2t, seen = runtime()
    alloc.alloc(150)  # held elsewhere (a radix-tree entry, say)
    adder = FakeAdder(rt, alloc, [])
    w = waiting_request(150, 200)
    # 150 + 200 + 8 = 358 does not fit 250; with only the resident bound for its generation, 150 + 31 + 8 does.
    assert hook(budget, adder, w, total_tokens=358, **KW) == (True, None)
    assert rt.table.pressure_marked == {"w"} and seen["offloads"] == []
    # Its prefill done, it goes sparse at once, for pressure.
    w2 = request(alloc, r2t, 3, 150, "w", max_new=200)
    rt.after_extend(SimpleNamespace(reqs=[w2]), TREE)
    assert rt.requests["w"].path.history == [S.PREFILL_FULL, S.OFFLOADING, S.DECODE_SPARSE]
    assert seen == {"changes": ["pressure"], "offloads": ["admission"]}
    assert not rt.table.pressure_marked


def test_admission_moves_nothing_when_no_offload_can_make_the_request_fit():
    rt, pool, alloc, r2t, seen = runtime()
    short = request(alloc, r2t, 1, 40, "short")  # below min_sparse_len: never a victim
    a = request(alloc, r2t, 2, 100, "a", custom={"dd_sparse": False})  # asked to stay dense
    alloc.alloc(160)
    rt.after_extend(SimpleNamespace(reqs=[short, a]), TREE)
    adder = FakeAdder(rt, alloc, [short, a])
    before = adder.memory_budget.total_offset
    assert hook(budget, adder, waiting_request(150, 64), total_tokens=222, **KW) == (False, None)
    assert [rt.requests[r].path.state for r in ("short", "a")] == [S.DENSE, S.DENSE]
    assert alloc.available_size() == 100 and adder.memory_budget.total_offset == before
    assert seen == {"changes": [], "offloads": []} and not rt.table.pressure_marked


def test_retraction_is_avoided_by_offloading_the_largest_dense_request_only():
    rt, pool, alloc, r2t, seen = runtime()
    a = request(alloc, r2t, 2, 200, "a")
    b = request(alloc, r2t, 3, 100, "b")
    rt.after_extend(SimpleNamespace(reqs=[a, b]), TREE)
    batch = SimpleNamespace(reqs=[b, a], tree_cache=SimpleNamespace(runtime=rt))

    def check(self, selected_indices=None):  # SGLang's check, pretending a step needs 150 free slots
        return alloc.available_size() >= 150

    assert decode_mem_hook(check, batch, selected_indices=[0]) is False  # retract_decode's own re-checks: untouched
    assert seen["offloads"] == []
    assert decode_mem_hook(check, batch) is True
    assert rt.requests["a"].path.state is S.DECODE_SPARSE  # 100 + 177 freed: enough
    assert rt.requests["b"].path.state is S.DENSE
    assert seen == {"changes": ["pressure"], "offloads": ["retraction"]}


def test_release_after_a_pressure_offload_returns_accounting_to_baseline():
    rt, pool, alloc, r2t, seen = runtime()
    a = request(alloc, r2t, 2, 200, "a")
    rt.after_extend(SimpleNamespace(reqs=[a]), TREE)
    assert hook(budget, FakeAdder(rt, alloc, [a]), waiting_request(150, 64), total_tokens=222, **KW)[0]
    decode_steps(rt, alloc, pool, r2t, a, TREE, 12)  # sparse decode: pages flush, the window slides
    # SGLang's release: free_kv_row over the row, then on_release (finished, aborted or retracted alike).
    assert rt.free_request_slots(a.kv, [(0, a.kv.kv_committed_len)])
    rt.on_release(a)
    assert alloc.available_size() == SLOTS
    assert not rt.requests and not rt.by_pool and rt.resident_tokens() == 0
    assert rt.host.used_bytes == rt.host_entry_tokens() * PER_TOKEN
    rt.reset()
    assert rt.host.used_bytes == 0


def test_a_marked_request_released_before_its_prefill_leaves_no_mark():
    rt, pool, alloc, r2t, seen = runtime()
    rt.pressure.mark_waiting("w")
    rt.on_release(SimpleNamespace(rid="w"))  # aborted while queued: SGLang releases an untracked request
    assert not rt.table.pressure_marked


def test_under_always_the_hooks_return_sglangs_answer_and_touch_nothing():
    """The preset's ``always`` and no request asking for ``pressure``: the admission, retraction and
    reopening hooks call SGLang's check once, return its answer, and move nothing."""
    rt, pool, alloc, r2t, seen = runtime("always")
    a = request(alloc, r2t, 2, 200, "a", custom={"dd_sparse": False})  # a long dense request under always
    rt.after_extend(SimpleNamespace(reqs=[a]), TREE)
    assert not rt.pressure.active() and not rt.admission_may_reopen([a])
    calls = []

    def check(self, selected_indices=None):
        calls.append(selected_indices)
        return False

    batch = SimpleNamespace(reqs=[a], tree_cache=SimpleNamespace(runtime=rt))
    assert decode_mem_hook(check, batch) is False and calls == [None]
    adder = FakeAdder(rt, alloc, [a])

    def refuse(adder, r, **kw):
        calls.append(kw["total_tokens"])
        return False, None

    # A long waiting request: main's cap (it goes sparse after its prefill: 64 - 31 fewer), one check.
    assert hook(refuse, adder, waiting_request(150, 64), total_tokens=222, **KW) == (False, None)
    assert calls == [None, 222 - 33]
    # A short one (no cap): SGLang's figure, one check, no plan.
    assert hook(refuse, adder, waiting_request(40, 300), total_tokens=348, **KW) == (False, None)
    assert calls == [None, 189, 348]
    assert rt.requests["a"].path.state is S.DENSE and alloc.available_size() == SLOTS - 200
    assert seen == {"changes": [], "offloads": []} and not rt.table.pressure_marked
    # A waiting request that asks for pressure makes the policy active for its admission.
    asking = waiting_request(150, 64)
    asking.sampling_params.custom_params = {"dd_policy": "pressure"}
    assert rt.pressure.active(asking) and not rt.pressure.active(waiting_request(150, 64))
