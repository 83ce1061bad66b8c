"""Selectors: one class per policy; each scores a step's candidate tokens, then takes the top-k.

Interface (every selector, one layer, every row of the step it serves at once)::

    selector.select(q, rows, host_k, k, scale, index, layer) -> (positions, slots)

* ``q``: ``shape: [rows, num_q_heads, head_dim]``: the queries that drive
  selection (the current token's for ``oracle``, ``recency`` and
  ``quest_device``; the speculated token's for ``spec_host`` and
  ``spec_host_exact``).
* ``rows``: :class:`~dd_sglang.prefetch.scoring.RowBlocks`, the rows' candidate
  blocks and positions (host-tier positions outside the resident set); every
  row has more than ``k`` candidates.
* ``host_k``: the layer's host-tier keys, ``shape: [host_slots, num_kv_heads, head_dim]``.
* ``k``: critical-set budget in tokens per KV head (>= 1).
* ``index``: the index the selector reads (``spec_host``:
  :class:`~dd_sglang.prefetch.index.QuantKeyIndex`; ``quest_device``:
  :class:`~dd_sglang.prefetch.index.KeyBlockIndex`) (:attr:`Selector.index_location` says where it lives), else None.
* Result: ``positions`` and host-tier ``slots``, each
  ``shape: [rows, num_kv_heads, k], dtype: torch.int64``, best first.

Policies:

* ``oracle``: exact top-k of the current query over every candidate key, at
  attention time. A reference: it reads every key every step.
* ``recency``: the same scores one step ahead (step t's exact top-k is step
  t+1's set): the zero-state baseline.
* ``spec_host_exact``: exact top-k of the *speculated* token's query over every
  candidate key in the host tier, one step ahead: the reference the default
  is measured against.
* ``spec_host`` (default): the speculated token's query scores every host-tier
  candidate int8 x int8 with the int8 key index (:class:`~dd_sglang.prefetch.index.QuantKeyIndex`,
  host memory) and re-ranks the best ``rerank x k`` with the exact keys. No
  device state.
* ``host_sync``: ``spec_host``'s scoring (int8 host index, exact re-ranking)
  of the *current* query, at attention time: no speculated token rides and no
  prediction can miss, but the set is chosen (and copied) synchronously, in
  front of the layer's attention. For a device where nothing can overlap the
  copy (a CPU) or as the exact-selection reference at the default's cost.
* ``quest_device``: Quest with the current query: block summaries kept on the
  device, the best blocks' tokens (no key read), at attention time.

Every selector reports the device bytes it keeps only to choose critical sets
(DESIGN.md "auxiliary state") through the runner (``dd_selector_aux_bytes``).
"""

from __future__ import annotations

import torch

from dd_sglang.kernels import native as native_kernel
from dd_sglang.prefetch.index import KeyBlockIndex, QuantKeyIndex
from dd_sglang.prefetch.scoring import (
    BLOCK_TOKENS,
    RowBlocks,
    block_scores,
    block_tokens,
    candidate_logits,
    gqa_log_scores,
    layer_token_logits,
)


