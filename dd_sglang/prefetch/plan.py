"""The sparse decode step's plan: built once per step, read by every layer.

:func:`build_step_plan` runs in the attention backend's
``init_forward_metadata`` (SGLang's per-step seam) and returns one immutable
:class:`~dd_sglang.prefetch.step_plan.StepPlan`, which travels on the forward batch (``forward_batch.dd_step.plan``).
Everything that needs Python, host syncs or per-request lookups happens here,
once; the per-layer path (:mod:`dd_sglang.prefetch.runner`) only indexes
tensors. Building a plan:

1. **Rows.** Each decode row whose request is ``DECODE_SPARSE`` is a sparse
   row. Its resident positions (sinks, kept tokens, window) become device slots
   ``layout.res_slots`` (padded, masked); its candidates (host-tier positions outside
   the resident set) become :class:`~dd_sglang.prefetch.scoring.RowBlocks`.
2. **Speculation.** Rows whose selector reads a speculated query verify last
   step's speculated token against the real one, then ask their speculator
   for the next; each proposal is appended to ``forward_batch.input_ids`` /
   ``positions`` as a second query position of its row (``batch_size`` is
   unchanged; the logits hook cuts those rows, reading the plan from the batch).
3. **Where each row's critical set comes from**, rows ordered in three runs:

   * *ahead* ``[0, n_ahead)``: a lookahead selector fixed its sets during the
     previous step (:class:`NextSets`); the transfer schedule copies them
     layer by layer before attention needs them.
   * *full* ``[n_ahead, n_fixed)``: at most ``k`` candidates: the set is every
     candidate, the same for every layer (also copied ahead). With ``top_k`` at
     least the context, the sparse step attends to the whole context.
   * *sync* ``[n_fixed, rows)``: chosen at attention time from the current
     query: ``oracle``, ``quest_device``, and a lookahead row's first sparse
     step (a *cold* start).

4. **Attention layout.** Per row, columns ``[0, n_res)`` hold the resident
   set, ``[n_res, n_res + k)`` the critical set, then one column for the speculated token's own K/V. The
   mask ``[rows, 2, columns]`` says which columns each of the two queries (real,
   speculated) reads. The *ahead* rows (``checks.verify_rows``: all of them)
   have their critical-set columns checked against the real query's own set at each layer
   (:mod:`dd_sglang.prefetch.verify`): what the prediction missed is swapped in before attention.
5. **Exact rows.** A *full* row needs no prediction (its next set is again its
   whole context), so no token rides for it and the batch has dense's shape.
   ``exact.cols`` lists, per full row, its columns in position order; the
   backend attends it with dense's own call
   (:func:`dd_sglang.kernels.sparse_decode.dense_decode_attention`), so its
   output is the dense path's bit for bit, not merely up to rounding.
"""

from __future__ import annotations

import hashlib
import time

import torch

from dd_sglang.prefetch.plan_inputs import PlanInputs
from dd_sglang.prefetch.plan_rows import (
    PlanRow,
    classify,
    sparse_rows,
    speculate,
    update_indexes,
)
from dd_sglang.prefetch.predictions import NextSets, PredictionStore, RequestPrediction
from dd_sglang.prefetch.scoring import row_blocks
from dd_sglang.prefetch.speculators import DualTokenSpeculator
from dd_sglang.prefetch.step_plan import (
    CheckedRows,
    ColumnLayout,
    ExactRows,
    FixedSets,
    RidingTokens,
    RowRequests,
    SelectionGroup,
    Selections,
    StepPlan,
)

__all__ = ["CheckedRows", "ColumnLayout", "ExactRows", "FixedSets", "NextSets", "PlanInputs", "PredictionStore",
           "RequestPrediction", "RidingTokens", "RowRequests", "SelectionGroup", "Selections", "StepPlan",
           "build_step_plan"]


def _fixed_sets(rows: list[PlanRow], nxt: NextSets, n_ahead: int, n_fixed: int, k: int, hkv: int, n_layers: int):
    """``[layers, n_fixed, Hkv, k]`` positions and host slots of the fixed rows: last step's
    selections (one gather for every layer) then every candidate of the full rows."""
    full = rows[n_ahead:n_fixed]
    full_pos = pad_stack([r.cand for r in full], k)[None, :, None].expand(n_layers, -1, hkv, -1)
    full_slots = pad_stack([r.st.host_slots[r.cand] for r in full], k)[None, :, None].expand(n_layers, -1, hkv, -1)
    if not n_ahead:
        return full_pos, full_slots
    where = {rid: j for j, rid in enumerate(nxt.rids)}
    order = [where[r.st.rid] for r in rows[:n_ahead]]
    a, b = nxt.pos, nxt.slots
    if order != list(range(a.shape[1])):  # rows joined, left or moved since the selection
        perm = torch.tensor(order, dtype=torch.int64)
        a, b = a[:, perm], b[:, perm]
    if k != nxt.k:
        pad = (0, max(0, k - nxt.k))
        a = torch.nn.functional.pad(a, pad)[..., :k]
        b = torch.nn.functional.pad(b, pad)[..., :k]
    if not full:
        return a, b
    return torch.cat([a, full_pos], dim=1), torch.cat([b, full_slots], dim=1)


