"""Key indexes of the host tier, and the batched scoring every selector uses.

**Quantised key index** (``spec_host``). :class:`QuantKeyIndex` keeps an int8
copy of every host-tier key, one absmax scale per token, layer and KV head
(float32), in host memory: ``num_layers x host_slots x num_kv_heads x
(head_dim + 4)`` bytes, 68/256 of a bfloat16 tier's K+V bytes (68/512 of a
float32 one). A selection quantises the query heads too and scores every
candidate with one int8 x int8 GEMM per row (a quarter of a float32 key's
bytes, half of a bfloat16 one's), then re-ranks the best ``rerank x k`` with
the exact keys. Measured on SmolLM2 (``bench/index_recall.py``,
``bench/results/index_recall_cpu.json``): at 4k and 7.9k tokens and k 256
the re-ranked set holds 0.999 of the exact top 256.

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

**Block index** (``quest_device``). :class:`KeyBlockIndex` keeps, per layer, the element-wise min and
max of the keys of every block of :data:`BLOCK_TOKENS` consecutive host-tier
slots (Quest's page summaries: Tang et al., "Quest", ICML 2024, section 3),
``shape: [num_layers, num_blocks, num_kv_heads, head_dim]`` each, in the host
tier's dtype. The host tier allocates whole pages of ``sparse.page_size``
contiguous slots (a multiple of the block size), so block ``b`` is slots
``[16 b, 16 b + 16)`` and holds 16 consecutive positions of one request. A
request's blocks are summarised when its KV reaches the host tier (offload,
then each page flush): :meth:`KeyBlockIndex.update`. Where it lives decides
what it costs: in host memory (``spec_host``) it is host bytes and no device
state; on the device (``quest_device``) it is auxiliary device state.
Bytes: ``2 x num_layers x (host_slots / 16) x num_kv_heads x head_dim x
itemsize`` = 1/16 of the host tier's bytes.

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
from dataclasses import dataclass
from functools import cached_property

import torch

from dd_sglang.kernels import native as native_kernel
from dd_sglang.kvcache.host_memory import host_zeros

#: Tokens summarised by one index entry (Quest's default page size).
BLOCK_TOKENS = 16
#: A row split over more host-tier runs than this is scored from one gather instead of a GEMM
#: per run (a fragmented tier: per-call overhead would then exceed the gather's copy).
MAX_RUNS = 16


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros on ``device``; in host memory, on huge pages (:func:`~dd_sglang.kvcache.host_memory.host_zeros`)."""
    if device.type == "cpu":
        return host_zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