def gqa_token_scores(query: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """Per-KV-head token scores of one request over the given keys (for benches and tests).

    Args:
        query: ``[num_q_heads, head_dim]``.
        keys: ``[n, num_kv_heads, head_dim]``.
        scale: softmax scale (``head_dim ** -0.5`` for SmolLM2 / Llama).

    Returns:
        ``[num_kv_heads, n]`` float32: per KV head, the max over its query heads of
        ``softmax(scale q . k)`` over the ``n`` keys (the probabilities
        :func:`~dd_sglang.prefetch.scoring.token_log_scores` gives in log space).

    Raises:
        ValueError: ``num_q_heads`` is not a multiple of ``num_kv_heads``.
    """
    hq, d = query.shape
    n, hkv, _ = keys.shape
    if hq % hkv:
        raise ValueError(f"num_q_heads {hq} is not a multiple of num_kv_heads {hkv}")
    logits = torch.einsum("hgd,nhd->hgn", query.float().view(hkv, hq // hkv, d), keys.float()) * scale
    return torch.softmax(logits, dim=-1).amax(dim=1)


def _all_candidates(q: torch.Tensor, rows: RowBlocks, host_k: torch.Tensor, scale: float):
    """Exact scores of every candidate of ``L`` layers: ``(positions, slots, score)``, each
    ``[L, rows, Hkv, P]`` (positions and slots are head- and layer-independent, expanded views)."""
    slots, _ = rows.tokens
    score = gqa_log_scores(candidate_logits(q, host_k, rows, scale))
    shape = score.shape
    pos = torch.arange(shape[-1]).expand(shape)
    return pos, slots[None, :, None, :].expand(shape), score


class Selector:
    """Base class: :meth:`score_layers` ranks candidate tokens, :meth:`select_layers` takes the top-k.

    Both work on ``L`` consecutive layers at once (a leading ``L`` dimension on the queries,
    the keys and the result): a CPU runs the next step's selection a chunk of layers per call
    (:mod:`dd_sglang.prefetch.runner`), where per-layer calls would pay each small
    operation's dispatch once per layer. :meth:`score` / :meth:`select` are the one-layer forms.

    Class attributes:
        name: preset / ``custom_params.dd_selector`` name.
        lookahead: False: the set is chosen at attention time from the current query.
            True: the set for step t+1 is chosen during step t and copied ahead of attention.
        uses_speculator: the selection query is the speculated token's (a second query
            position rides in the batch).
        index_location: ``"host"`` or ``"device"``: where the index it reads lives;
            None: it reads no index.
    """

    name = "base"
    lookahead = False
    uses_speculator = False
    index_location: str | None = None

    def score_layers(
        self, q: torch.Tensor, rows: RowBlocks, host_k: torch.Tensor, k: int, scale: float,
        index: KeyBlockIndex | QuantKeyIndex | None, layers: slice,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """Candidate tokens and their scores for layers ``layers`` (``L`` of them).

        Args:
            q: ``[L, rows, num_q_heads, head_dim]``; host_k: ``[L, host_slots, num_kv_heads, head_dim]``.

        Returns:
            ``(positions, slots, score)``, each ``[L, rows, num_kv_heads, n]`` (score float32,
            ``-inf`` for non-candidates).
        """
        raise NotImplementedError

    def score(
        self, q: torch.Tensor, rows: RowBlocks, host_k: torch.Tensor, k: int, scale: float,
        index: KeyBlockIndex | QuantKeyIndex | None, layer: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """One layer: ``q`` ``[rows, num_q_heads, head_dim]``, ``host_k`` ``[host_slots, Hkv, D]``;
        :meth:`score_layers` without the layer dimension."""
        out = self.score_layers(q[None], rows, host_k[None], k, scale, index, slice(layer, layer + 1))
        return tuple(x[0] for x in out)

    def select_layers(
        self, q: torch.Tensor, rows: RowBlocks, host_k: torch.Tensor, k: int, scale: float,
        index: KeyBlockIndex | QuantKeyIndex | None, layers: slice,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The ``k`` best candidates per layer, row and KV head: ``(positions, slots)``, each
        ``[L, rows, num_kv_heads, k]`` int64, best first (arguments as :meth:`score_layers`).

        ``out``: two ``[L, rows, num_kv_heads, k]`` int64 tensors to write them into (returned).

        Raises:
            ValueError: ``k < 1``, or the selector needs an index and got none.
        """
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if self.index_location is not None and index is None:
            raise ValueError(f"selector {self.name} needs an index ({self.index_location})")
        pos, slots, score = self.score_layers(q, rows, host_k, k, scale, index, layers)
        top = score.topk(k, dim=-1).indices
        if out is None:
            return pos.gather(-1, top), slots.gather(-1, top)
        torch.gather(pos, -1, top, out=out[0])
        torch.gather(slots, -1, top, out=out[1])
        return out

    def bind(self, rows: RowBlocks, host_k: torch.Tensor, k: int, index, q_heads: int):
        """A per-step form of :meth:`select` for one group of rows, called layer after layer with
        the layer's queries (``(q [rows, q_heads, D] float32 contiguous, layer, scale) -> (positions,
        slots)``, each ``[rows, Hkv, k]``), or None where this selector has none (the caller then
        calls :meth:`select`). ``host_k``: every layer's ``[layers, S, Hkv, D]``."""
        return None

    def select(
        self, q: torch.Tensor, rows: RowBlocks, host_k: torch.Tensor, k: int, scale: float,
        index: KeyBlockIndex | QuantKeyIndex | None = None, layer: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The ``k`` best candidates per row and KV head of one layer (module docstring).

        Raises:
            ValueError: ``k < 1``, or the selector needs an index and got none.
        """
        pos, slots = self.select_layers(q[None], rows, host_k[None], k, scale, index, slice(layer, layer + 1))
        return pos[0], slots[0]


class OracleSelector(Selector):
    """Exact top-k of the current query over every candidate key (reads every key: a reference)."""

    name = "oracle"

    def score_layers(self, q, rows, host_k, k, scale, index, layers):
        return _all_candidates(q, rows, host_k, scale)


class RecencySelector(OracleSelector):
    """Step t's exact top-k (current query) becomes step t+1's set: zero state, DESIGN.md's baseline."""

    name = "recency"
    lookahead = True


class SpecHostExactSelector(OracleSelector):
    """Exact top-k of the speculated token's query over every host-tier candidate key, one step ahead.

    The reference for :class:`SpecHostSelector`: same query, no index, every key read.
    """

    name = "spec_host_exact"
    lookahead = True
    uses_speculator = True


class SpecHostSelector(Selector):
    """The speculated token's query over the host tier's int8 key index, then exact re-ranking (the default).

    Every candidate is scored int8 x int8 (the query heads quantised like the keys:
    :meth:`~dd_sglang.prefetch.index.QuantKeyIndex.candidate_logits`, one GEMM per run of
    host slots, every KV head at once); the ``m = ceil(rerank x k)`` best per KV head, by the
    max over the GQA group of the approximate softmax probability, are read from the host
    tier and scored exactly; the top-k of those is the set. Each query head's softmax
    normaliser is exact over those ``m`` tokens and approximate over the rest, so the exact
    re-ranked scores compare across the group as the exact selector's do. Key bytes read
    per layer: ``n x Hkv x (head_dim + 4)`` int8 and scales plus ``m`` exact keys per KV
    head, instead of ``n x Hkv`` exact keys. The index lives in host memory: no device bytes.

    With ``native`` the whole selection (scores, top-``m``, re-ranking, top-k) runs in the C
    kernel (:func:`dd_sglang.kernels.native.spec_host_select`), one task per layer and row, no
    intermediate tensors; it chooses the same sets (``tests/test_native_select.py``). Shapes it
    does not take (``m`` at least the padded candidate count) use the PyTorch path.

    With ``first_level_tokens`` the selection is two-level (C kernel only): each row's
    candidates are first cut to the tokens of its KV heads' best ``first_level_tokens / 16``
    16-token blocks, ranked by the index's block means
    (:attr:`~dd_sglang.prefetch.index.QuantKeyIndex.block_means`), then selected as above; a call
    whose ``rerank x k`` exceeds the budget less 32 tokens scans every candidate.

    Args:
        rerank: ``rerank x k`` tokens are re-ranked exactly (>= 1).
        native: use the C kernel (the caller checked :func:`dd_sglang.kernels.native.available`).
        first_level_tokens: the first level's budget in tokens per KV head (``experimental.first_level_tokens``),
            or None: every candidate.

    Raises:
        ValueError: ``rerank < 1``; ``first_level_tokens`` below 64, or given without ``native``
            (the PyTorch path has no first level).
    """

    name = "spec_host"
    lookahead = True
    uses_speculator = True
    index_location = "host"

    def __init__(self, rerank: float = 2.0, native: bool = False, first_level_tokens: int | None = None):
        if rerank < 1:
            raise ValueError(f"prefetch.rerank must be >= 1, got {rerank}")
        if first_level_tokens is not None and (first_level_tokens < 64 or not native):
            raise ValueError("experimental.first_level_tokens must be >= 64 and needs the CPU selection kernel "
                             f"(experimental.kernel native or auto where it builds); got {first_level_tokens}, "
                             f"kernel {'native' if native else 'torch'}")  # fmt: skip
        self.rerank = rerank
        self.native = native
        self.first_level_tokens = first_level_tokens

    def _pages(self, index, layers: slice, m: int) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """The C kernel's first-level arguments for ``layers`` (None: the full scan)."""
        budget = self.first_level_tokens
        if budget is None or index.block_means is None or m > budget - 32:
            return None
        means, scales = index.block_means
        return means[layers], scales[layers], budget // BLOCK_TOKENS

    def _m(self, k: int) -> int:
        return int(-(-self.rerank * k // 1))

    def bind(self, rows, host_k, k, index, q_heads):
        """The C kernel's selection bound for a step (:class:`~dd_sglang.kernels.native.LayerSelection`:
        the same sets as :meth:`select`, without its per-call conversions), or None where
        :meth:`select_layers` would take the PyTorch path."""
        if k < 1 or not self._kernel_takes(rows, index, k, q_heads, host_k.shape[3]):
            return None
        slots, ok = rows.tokens
        m = self._m(k)
        pages = self._pages(index, slice(0, host_k.shape[0]), m)
        return native_kernel.LayerSelection(slots, ok, index.q8, index.scale, host_k, k, m, q_heads, pages)

    def _kernel_takes(self, rows, index, k: int, q_heads: int, head_dim: int) -> bool:
        """Whether the C kernel selects (else the PyTorch path): built, an index, fewer re-ranked than
        the rows' candidate positions (else every candidate is scored exactly), a shape it takes."""
        return (self.native and index is not None and self._m(k) < rows.tokens[0].shape[-1]
                and q_heads <= native_kernel.MAX_QUERIES and head_dim <= native_kernel.MAX_HEAD_DIM)

    def select_layers(self, q, rows, host_k, k, scale, index, layers, out=None):
        if not self._kernel_takes(rows, index, k, q.shape[2], q.shape[3]):
            return super().select_layers(q, rows, host_k, k, scale, index, layers, out)
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        slots, ok = rows.tokens
        m = self._m(k)
        return native_kernel.spec_host_select(q.float(), slots, ok, index.q8[layers], index.scale[layers],
                                              host_k, k, m, scale, out, self._pages(index, layers, m))  # fmt: skip

    def score_layers(self, q, rows, host_k, k, scale, index, layers):
        slots, ok = rows.tokens
        m = self._m(k)
        if m >= slots.shape[-1]:
            return _all_candidates(q, rows, host_k, scale)
        approx = index.candidate_logits(q, layers, rows, scale)  # [L, R, Hkv, group, P]
        nl, r, hkv, g, p = approx.shape
        z = torch.logsumexp(approx, dim=-1, keepdim=True)
        pos = (approx - z).amax(dim=3).topk(m, dim=-1, sorted=False).indices  # re-ranked below: any order
        slots = slots[None, :, None, :].expand(nl, r, hkv, p).gather(-1, pos)  # index = position
        ok = ok[None, :, None, :].expand(nl, r, hkv, p).gather(-1, pos)
        exact = layer_token_logits(q, host_k, slots, ok, scale)  # [L, R, Hkv, group, m]
        # Each query head's softmax normaliser: exact over the re-ranked tokens (most of the mass),
        # approximate over the rest, so heads of a group compare as under exact scoring.
        taken = (approx.gather(-1, pos.unsqueeze(3).expand(nl, r, hkv, g, m)) - z).exp_().sum(-1, keepdim=True)
        rest = z + torch.log1p(-taken.clamp_(max=1.0))  # approximate lse over the tokens not re-ranked
        z = torch.logaddexp(torch.logsumexp(exact, dim=-1, keepdim=True), rest)
        return pos, slots, (exact - z).amax(dim=3)


class HostSyncSelector(SpecHostSelector):
    """:class:`SpecHostSelector`'s scoring of the current token's query at attention time.

    The same int8 host-tier index and exact re-ranking of the best ``rerank x k`` (same C
    kernel), driven by the real query of the step being computed instead of a speculated one:
    no token rides, nothing is verified, and the set's recall against the exact top-k is the
    index's (``bench.index_recall``: 0.999 at k 256, 4k and 7.9k tokens). The cost is the
    schedule: the set is known only once the layer's query is, so its selection and copy sit
    in front of the layer's attention, with nothing to overlap them. The index lives in host
    memory: no device bytes. Verification (:mod:`dd_sglang.prefetch.verify`) makes every lookahead row attend this selector's set.
    """

    name = "host_sync"
    lookahead = False
    uses_speculator = False


class QuestDeviceSelector(Selector):
    """Quest (current query, block min/max summaries kept on the device): the device-state baseline.

    The best ``ceil((k + holes) / 16)`` blocks by their bound give the set: their candidate
    tokens, best block first, no key read. Device bytes: the index, 1/16 of the host tier's
    bytes (Quest's "6.25% of KV" counts K only; this holds min and max).
    """

    name = "quest_device"
    index_location = "device"

    def score_layers(self, q, rows, host_k, k, scale, index, layers):
        out = [self._score_layer(q[i], rows, k, scale, index, layer)
               for i, layer in enumerate(range(layers.start, layers.stop))]  # fmt: skip
        return tuple(torch.stack(x) for x in zip(*out, strict=True))

    def _score_layer(self, q, rows, k, scale, index, layer):
        n_blocks = rows.blocks.shape[1]
        m = min(n_blocks, -(-(k + rows.holes) // BLOCK_TOKENS))
        bscore = block_scores(q, rows, index.mins[layer], index.maxs[layer], scale)
        chosen = bscore.topk(m, dim=-1).indices
        pos, slots, ok = block_tokens(rows, chosen)
        score = bscore.gather(-1, chosen).repeat_interleave(BLOCK_TOKENS, dim=-1)
        return pos, slots, score.masked_fill(~ok, float("-inf"))


#: Selector classes by preset name.
SELECTORS: dict[str, type[Selector]] = {
    s.name: s
    for s in (SpecHostSelector, SpecHostExactSelector, OracleSelector, RecencySelector, QuestDeviceSelector,
              HostSyncSelector)
}


def make_selector(name: str, rerank: float = 2.0, native: bool = False,
                  first_level_tokens: int | None = None) -> Selector:  # fmt: skip
    """Instantiate a selector by name (``rerank``, ``native`` and ``first_level_tokens`` apply to
    ``spec_host`` and ``host_sync``: :class:`SpecHostSelector`).

    Raises:
        ValueError: unknown name (the message lists the known ones); a first level the selector
            refuses (:class:`SpecHostSelector`).
    """
    cls = SELECTORS.get(name)
    if cls is None:
        raise ValueError(f"selector must be one of {sorted(SELECTORS)}, got {name!r}")
    return cls(rerank, native, first_level_tokens) if issubclass(cls, SpecHostSelector) else cls()
