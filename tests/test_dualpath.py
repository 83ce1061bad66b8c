"""The DualPath state machine: initial state, legal and illegal transitions, callbacks."""

from __future__ import annotations

import itertools

import pytest

from dd_sglang.kvcache.dualpath import TRANSITIONS, DualPath, IllegalTransition, PathState

S = PathState

#: The legal edges, written out by hand from DESIGN.md (independent of TRANSITIONS).
LEGAL = {
    (S.DENSE, S.PREFILL_FULL),
    (S.PREFILL_FULL, S.OFFLOADING),
    (S.PREFILL_FULL, S.DENSE),
    (S.OFFLOADING, S.DECODE_SPARSE),
    (S.OFFLOADING, S.DENSE),
    (S.DECODE_SPARSE, S.REBUILD),
    (S.REBUILD, S.PREFILL_FULL),
} | {(s, S.FINISHED) for s in S if s is not S.FINISHED}


def test_table_matches_design():
    assert {(a, b) for a, dsts in TRANSITIONS.items() for b in dsts} == LEGAL


@pytest.mark.parametrize(
    "ctx,expected", [(0, S.DENSE), (1023, S.DENSE), (1024, S.PREFILL_FULL), (8000, S.PREFILL_FULL)]
)
def test_initial_state_from_context_length(ctx, expected):
    assert DualPath("r", ctx, min_sparse_len=1024).state is expected


def test_full_sparse_life_cycle_reports_each_transition():
    seen = []
    p = DualPath("r", 4096, 1024, on_transition=lambda a, b: seen.append((a.value, b.value)))
    for dst in (
        S.OFFLOADING,
        S.DECODE_SPARSE,
        S.REBUILD,
        S.PREFILL_FULL,
        S.OFFLOADING,
        S.DECODE_SPARSE,
        S.FINISHED,
    ):
        p.to(dst)
    assert p.finished
    assert seen == [
        ("PREFILL_FULL", "OFFLOADING"),
        ("OFFLOADING", "DECODE_SPARSE"),
        ("DECODE_SPARSE", "REBUILD"),
        ("REBUILD", "PREFILL_FULL"),
        ("PREFILL_FULL", "OFFLOADING"),
        ("OFFLOADING", "DECODE_SPARSE"),
        ("DECODE_SPARSE", "FINISHED"),
    ]
    assert p.history[0] is S.PREFILL_FULL and p.history[-1] is S.FINISHED


@pytest.mark.parametrize("src,dst", [(a, b) for a, b in itertools.product(S, S) if (a, b) not in LEGAL])
def test_illegal_transitions_raise_and_change_nothing(src, dst):
    p = DualPath("r", 0, 1)
    p.state = src
    calls = []
    p._on_transition = lambda a, b: calls.append((a, b))
    with pytest.raises(IllegalTransition, match=f"{src.value} -> {dst.value}"):
        p.to(dst)
    assert p.state is src and not calls


@pytest.mark.parametrize(
    "kwargs,field", [({"context_len": -1}, "context_len"), ({"min_sparse_len": 0}, "min_sparse_len")]
)
def test_bad_arguments_name_the_field(kwargs, field):
    args = {"rid": "r", "context_len": 10, "min_sparse_len": 5, **kwargs}
    with pytest.raises(ValueError, match=field):
        DualPath(**args)