class KeyBlockIndex:
    """Min/max key summaries of every 16-slot block of a host tier (module docstring).

    Args:
        host_k: the host tier's keys, ``shape: [num_layers, host_slots, num_kv_heads, head_dim]``
            (``HostSparseKVPool.k``); ``host_slots`` a multiple of :data:`BLOCK_TOKENS`.
        device: where the summaries live (``"cpu"``: host memory).

    Raises:
        ValueError: ``host_slots`` is not a multiple of :data:`BLOCK_TOKENS`.
    """

    def __init__(self, host_k: torch.Tensor, device: torch.device | str = "cpu"):
        n_layers, slots, hkv, d = host_k.shape
        if slots % BLOCK_TOKENS:
            raise ValueError(f"host tier slots ({slots}) must be a multiple of {BLOCK_TOKENS}")
        self.host_k = host_k
        self.device = torch.device(device)
        shape = (n_layers, slots // BLOCK_TOKENS, hkv, d)
        self.mins = _zeros(shape, host_k.dtype, self.device)
        self.maxs = _zeros(shape, host_k.dtype, self.device)

    @property
    def nbytes(self) -> int:
        """Bytes of the summaries (both tensors, every layer)."""
        return self.mins.nbytes + self.maxs.nbytes

    def update(self, host_slots: torch.Tensor, start: int, end: int) -> None:
        """Summarise positions ``[start, end)`` of one request, every layer.

        Whole blocks are recomputed (the block holding ``start`` may have been summarised
        partially before); a last partial block is summarised over its valid positions.

        Args:
            host_slots: ``[>= end]`` int64, the request's host slot per position.
            start, end: positions, ``0 <= start < end``.

        Raises:
            ValueError: the positions' slots are not whole contiguous aligned blocks (the host
                tier's page layout guarantees they are).
        """
        b = BLOCK_TOKENS
        first = start // b
        pos = torch.arange(first * b, -(-end // b) * b).clamp_(max=end - 1)
        slots = host_slots[pos].view(-1, b)
        base = host_slots[pos[::b]]
        full = pos.view(-1, b)[:, -1] < end - 1  # blocks without a clamped (repeated) position
        expect = base.unsqueeze(1) + torch.arange(b)
        if base.remainder(b).any() or not torch.equal(slots[full], expect[full]):
            raise ValueError("host slots are not contiguous 16-aligned blocks; the block index needs them")
        keys = self.host_k[:, slots.flatten()]  # [L, n, Hkv, D]
        keys = keys.view(keys.shape[0], -1, b, *keys.shape[2:])
        blocks = (base // b).to(self.device)
        self.mins[:, blocks] = keys.amin(dim=2).to(self.device)
        self.maxs[:, blocks] = keys.amax(dim=2).to(self.device)


#: :meth:`QuantKeyIndex.update`: largest float32 temporary of one chunk of positions (bytes).
UPDATE_CHUNK_BYTES = 32 << 20


class QuantKeyIndex:
    """Int8 copy of the host tier's keys with per-token absmax scales (module docstring).

    ``q8[l, s, h] = round(k / scale[l, s, h])``, ``scale = max |k| / 127`` over ``head_dim``, so
    ``q . k ~= scale x (q . q8)``.

    Args:
        host_k: the host tier's keys, ``[num_layers, host_slots, num_kv_heads, head_dim]``.
        device: where the copy lives (``"cpu"``: host memory).
        native: quantise with the C kernel (:func:`dd_sglang.kernels.native.quantize_keys`, the
            same bytes in one pass) where the keys and the copy are contiguous in host memory.
    """

    def __init__(self, host_k: torch.Tensor, device: torch.device | str = "cpu", native: bool = False):
        n_layers, slots, hkv, d = host_k.shape
        self.host_k = host_k
        self.device = torch.device(device)
        self.native = (native and host_k.device.type == "cpu" and self.device.type == "cpu"
                       and host_k.is_contiguous())  # fmt: skip
        self.q8 = _zeros((n_layers, slots, hkv, d), torch.int8, self.device)
        self.scale = _zeros((n_layers, slots, hkv), torch.float32, self.device)

    @property
    def nbytes(self) -> int:
        """Bytes of the int8 keys and their scales (every layer)."""
        return self.q8.nbytes + self.scale.nbytes

    def update(self, host_slots: torch.Tensor, start: int, end: int) -> None:
        """Quantise positions ``[start, end)`` of one request, layer by layer.

        Args:
            host_slots: ``[>= end]`` int64, the request's host slot per position.
            start, end: positions, ``0 <= start < end``.
        """
        all_slots = host_slots[start:end].to(self.host_k.device)
        if self.native:
            native_kernel.quantize_keys(self.host_k, all_slots, self.q8, self.scale)
            return
        n_layers, _, hkv, d = self.host_k.shape
        # Every layer at once (a handful of operations, not ten a layer), in chunks of positions
        # whose float32 keys [L, n, Hkv, D] stay within UPDATE_CHUNK_BYTES (a whole prompt's
        # offload would otherwise make one temporary of its every layer's keys).
        step = max(1, UPDATE_CHUNK_BYTES // (n_layers * hkv * d * 4))
        for i in range(0, all_slots.numel(), step):
            slots = all_slots[i : i + step]
            dst = slots.to(self.device)
            keys = self.host_k.index_select(1, slots).float()
            s = keys.abs().amax(dim=-1).clamp_(min=1e-12).div_(127.0)
            self.q8[:, dst] = keys.div_(s.unsqueeze(-1)).round_().clamp_(-127, 127).to(torch.int8).to(self.device)
            self.scale[:, dst] = s.to(self.device)

    def candidate_logits(self, q: torch.Tensor, layers: slice, rows: RowBlocks, scale: float) -> torch.Tensor:
        """Approximate logits of every candidate token of every row, int8 x int8, ``L`` layers at once.

        The queries are quantised too (one absmax scale per query head, as the keys per token
        and KV head), so the product is an int8 GEMM (:func:`int8_matmul`) over whole int8
        token rows, every KV head at once, read in place (:func:`token_products`): ``Hkv x D``
        bytes per token and no conversion of the keys. ``q . k ~= s_q x s_k x (q8 . k8)``;
        each factor's rounding error is at most half a step (1/254 of its absmax), which the
        exact re-ranking of the best ``rerank x k`` absorbs.

        Args:
            q: ``[L, rows, num_q_heads, head_dim]``.
            layers: the ``L`` consecutive layers (``slice(l0, l0 + L)``).
            rows: the rows' candidates (:attr:`RowBlocks.tokens`, :attr:`RowBlocks.runs`).

        Returns:
            ``[L, rows, num_kv_heads, group, P]`` float32, ``-inf`` where not a candidate.
        """
        slots, ok = rows.tokens
        r, p = slots.shape
        _, _, hkv, d = self.q8.shape
        n_layers, g = q.shape[0], q.shape[2] // hkv
        qf = q.to(self.device, torch.float32).view(n_layers, r, hkv, g, d)
        qs = qf.abs().amax(dim=-1, keepdim=True).clamp_(min=1e-12).div_(127.0)  # [L, R, Hkv, G, 1]
        w = block_diagonal(qf.div(qs).round_().to(torch.int8))
        q8 = self.q8[layers].view(n_layers, -1, hkv * d)
        prod = token_products(q8, rows, w, int8_matmul, torch.int32)  # [L, R, P, Hkv x G]
        out = prod.transpose(2, 3).to(torch.float32, memory_format=torch.contiguous_format)
        out = out.view(n_layers, r, hkv, g, p)
        ks = token_rows(self.scale[layers], rows)  # [L, R, P, Hkv]
        out.mul_(ks.transpose(2, 3).unsqueeze(3)).mul_(qs.mul_(scale))
        return out.masked_fill_(~ok.to(self.device).view(1, r, 1, 1, p), float("-inf")).cpu()


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


def block_scores(q: torch.Tensor, rows: RowBlocks, index: KeyBlockIndex, layer: int, scale: float) -> torch.Tensor:
    """Per KV head, each block's bound as a log-probability bound, maxed over the GQA group.

    Per query head, ``bound - logsumexp_b(bound_b + log 16)``: the block's scaled bound less an
    estimate of the head's softmax normaliser (every block standing for 16 tokens at its bound),
    so blocks compare across the group's heads as the token scores do (max over the group of
    softmax probabilities).

    ``q``: ``[rows, num_q_heads, head_dim]``. Returns ``[rows, num_kv_heads, blocks]`` float32,
    ``-inf`` for blocks without candidates.
    """
    blocks = rows.blocks.to(index.device)
    mins, maxs = index.mins[layer][blocks], index.maxs[layer][blocks]  # [R, B, Hkv, D]
    r, hq, d = q.shape
    hkv = mins.shape[2]
    ub = block_bounds(q.to(index.device).float().view(r, hkv, hq // hkv, d), mins, maxs) * scale
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
