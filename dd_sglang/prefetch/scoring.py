"""A step's candidate tokens (:class:`RowBlocks`) and the batched scoring every selector uses.

**Reading keys in place.** Every KV head of a host slot is one contiguous
``num_kv_heads x head_dim`` row of a layer (the tier is layer-first), the
positions of a row are the same for all its KV heads, and a request's pages
are mostly consecutive slots (its offload allocates them at once). So a
step's candidates are built once, head-independent (:attr:`RowBlocks.tokens`,
:attr:`RowBlocks.runs`), and each layer scores a row with one GEMM per run of
consecutive slots on a view of the tier or its index, every query head at
once through a block-diagonal query matrix (:func:`token_products`): no
gather, no per-head copy. Exact scoring (:func:`candidate_logits`) reads the
keys the same way.

**Scoring primitives** (one layer, every row of a step at once), which the
selectors (:mod:`dd_sglang.prefetch.selectors`) combine. A KV head's score for a token is the **max over its query heads** (GQA group)
of the softmax probability of that token, the softmax running over the
row's candidate tokens that are scored (DESIGN.md, "Measuring the prefetch
hit rate honestly"): :func:`token_log_scores`. A block's bound for a query is
the upper bound of ``q . k`` over the block (``sum_d max(q_d min_d, q_d
max_d)``, Quest eq. 1): :func:`block_scores` turns it into a log-probability
bound per query head and takes the max over the GQA group.

Candidates are a row's host-tier positions outside its resident set:
``[n_sink, min(win_start, host_len))`` minus its ``n_keep`` kept positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property

import torch

#: Tokens summarised by one index entry (Quest's default page size).
BLOCK_TOKENS = 16
#: A row split over more host-tier runs than this is scored from one gather instead of a GEMM
#: per run (a fragmented tier: per-call overhead would then exceed the gather's copy).
MAX_RUNS = 16


@dataclass(frozen=True)
class RowBlocks:
    """The candidate blocks of a step's rows (built once per step; :func:`row_blocks`).

    Attributes:
        blocks: ``[rows, B]`` int64 index entries (host block ids), padded with 0.
        pos0: ``[rows, B]`` int64 first position of each block.
        valid: ``[rows, B]`` bool, the block holds at least one candidate.
        cand: ``[rows, P]`` bool, position ``p`` of the row is a candidate (``P`` = longest row).
        n_valid: ``[rows]`` int64 candidate blocks per row.
        holes: most non-candidate positions inside one row's candidate blocks (sinks, kept
            tokens, the block the window starts in): ``m`` blocks always hold at least
            ``16 m - holes`` candidates.
    """

    blocks: torch.Tensor
    pos0: torch.Tensor
    valid: torch.Tensor
    cand: torch.Tensor
    n_valid: torch.Tensor
    holes: int

    def take(self, rows: torch.Tensor) -> RowBlocks:
        """The same for a subset of rows (``[n]`` int64 row indices)."""
        t = (self.blocks, self.pos0, self.valid, self.cand, self.n_valid)
        return RowBlocks(*(x[rows] for x in t), self.holes)

    def grouped(self, groups) -> tuple:
        """Selection groups (dataclasses with ``rows``, ``[n]`` int64, and ``blocks``) given their rows'
        blocks: these very blocks for a group of every row in order (their cached :attr:`tokens` are then
        built once for the step), else :meth:`take` of its rows."""
        n = self.blocks.shape[0]
        every = torch.arange(n)
        return tuple(replace(g, blocks=self if torch.equal(g.rows, every) else self.take(g.rows)) for g in groups)

    @cached_property
    def tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every position of every candidate block, head-independent, built once and read by all layers.

        Returns ``(slots, ok)``, each ``[rows, P]`` (``P = 16 x blocks``): the host slot of position
        ``p`` of the row (int64; 0 past the row's blocks) and whether it is a candidate (bool).
        Position ``p`` sits at index ``p``.
        """
        n, nb = self.blocks.shape
        slots = (self.blocks.unsqueeze(2) * BLOCK_TOKENS + torch.arange(BLOCK_TOKENS)).view(n, nb * BLOCK_TOKENS)
        return slots, self.cand[:, : nb * BLOCK_TOKENS]

    @cached_property
    def runs(self) -> tuple[tuple[tuple[int, int, int], ...], ...]:
        """Per row, its positions from the first to the last candidate as maximal runs ``(p0, p1, s0)``:
        positions ``[p0, p1)`` lie in host slots ``[s0, s0 + p1 - p0)``. The host tier allocates
        whole pages and a request's offload takes its pages at once, so a row is one or a few
        runs, each scored on a view of the tier (:func:`token_products`). Built once per step."""
        slots, ok = self.tokens
        out = []
        for r in range(slots.shape[0]):
            where = ok[r].nonzero().flatten()
            if not where.numel():
                out.append(())
                continue
            first, last = int(where[0]), int(where[-1]) + 1
            s = slots[r, first:last]
            cut = ((s[1:] - s[:-1]) != 1).nonzero().flatten().add_(1).tolist()
            starts, ends = [0, *cut], [*cut, last - first]
            out.append(tuple((first + a, first + b, int(s[a])) for a, b in zip(starts, ends, strict=True)))
        return tuple(out)


