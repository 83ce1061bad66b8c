"""The sparse rows of a decode step while its plan is built (steps 1-3 of :mod:`dd_sglang.prefetch.plan`).

:func:`sparse_rows` finds the batch's ``DECODE_SPARSE`` rows, :func:`speculate` verifies and renews
their speculated tokens, :func:`classify` orders them ahead / full / sync, and
:func:`update_indexes` brings the key indexes they read up to their host-tier length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dd_sglang.prefetch.plan_inputs import PlanInputs
from dd_sglang.prefetch.predictions import NextSets, RequestPrediction
from dd_sglang.prefetch.selectors import Selector
from dd_sglang.prefetch.speculators import verify


@dataclass
class PlanRow:
    """One sparse row of the batch while its plan is built.

    ``dev_pos``: ``[n]`` int64 its resident positions; ``cand``: ``[m]`` int64 its host-tier
    candidates; ``token``/``position``: its current token and position; ``spec_tokens``: the
    tokens riding for it; ``kind``: where its critical set comes from (``plan`` module docstring, step 3).
    """

    batch_row: int
    st: object  # SparseRequest
    pred: RequestPrediction
    selector: Selector
    dev_pos: torch.Tensor
    cand: torch.Tensor
    token: int = 0
    position: int = 0
    spec_tokens: tuple[int, ...] = ()
    kind: str = "sync"  # ahead | full | sync



def token_history(st, token: int) -> list[int]:
    """The request's token ids up to and including the current ``token``."""
    req = st.req
    ids = [] if req is None else list(req.origin_input_ids) + list(req.output_ids)
    if not ids or ids[-1] != token:
        ids.append(token)
    return ids


def is_full(r: PlanRow) -> bool:
    """The row's critical set is every candidate (``top_k`` covers them)."""
    return r.cand.numel() <= r.st.choice.top_k


def speculate(rows: list[PlanRow], inp: PlanInputs, on_verify) -> None:
    """Verify each speculating row's last guess against its real token and propose the next (step 2)."""
    for r in rows:
        if not r.selector.uses_speculator or is_full(r):  # a full row needs no prediction (step 5)
            r.pred.spec.riding = ()
            continue
        ok = verify(r.pred.spec, r.token)
        if ok is not None:
            on_verify(inp.speculator.name, ok)
        tok = inp.speculator.propose(token_history(r.st, r.token), r.pred.spec)
        r.pred.spec.riding, r.pred.spec.top = tok, [None] * len(tok)
        r.spec_tokens = tok


def index_locations(r: PlanRow) -> tuple[str, ...]:
    """Where a row's blocks must be summarised: its selector's index, and the host index for every
    lookahead row (verification ranks the real query there)."""
    if r.kind == "full":
        return ()
    locs = {r.selector.index_location} - {None}
    if r.selector.lookahead:
        locs.add("host")
    return tuple(sorted(locs))


def update_indexes(rows: list[PlanRow], inp: PlanInputs, host_len) -> None:
    """Index newly offloaded / flushed positions in the key indexes the rows read."""
    for r in rows:
        for loc in index_locations(r):
            done = r.pred.indexed.get(loc, 0)
            n = host_len(r)
            if n > done:
                inp.make_index(loc).update(r.st.host_slots, done, n)
                r.pred.indexed[loc] = n


def sparse_rows(fb, rt, inp: PlanInputs) -> list[PlanRow]:
    """The batch's sparse rows (one host sync for the batch's ids, positions and lengths)."""
    bs = fb.batch_size
    pool_idx = fb.req_pool_indices.tolist()
    sparse = [(i, rt.sparse_request(int(p))) for i, p in enumerate(pool_idx)]
    sparse = [(i, st) for i, st in sparse if st is not None]
    if not sparse:
        return []
    seq_lens, ids, positions = fb.seq_lens.tolist(), fb.input_ids[:bs].tolist(), fb.positions[:bs].tolist()
    return [
        PlanRow(i, st, inp.store.get(st.rid), inp.selectors[st.choice.selector], st.device_positions(int(seq_lens[i])),
             st.host_candidates(), int(ids[i]), int(positions[i]))  # fmt: skip
        for i, st in sparse
    ]


def classify(rows: list[PlanRow], nxt: NextSets, n_layers: int) -> list[PlanRow]:
    """Mark each row ahead / full / sync and order them so (module docstring, step 3)."""
    have = set(nxt.rids) if len(nxt.filled) == n_layers == nxt.layers else set()
    for r in rows:
        if is_full(r):
            r.kind = "full"
        elif r.selector.lookahead and r.st.rid in have:
            r.kind = "ahead"
    return sorted(rows, key=lambda r: ("ahead", "full", "sync").index(r.kind))