def _ride(fb, rows: list[PlanRow]) -> tuple[list, dict, torch.Tensor]:
    """Append the speculated tokens to the batch (after its real rows); ``(spec, token index, qidx)``."""
    bs = fb.batch_size
    n_spec = max((len(r.spec_tokens) for r in rows), default=0)
    spec = [(j, s, tok) for j, r in enumerate(rows) for s, tok in enumerate(r.spec_tokens)]
    if spec:
        ids = torch.tensor([t for _, _, t in spec], dtype=fb.input_ids.dtype, device=fb.input_ids.device)
        pos = torch.tensor([rows[j].position + 1 for j, _, _ in spec], dtype=fb.positions.dtype,
                           device=fb.positions.device)  # fmt: skip
        fb.input_ids = torch.cat([fb.input_ids[:bs], ids])
        fb.positions = torch.cat([fb.positions[:bs], pos])
    tok = {(j, s): bs + i for i, (j, s, _) in enumerate(spec)}
    # A row with fewer riding tokens repeats its first (or its real token) in the missing places.
    qidx = torch.tensor([[r.batch_row] + [tok.get((j, s), tok.get((j, 0), r.batch_row)) for s in range(n_spec)]
                         for j, r in enumerate(rows)])  # fmt: skip
    return spec, tok, qidx


def build_step_plan(fb, rt, inp: PlanInputs, on_verify=lambda spec, ok: None) -> StepPlan | None:
    """Plan a decode step (module docstring); None when no row of ``fb`` decodes sparsely.

    Args:
        fb: SGLang's ``ForwardBatch`` (decode mode). Its ``input_ids`` / ``positions`` grow by
            one entry per speculated position.
        rt: the KV-cache runtime (``sparse_request(pool_idx)``, ``host``).
        inp: :class:`PlanInputs`.
        on_verify: ``(speculator, accepted)`` for every verified speculation (metrics).
    """
    started = time.perf_counter()
    rows = sparse_rows(fb, rt, inp)
    if not rows:
        return None
    speculate(rows, inp, on_verify)
    nxt = inp.store.next_sets
    rows = classify(rows, nxt, rt.host.layer_num)
    update_indexes(rows, inp, lambda r: r.st.host_len)
    n_ahead = sum(r.kind == "ahead" for r in rows)
    n_fixed = n_ahead + sum(r.kind == "full" for r in rows)
    k = max(1, max(r.st.choice.top_k if r.kind != "full" else r.cand.numel() for r in rows))
    fixed = FixedSets(*_fixed_sets(rows, nxt, n_ahead, n_fixed, k, rt.host.k.shape[2], rt.host.layer_num))
    spec, spec_tok, qidx = _ride(fb, rows)
    ahead_rows = _renew_next_sets(rows, inp.store, rt.host.layer_num)
    dev = fb.input_ids.device
    layout = _column_layout(fb, rows, inp.req_to_token, k, qidx, dev)
    riding = _riding_tokens(rows, spec, spec_tok, layout.n_res + layout.k, dev)
    checks = _checked_rows(n_ahead, inp, qidx, dev)
    requests = _row_requests(rows)
    exact = _exact_rows(rows, n_ahead, n_fixed, layout.n_res, dev)
    return StepPlan(
        rows=torch.tensor([r.batch_row for r in rows], dtype=torch.int64),
        batch_size=fb.batch_size,
        n_ahead=n_ahead,
        n_fixed=n_fixed,
        started=started,
        fixed=fixed,
        selection=_selections(rows, n_fixed, ahead_rows, qidx, dev),  # last: it reads the candidates' blocks
        layout=layout,
        spec=riding,
        checks=checks,
        requests=requests,
        exact=exact,
    )


def _renew_next_sets(rows: list[PlanRow], store: PredictionStore, n_layers: int) -> list[int]:
    """Give ``store`` a fresh :class:`NextSets` for this step's lookahead selections (the previous
    one was read by :func:`_fixed_sets`); returns the plan rows that fill it, in its order."""
    ahead_rows = [j for j, r in enumerate(rows) if r.selector.lookahead and r.kind != "full"]
    store.next_sets = NextSets(tuple(rows[j].st.rid for j in ahead_rows),
                               max((rows[j].st.choice.top_k for j in ahead_rows), default=1), n_layers)  # fmt: skip
    return ahead_rows