def row_blocks(host_slots: list[torch.Tensor], lo: list[int], hi: list[int], keep: list[torch.Tensor]) -> RowBlocks:
    """Per row: its candidate blocks and positions.

    Args:
        host_slots: per row ``[>= hi]`` int64 host slot per position.
        lo, hi: per row, candidates are positions in ``[lo, hi)`` ...
        keep: ... except these (``[n]`` int64, the kept resident positions).
    """
    b = BLOCK_TOKENS
    n = len(host_slots)
    nb = [-(-h // b) for h in hi]
    bmax, pmax = max(max(nb), 1), max(max(nb), 1) * b
    blocks = torch.zeros(n, bmax, dtype=torch.int64)
    cand = torch.zeros(n, pmax, dtype=torch.bool)
    for r in range(n):  # once per step, not per layer
        blocks[r, : nb[r]] = host_slots[r][: nb[r] * b : b] // b
        cand[r, lo[r] : hi[r]] = True
        if keep[r].numel():
            cand[r, keep[r][keep[r] < pmax]] = False
    valid = cand.view(n, bmax, b).any(dim=2)
    pos0 = torch.arange(bmax).mul_(b).expand(n, bmax).contiguous()
    n_valid = valid.sum(dim=1)
    holes = int((n_valid * b - cand.sum(dim=1)).max()) if n else 0
    return RowBlocks(blocks, pos0, valid, cand, n_valid, holes)


def block_bounds(q: torch.Tensor, mins: torch.Tensor, maxs: torch.Tensor) -> torch.Tensor:
    """Upper bounds of ``q . k`` over each block: ``q+ . max + q- . min`` (Quest eq. 1).

    Args:
        q: ``[rows, num_kv_heads, group, head_dim]`` float32.
        mins, maxs: ``[rows, blocks, num_kv_heads, head_dim]`` block summaries.

    Returns:
        ``[rows, num_kv_heads, group, blocks]`` float32.
    """
    return torch.einsum("rhgd,rbhd->rhgb", q.clamp(min=0), maxs.float()) + torch.einsum(
        "rhgd,rbhd->rhgb", q.clamp(max=0), mins.float()
    )


def block_scores(q: torch.Tensor, rows: RowBlocks, mins: torch.Tensor, maxs: torch.Tensor, scale: float) -> torch.Tensor:
    """Per KV head, each block's bound as a log-probability bound, maxed over the GQA group.

    Per query head, ``bound - logsumexp_b(bound_b + log 16)``: the block's scaled bound less an
    estimate of the head's softmax normaliser (every block standing for 16 tokens at its bound),
    so blocks compare across the group's heads as the token scores do (max over the group of
    softmax probabilities).

    ``q``: ``[rows, num_q_heads, head_dim]``; ``mins``, ``maxs``: one layer's block summaries
    ``[host_slots / 16, num_kv_heads, head_dim]`` (:class:`~dd_sglang.prefetch.index.KeyBlockIndex`'s
    ``mins[layer]``, ``maxs[layer]``), on any device. Returns ``[rows, num_kv_heads, blocks]``
    float32 on the CPU, ``-inf`` for blocks without candidates.
    """
    device = mins.device
    blocks = rows.blocks.to(device)
    mins, maxs = mins[blocks], maxs[blocks]  # [R, B, Hkv, D]
    r, hq, d = q.shape
    hkv = mins.shape[2]
    ub = block_bounds(q.to(device).float().view(r, hkv, hq // hkv, d), mins, maxs) * scale
    ub = ub.masked_fill(~rows.valid.to(ub.device)[:, None, None, :], float("-inf"))
    # A log-softmax bound per query head: each block stands for up to 16 tokens at its bound, so
    # the head's normaliser is about logsumexp(bound + log 16). A head whose attention is spread
    # thin then scores every block low; one that concentrates scores its blocks high.
    ub = ub - torch.logsumexp(ub + math.log(BLOCK_TOKENS), dim=-1, keepdim=True)
    return ub.amax(dim=2).cpu()


def block_tokens(rows: RowBlocks, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Positions, host slots and candidate flags of the tokens of chosen blocks.

    ``chosen``: ``[rows, num_kv_heads, m]`` int64 block indices (into ``rows.blocks``). Returns three
    ``[rows, num_kv_heads, m x 16]`` tensors (int64, int64, bool).
    """
    r, hkv, m = chosen.shape
    b = BLOCK_TOKENS
    flat = chosen.reshape(r, -1)
    off = torch.arange(b)
    pos = (rows.pos0.gather(1, flat).view(r, hkv, m, 1) + off).view(r, hkv, m * b)
    slots = (rows.blocks.gather(1, flat).view(r, hkv, m, 1) * b + off).view(r, hkv, m * b)
    ok = rows.cand.gather(1, pos.view(r, -1)).view(r, hkv, m * b)
    return pos, slots, ok


def block_diagonal(q: torch.Tensor) -> torch.Tensor:
    """The GQA queries of a row as one block-diagonal matrix, so a row's scores are one GEMM.

    Args:
        q: ``[..., num_kv_heads, group, head_dim]`` (leading dims: layers, rows).

    Returns:
        ``[..., num_kv_heads x head_dim, num_kv_heads x group]`` of ``q``'s dtype: block ``h``
        (rows ``[h D, (h+1) D)``, columns ``[h G, (h+1) G)``) is ``q[..., h, :, :]`` transposed,
        the rest 0. ``keys [P, Hkv x D] @ W`` then gives every query head's logit for every
        token, each key read once, in place, in the host tier's token-major layout (``Hkv - 1``
        of every ``Hkv`` products are zeros: compute is not what this costs on a CPU, reading
        keys and dispatching small operations is).
    """
    *lead, hkv, g, d = q.shape
    w = q.new_zeros(*lead, hkv, d, hkv, g)
    for h in range(hkv):
        w[..., h, :, h, :] = q[..., h, :, :].transpose(-1, -2)
    return w.view(*lead, hkv * d, hkv * g)


def int8_matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """``out = a @ b`` of int8 matrices, exact, int32, per layer: ``[L, M, K] x [L, K, N] -> [L, M, N]``.

    ``torch._int_mm`` (PyTorch's int8 GEMM: VNNI / AMX-INT8 on a CPU that has them) for each
    layer, into ``out[l]`` (contiguous); where it refuses a shape or device, the same product
    in float32, exact for ``K <= 1024`` (every partial sum below ``2^24``).
    """
    try:
        for layer in range(a.shape[0]):
            torch._int_mm(a[layer], b[layer], out=out[layer])
    except RuntimeError:
        out.copy_(torch.bmm(a.float(), b.float()))


def _row_sources(flat: torch.Tensor, rows: RowBlocks):
    """Where each row's positions lie in ``flat`` (``[L, host_slots, C]``): yields ``(row, positions,
    source)``, ``source`` the ``[L, n, C]`` rows of ``flat`` for those ``positions`` (a slice).

    Each run of consecutive slots (:attr:`RowBlocks.runs`) is a view of ``flat`` (no copy); a row
    of more than :data:`MAX_RUNS` runs is one gather of all its positions (per-run calls would
    then cost more than the gather's copy).
    """
    slots, _ = rows.tokens
    for i, runs in enumerate(rows.runs):
        if len(runs) > MAX_RUNS:
            yield i, slice(None), flat.index_select(1, slots[i].to(flat.device))
            continue
        for p0, p1, s0 in runs:
            yield i, slice(p0, p1), flat[:, s0 : s0 + p1 - p0]


def token_rows(flat: torch.Tensor, rows: RowBlocks) -> torch.Tensor:
    """Every position's row of ``flat`` (``[L, host_slots, C]``), copied run by run: ``[L, rows, P, C]``.

    Positions outside every run are 0. For rows of a few bytes (the int8 index's per-token
    scales) this beats ``index_select`` along the slot dimension several times over.
    """
    slots, _ = rows.tokens
    out = torch.zeros(flat.shape[0], slots.shape[0], slots.shape[1], flat.shape[2], dtype=flat.dtype)
    for i, pos, src in _row_sources(flat, rows):
        out[:, i, pos] = src
    return out


def _float_mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(torch.bmm(a.float(), b))


def token_products(flat: torch.Tensor, rows: RowBlocks, w: torch.Tensor, mm, dtype: torch.dtype) -> torch.Tensor:
    """``keys @ w`` for every position of every row and layer, each key row read where it lies.

    Args:
        flat: ``[L, host_slots, Hkv x D]``: ``L`` layers' keys (or int8 index), one row per slot.
        rows: candidates; one GEMM per layer and run of consecutive slots, on a view of ``flat``
            (:func:`_row_sources`).
        w: ``[L, rows, Hkv x D, N]`` (:func:`block_diagonal`); ``mm``: the batched GEMM
            ``(a [L, n, K], b [L, K, N], out [L, n, N])`` writing ``a @ b`` into ``out``.

    Returns:
        ``[L, rows, P, N]`` of ``dtype``; 0 at positions outside every run (never candidates).
    """
    slots, _ = rows.tokens
    out = torch.zeros(w.shape[0], slots.shape[0], slots.shape[1], w.shape[3], dtype=dtype)
    for i, pos, src in _row_sources(flat, rows):
        mm(src, w[:, i], out[:, i, pos])
    return out


def candidate_logits(q: torch.Tensor, host_k: torch.Tensor, rows: RowBlocks, scale: float) -> torch.Tensor:
    """Exact float32 logits ``scale x q . k`` of every candidate token of every row and layer.

    The reference scoring of ``oracle`` / ``spec_host_exact`` / ``recency`` and of the hit-rate
    measurement: every KV head of a slot is one contiguous ``Hkv x D`` row of the layer-first
    tier, read in place (:func:`token_products`), one GEMM per run of slots, all KV heads and
    layers at once.

    Args:
        q: ``[L, rows, num_q_heads, head_dim]``.
        host_k: the ``L`` layers' host keys, ``[L, host_slots, num_kv_heads, head_dim]``.
        rows: the rows' candidates.

    Returns:
        ``[L, rows, num_kv_heads, group, P]`` float32, ``-inf`` where not a candidate.
    """
    slots, ok = rows.tokens
    r, p = slots.shape
    n_layers, _, hkv, d = host_k.shape
    w = block_diagonal(q.float().view(n_layers, r, hkv, q.shape[2] // hkv, d))
    prod = token_products(host_k.reshape(n_layers, -1, hkv * d), rows, w, _float_mm, torch.float32)
    out = prod.transpose(2, 3).contiguous().view(n_layers, r, hkv, -1, p).mul_(scale)
    return out.masked_fill_(~ok.view(1, r, 1, 1, p), float("-inf"))


def gqa_log_scores(logits: torch.Tensor) -> torch.Tensor:
    """``[..., Hkv, G, P]`` logits -> ``[..., Hkv, P]``: per KV head, the max over its query heads
    of the log-softmax over the row's tokens (DESIGN.md: a KV head's score is the max of its
    query heads' probabilities)."""
    return logits.log_softmax(dim=-1).amax(dim=-2)


def layer_token_logits(
    q: torch.Tensor, host_k: torch.Tensor, slots: torch.Tensor, ok: torch.Tensor, scale: float
) -> torch.Tensor:
    """Exact scaled logits ``scale x q . k`` of the given tokens per query head, ``L`` layers at once.

    Args:
        q: ``[L, rows, num_q_heads, head_dim]``.
        host_k: ``[L, host_slots, num_kv_heads, head_dim]`` (contiguous: a slice of the tier).
        slots, ok: ``[L, rows, num_kv_heads, n]`` host slots to score and which are candidates.

    Returns:
        ``[L, rows, num_kv_heads, group, n]`` float32, ``-inf`` where not ``ok``.
    """
    n_layers, r, hkv, n = slots.shape
    hq, d = q.shape[2], q.shape[3]
    base = (torch.arange(n_layers) * host_k.shape[1]).view(n_layers, 1, 1, 1)
    rows_idx = ((slots + base) * hkv + torch.arange(hkv).view(1, 1, hkv, 1)).flatten()
    keys = host_k.reshape(-1, d).index_select(0, rows_idx).view(n_layers, r, hkv, n, d)
    qg = q.float().view(n_layers, r, hkv, hq // hkv, d)
    logits = torch.matmul(qg, keys.float().transpose(-1, -2)).mul_(scale)
    return logits.masked_fill_(~ok.unsqueeze(-2), float("-inf"))


def token_logits(
    q: torch.Tensor, host_k: torch.Tensor, slots: torch.Tensor, ok: torch.Tensor, scale: float
) -> torch.Tensor:
    """Exact scaled logits ``scale x q . k`` of the given tokens, per query head (one layer).

    Args:
        q: ``[rows, num_q_heads, head_dim]``.
        host_k: one layer's host keys, ``[host_slots, num_kv_heads, head_dim]``.
        slots, ok: ``[rows, num_kv_heads, n]`` host slots to score and which are candidates.

    Returns:
        ``[rows, num_kv_heads, group, n]`` float32, ``-inf`` where not ``ok``.
    """
    return layer_token_logits(q[None], host_k[None], slots[None], ok[None], scale)[0]


def token_log_scores(
    q: torch.Tensor, host_k: torch.Tensor, slots: torch.Tensor, ok: torch.Tensor, scale: float
) -> torch.Tensor:
    """Exact GQA scores of the given tokens: log of the max over each KV head's query heads of the
    softmax probability (softmax over the row's ``ok`` tokens).

    Arguments as :func:`token_logits`. Returns ``[rows, num_kv_heads, n]`` float32
    log-probabilities, ``-inf`` where not ``ok``.
    """
    return token_logits(q, host_k, slots, ok, scale).log_softmax(dim=-1).amax(dim=2)
