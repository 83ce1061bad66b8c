"""Selectors: score a request's candidate tokens for one query and return its critical set.

Interface (every selector, one layer at a time)::

    selector.select(queries, locations, k, host_keys, scale) -> CriticalSet

* ``queries``: ``shape: [num_reqs, num_q_heads, head_dim]``, the queries that
  drive selection (the current token's for ``oracle``; a speculated token's
  for the lookahead selectors).
* ``locations``: one tensor per request, ``shape: [n_r], dtype: torch.int64``,
  the host-tier slots of the request's candidate tokens (its host-tier tokens
  outside the resident set), in position order.
* ``k``: critical-set budget in tokens (>= 1).
* ``host_keys``: the layer's host-tier key buffer,
  ``shape: [host_slots, num_kv_heads, head_dim]`` (``HostSparseKVPool.k[layer]``).
* ``scale``: softmax scale.
* Result: :class:`CriticalSet` with ``positions``
  ``shape: [num_reqs, num_kv_heads, k], dtype: torch.int64`` (indices into each
  request's ``locations``, best first) and ``lengths`` ``[num_reqs, num_kv_heads]``
  (``min(k, n_r)``; entries past it are padding 0).

Scores follow DESIGN.md ("Measuring the prefetch hit rate honestly"): a KV
head's score for a token is the **max over its query heads** (GQA group
``h // (Hq // Hkv)``) of their softmax probabilities. Softmax runs over the
request's whole context, so scores are comparable across the group's heads.

Every selector reports :meth:`Selector.device_aux_bytes`, the device bytes it
keeps only to choose critical sets (DESIGN.md "auxiliary state").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CriticalSet:
    """Per request and KV head: the selected token positions, best first.

    ``positions``: ``[num_reqs, num_kv_heads, k]`` int64; ``lengths``: ``[num_reqs, num_kv_heads]`` int64.
    """

    positions: torch.Tensor
    lengths: torch.Tensor

    def as_sets(self, req: int, head: int) -> set[int]:
        """The valid positions of one (request, KV head) as a Python set."""
        return set(self.positions[req, head, : int(self.lengths[req, head])].tolist())


def gqa_token_scores(query: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """Per-KV-head token scores for one request.

    Args:
        query: ``[num_q_heads, head_dim]``.
        keys: ``[context_len, num_kv_heads, head_dim]``.
        scale: softmax scale (``head_dim ** -0.5`` for SmolLM2 / Llama).

    Returns:
        ``[num_kv_heads, context_len]`` float32: for each KV head, the max over its
        query heads of softmax(scale * q . k) over the whole context.
    """
    hq, d = query.shape
    n, hkv, _ = keys.shape
    if hq % hkv:
        raise ValueError(f"num_q_heads {hq} is not a multiple of num_kv_heads {hkv}")
    qg = query.float().view(hkv, hq // hkv, d)
    logits = torch.einsum("hgd,nhd->hgn", qg, keys.float()) * scale
    return torch.softmax(logits, dim=-1).amax(dim=1)


def _check(queries: torch.Tensor, locations: list[torch.Tensor], k: int, host_keys: torch.Tensor) -> None:
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if queries.dim() != 3 or len(locations) != queries.shape[0]:
        raise ValueError(f"queries must be [num_reqs, num_q_heads, head_dim] with one locations tensor per "
                         f"request; got {tuple(queries.shape)} and {len(locations)} locations tensors")  # fmt: skip
    if host_keys.dim() != 3 or host_keys.shape[2] != queries.shape[2]:
        raise ValueError(
            f"host_keys must be [host_slots, num_kv_heads, {queries.shape[2]}], got {tuple(host_keys.shape)}"
        )
    for i, loc in enumerate(locations):
        if loc.dim() != 1 or loc.numel() < 1:
            raise ValueError(f"locations[{i}] must be [n >= 1] host slots, got {tuple(loc.shape)}")


class Selector:
    """Base class. Subclasses implement :meth:`select` and :meth:`device_aux_bytes`.

    ``lookahead``: False (``oracle``): the set is chosen at attention time from the
    current query. True: the set for step t+1 is fixed during step t and step t+1
    attends to it as prefetched; the backend records how much of step t+1's exact
    top-k it held (the prefetch hit rate).
    """

    name = "base"
    lookahead = False
    uses_speculator = False

    def select(
        self,
        queries: torch.Tensor,
        locations: list[torch.Tensor],
        k: int,
        host_keys: torch.Tensor,
        scale: float,
    ) -> CriticalSet:
        """See the module docstring: each request's candidates ranked by :meth:`_rank`.

        Raises ``ValueError`` on bad shapes or ``k < 1``.
        """
        _check(queries, locations, k, host_keys)
        hkv = host_keys.shape[1]
        positions = torch.zeros(len(locations), hkv, k, dtype=torch.int64)
        lengths = torch.zeros(len(locations), hkv, dtype=torch.int64)
        for r, loc in enumerate(locations):
            ranked = self._rank(queries[r], host_keys.index_select(0, loc), k, scale)
            positions[r, :, : ranked.shape[1]] = ranked
            lengths[r] = ranked.shape[1]
        return CriticalSet(positions, lengths)

    def _rank(self, query: torch.Tensor, keys: torch.Tensor, k: int, scale: float) -> torch.Tensor:
        """``[Hkv, min(k, n)]`` indices into ``keys`` (``[n, Hkv, D]``) for ``query`` (``[Hq, D]``)."""
        raise NotImplementedError

    def device_aux_bytes(self) -> int:
        """Device bytes held only to choose critical sets."""
        raise NotImplementedError


class OracleSelector(Selector):
    """Exact top-k by :func:`gqa_token_scores` over every key: an upper bound for evaluation.

    It reads every key of every request each step (no device-resident state,
    but a full pass over the host tier), so it is a reference, not a product path.
    """

    name = "oracle"

    def _rank(self, query: torch.Tensor, keys: torch.Tensor, k: int, scale: float) -> torch.Tensor:
        """Exact top-k, best first: every candidate key is read."""
        return gqa_token_scores(query, keys, scale).topk(min(k, keys.shape[0]), dim=-1).indices

    def device_aux_bytes(self) -> int:
        return 0


class RecencySelector(OracleSelector):
    """One step ahead, zero state: step t+1 attends to step t's exact top-k (DESIGN.md's baseline).

    During step t the backend scores step t's query against the host-tier keys
    (exact, as :class:`OracleSelector`, on the schedule's select worker) and
    stores the top-k as the critical set of step t+1 (``lookahead``): the indices
    for step t+1 are fixed one step ahead, so their K/V is copied while step
    t+1's earlier layers compute. Positions that enter the host tier between the
    two steps are not in it. A request's first sparse step has nothing stored
    yet and selects from its current query (a cold start). Ignores the
    speculator. Keeps no device state (:meth:`device_aux_bytes` is 0).
    """

    name = "recency"
    lookahead = True
    uses_speculator = False


class SpecHostSelector(OracleSelector):
    """One step ahead from the speculated token: exact scores of its query against host-tier keys.

    During step t, layer l, the second query position (the speculated token
    ``x̂_{t+1}``, :mod:`dd_sglang.prefetch.speculators`) is scored against every
    candidate key *in the host tier* (full keys, the same GQA max-over-group
    softmax as :class:`OracleSelector`), on the schedule's select worker, off
    the forward thread; the top-k becomes step t+1's critical set for layer l.
    Without a speculated token (speculator ``none``, or no proposal this step) it
    scores the current query, which makes it :class:`RecencySelector`.

    It scores full host keys, not page summaries: the host tier holds them
    anyway, so exactness costs host compute only (off the forward thread), and
    the recall lost to summaries is what ``quest_device`` measures beside it
    (``bench/prefetch.py``). No byte of selection state lives on the device:
    :meth:`device_aux_bytes` is 0; the index lists it returns are the only thing
    the device sees.
    """

    name = "spec_host"
    lookahead = True
    uses_speculator = True


def quest_page_summaries(keys: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quest's per-page key summaries (Tang et al., "Quest", ICML 2024, section 3).

    Args:
        keys: ``[n, num_kv_heads, head_dim]``, a request's candidate keys in position order.
        page_size: tokens per page; pages are consecutive runs of ``page_size`` candidates (the
            last may be partial).

    Returns:
        ``(mins, maxs)``, each ``[ceil(n / page_size), num_kv_heads, head_dim]`` in ``keys.dtype``:
        the element-wise min and max of each page's keys.
    """
    n, hkv, d = keys.shape
    n_pages = -(-n // page_size)
    pad = n_pages * page_size - n
    k = keys
    if pad:
        k = torch.cat([keys, keys[-1:].expand(pad, hkv, d)])  # repeating a real key leaves min/max unchanged
    k = k.view(n_pages, page_size, hkv, d)
    return k.amin(dim=1), k.amax(dim=1)


def quest_select(query: torch.Tensor, mins: torch.Tensor, maxs: torch.Tensor, n: int, k: int,
                 page_size: int) -> torch.Tensor:  # fmt: skip
    """Quest's selection: pages by their upper-bound score, then their tokens, ``k`` per KV head.

    A page's score for query head ``h`` is ``sum_d max(q_d * min_d, q_d * max_d)`` (an upper
    bound of ``q . k`` over the page, Quest eq. 1); a KV head takes the max over its GQA group.

    Args:
        query: ``[num_q_heads, head_dim]``.
        mins, maxs: ``[n_pages, num_kv_heads, head_dim]`` (:func:`quest_page_summaries`).
        n: number of candidates (``k < n``).
        k: tokens per KV head.
        page_size: tokens per page.

    Returns:
        ``[num_kv_heads, k]`` int64 candidate indices: the best pages' tokens, page by page.
    """
    hq, d = query.shape
    n_pages, hkv, _ = mins.shape
    qg = query.float().view(hkv, hq // hkv, 1, d)
    lo = mins.float().permute(1, 0, 2).unsqueeze(1)  # [Hkv, 1, P, D]
    hi = maxs.float().permute(1, 0, 2).unsqueeze(1)
    score = torch.maximum(qg * lo, qg * hi).sum(-1).amax(dim=1)  # [Hkv, P]
    order = score.argsort(dim=1, descending=True)
    tok = (order.unsqueeze(-1) * page_size + torch.arange(page_size, device=order.device)).reshape(hkv, -1)
    return tok[tok < n].view(hkv, n)[:, :k]


class QuestDeviceSelector(Selector):
    """Quest (current query, page min/max key summaries kept on the device): the device-state baseline.

    Per request and layer the backend keeps :func:`quest_page_summaries` of the
    candidate keys on the device and extends them as pages are flushed to the
    host tier; at attention time the current query picks pages with
    :func:`quest_select` and their tokens are gathered synchronously (no
    lookahead). Device-resident auxiliary bytes per request and layer:
    ``2 x n_pages x num_kv_heads x head_dim x dtype`` (Quest's "6.25% of KV" at
    page 16 for K only; here ``2 / page_size`` of the K bytes), reported by
    :meth:`device_aux_bytes` from the summaries actually held.
    """

    name = "quest_device"
    lookahead = False

    #: Quest's page size (tokens per summary), the paper's default.
    PAGE_SIZE = 16

    def __init__(self, page_size: int = PAGE_SIZE):
        self.page_size = page_size
        self.held_bytes = 0

    def _rank(self, query: torch.Tensor, keys: torch.Tensor, k: int, scale: float) -> torch.Tensor:
        """Every candidate when ``n <= k``; else :func:`quest_select` over summaries built on the fly
        (the backend keeps them per request instead)."""
        n, hkv, _ = keys.shape
        if n <= k:
            return torch.arange(n).expand(hkv, n)
        mins, maxs = quest_page_summaries(keys, self.page_size)
        return quest_select(query, mins, maxs, n, k, self.page_size)

    def device_aux_bytes(self) -> int:
        return self.held_bytes


#: Selectors by preset name.
SELECTORS: dict[str, type[Selector]] = {
    s.name: s for s in (OracleSelector, SpecHostSelector, QuestDeviceSelector, RecencySelector)
}


def make_selector(name: str) -> Selector:
    """Instantiate a selector by name.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    try:
        return SELECTORS[name]()
    except KeyError:
        raise ValueError(f"selector must be one of {sorted(SELECTORS)}, got {name!r}") from None