def _selections(rows: list[PlanRow], n_fixed: int, ahead_rows: list[int], qidx: torch.Tensor, dev) -> Selections:
    """:class:`Selections`: the sync rows ``[n_fixed, R)`` grouped on the real query, the
    lookahead ``ahead_rows`` on their speculated ones (``qidx``: ``[R, positions]`` on the CPU; each
    group's queries also on ``dev``), then every row's candidate blocks, handed to the groups."""
    sync = _groups(rows, range(n_fixed, len(rows)), qidx, dev, use_spec=False)
    ahead = _groups(rows, ahead_rows, qidx, dev, use_spec=True)
    top_k = torch.tensor([r.st.choice.top_k for r in rows], dtype=torch.int64)
    blocks = row_blocks([r.st.host_slots for r in rows], [_lo(r) for r in rows],
                        [min(r.st.win_start, r.st.host_len) for r in rows], [r.st.keep_pos for r in rows])  # fmt: skip
    return Selections(sync=blocks.grouped(sync), ahead=blocks.grouped(ahead), blocks=blocks, top_k=top_k)


def _column_layout(fb, rows: list[PlanRow], req_to_token: torch.Tensor, k: int, qidx: torch.Tensor,
                   dev) -> ColumnLayout:  # fmt: skip
    """:class:`ColumnLayout` of ``rows`` with ``k`` critical columns and :func:`_ride`'s ``qidx``
    (``[R, positions]`` int64 on the CPU); tensors moved to ``dev``."""
    n_res = max(int(r.dev_pos.numel()) for r in rows)
    positions = qidx.shape[1]
    cols = n_res + k + max(positions - 1, 1)
    return ColumnLayout(
        n_res=n_res,
        k=k,
        positions=positions,
        res_slots=_resident_slots(fb, rows, req_to_token, n_res).to(dev),
        qidx=qidx.to(dev),
        mask=_mask(rows, n_res, k, positions, cols).to(dev),
    )


def _checked_rows(n_ahead: int, inp: PlanInputs, qidx: torch.Tensor, dev) -> CheckedRows:
    """:class:`CheckedRows` among the ahead rows ``[0, n_ahead)``: every one is verified, and a
    ``inp.hit_rate_sample`` share is sampled, drawn from ``inp.rng`` (one draw per ahead row, in order);
    their real queries' token indices (``qidx[:, 0]``) on ``dev``."""
    sampled = torch.tensor([j for j in range(n_ahead) if inp.rng.random() < inp.hit_rate_sample], dtype=torch.int64)
    verify = torch.arange(n_ahead, dtype=torch.int64)
    return CheckedRows(verify, sampled, qidx[verify, 0].to(dev), qidx[sampled, 0].to(dev))


def row_seed(r: PlanRow) -> int:
    """The row's sampling seed under coupled sampling, fixed at its first sparse step
    (``SpecState.seed``): 63 bits of a BLAKE2b hash of the request id and its ``sampling_seed``
    (the same on every tensor-parallel rank; distinct for the ``n`` samples of one request, which
    share a ``sampling_seed`` but not a request id, so their draws stay independent)."""
    spec = r.pred.spec
    if spec.seed is None:
        given = getattr(getattr(r.st.req, "sampling_params", None), "sampling_seed", None)
        digest = hashlib.blake2b(f"{r.st.rid}/{given}".encode(), digest_size=8).digest()
        spec.seed = int.from_bytes(digest, "little") >> 1
    return spec.seed


def pad_stack(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    """``[len(rows), width]`` int64: each ``[n]`` tensor of ``rows`` left-aligned, zero padded."""
    out = torch.zeros(len(rows), width, dtype=torch.int64)
    for i, t in enumerate(rows):
        out[i, : t.numel()] = t
    return out


def _row_requests(rows: list[PlanRow]) -> RowRequests:
    """:class:`RowRequests` of ``rows``, with each row's coupled-sampling seed."""
    return RowRequests(
        rids=tuple(r.st.rid for r in rows),
        labels=tuple((r.selector.name, DualTokenSpeculator.name if r.selector.uses_speculator else "none") for r in rows),
        seeds=tuple(row_seed(r) for r in rows),
    )


def _exact_rows(rows: list[PlanRow], n_ahead: int, n_fixed: int, n_res: int, dev) -> ExactRows:
    """:class:`ExactRows`: the full rows ``[n_ahead, n_fixed)`` whose columns hold exactly their
    context (:func:`_exact_cols`), columns moved to ``dev``."""
    exact = [(j, _exact_cols(rows[j], n_res)) for j in range(n_ahead, n_fixed)]
    exact = [(j, c) for j, c in exact if c is not None]
    return ExactRows(tuple(rows[j].batch_row for j, _ in exact), tuple(c.to(dev) for _, c in exact))


def _resident_slots(fb, rows: list[PlanRow], req_to_token: torch.Tensor, n_res: int) -> torch.Tensor:
    """``[len(rows), n_res]`` int64 on the CPU: each row's resident device slots (SGLang's
    ``req_to_token`` at its ``dev_pos``), padded as :func:`pad_stack` pads."""
    r2t = req_to_token
    return pad_stack([r2t[int(fb.req_pool_indices[r.batch_row])][r.dev_pos.to(r2t.device)].long().cpu()
                       for r in rows], n_res)  # fmt: skip


def _riding_tokens(rows: list[PlanRow], spec: list, spec_tok: dict, first_col: int, dev) -> RidingTokens:
    """:class:`RidingTokens` from :func:`_ride`'s ``spec`` (``(row, s, _)`` per riding position)
    and ``spec_tok`` (its token by ``(row, s)``): int64 tensors on ``dev`` (``rows``, ``query_pos``
    = ``s + 1``, ``tokens``, ``cols`` = ``first_col + s``, the ring column after the row's own
    columns) and ``states``."""

    def t(values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=dev)

    return RidingTokens(
        rows=t([j for j, _, _ in spec]),
        query_pos=t([s + 1 for _, s, _ in spec]),
        tokens=t([spec_tok[(j, s)] for j, s, _ in spec]),
        cols=t([first_col + s for _, s, _ in spec]),
        states=tuple((rows[j].pred.spec, s) for j, s, _ in spec),
    )


def _exact_cols(r: PlanRow, n_res: int) -> torch.Tensor | None:
    """``[seq_len]`` int64: a full row's ring columns (resident ``[0, len(dev_pos))``, critical
    ``[n_res, n_res + len(cand))``) ordered by the position each holds; None unless together they
    hold exactly the positions ``[0, seq_len)`` (then the row is not attended as an exact row)."""
    pos = torch.cat([r.dev_pos.cpu().long(), r.cand.cpu().long()])
    cols = torch.cat([torch.arange(r.dev_pos.numel()), n_res + torch.arange(r.cand.numel())])
    srt, idx = pos.sort(stable=True)
    if pos.numel() != r.position + 1 or not torch.equal(srt, torch.arange(pos.numel())):
        return None
    return cols[idx]


def _lo(r: PlanRow) -> int:
    """First candidate position: past the sinks (``keep_pos`` starts with them)."""
    return int(r.cand[0]) if r.cand.numel() else 0


def _groups(rows: list[PlanRow], which, qidx: torch.Tensor, dev, use_spec: bool) -> list[SelectionGroup]:
    """Group plan rows ``which`` by selector (one selection call per group and layer); their
    ``blocks`` are given afterwards (:meth:`RowBlocks.grouped`).

    A group's queries: the speculated positions (all of them: the selector ranks by every
    riding token's query at once) for a selector that reads them when ``use_spec``, else the
    real one.
    """
    by_name: dict[str, list[int]] = {}
    for j in which:
        by_name.setdefault(rows[j].selector.name, []).append(j)
    order = {j: i for i, j in enumerate(which)}
    out = []
    for js in by_name.values():
        sel = rows[js[0]].selector
        idx = torch.tensor(js, dtype=torch.int64)
        spec = use_spec and sel.uses_speculator and qidx.shape[1] > 1
        q = qidx[idx, 1:] if spec else qidx[idx, :1]
        dest = torch.tensor([order[j] for j in js], dtype=torch.int64)
        out.append(SelectionGroup(sel, idx, q, None, max(rows[j].st.choice.top_k for j in js), dest, q.to(dev)))
    return out


def _mask(rows: list[PlanRow], n_res: int, k: int, positions: int, cols: int) -> torch.Tensor:
    """``[R, positions, cols]`` bool: resident, critical (row's own length), then each
    speculated position's own column (read by that position only)."""
    n = len(rows)
    m = torch.zeros(n, positions, cols, dtype=torch.bool)
    first_own = cols - max(positions - 1, 1)
    for j, r in enumerate(rows):
        m[j, :, : r.dev_pos.numel()] = True
        kk = r.cand.numel() if r.kind == "full" else r.st.choice.top_k
        m[j, :, n_res : n_res + kk] = True
        for s in range(len(r.spec_tokens)):
            m[j, 1 + s, first_own + s] = True
    return m
