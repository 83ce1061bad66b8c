"""Selectors: score a request's candidate tokens for one query and return its critical set.

Interface (every selector, one layer at a time)::

    selector.select(queries, locations, k, host_keys, scale) -> CriticalSet

* ``queries``: ``shape: [num_reqs, num_q_heads, head_dim]``, the queries that
  drive selection (the current token's for ``oracle``; a speculated token's
  for the predictive selectors of the prediction issue).
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

    def select(
        self,
        queries: torch.Tensor,
        locations: list[torch.Tensor],
        k: int,
        host_keys: torch.Tensor,
        scale: float,
    ) -> CriticalSet:
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

    def select(
        self,
        queries: torch.Tensor,
        locations: list[torch.Tensor],
        k: int,
        host_keys: torch.Tensor,
        scale: float,
    ) -> CriticalSet:
        """See the module docstring. Raises ``ValueError`` on bad shapes or ``k < 1``."""
        _check(queries, locations, k, host_keys)
        hkv = host_keys.shape[1]
        positions = torch.zeros(len(locations), hkv, k, dtype=torch.int64)
        lengths = torch.zeros(len(locations), hkv, dtype=torch.int64)
        for r, loc in enumerate(locations):
            kt = host_keys.index_select(0, loc)  # every candidate key: the oracle reads them all
            scores = gqa_token_scores(queries[r], kt, scale)
            n = min(k, kt.shape[0])
            positions[r, :, :n] = scores.topk(n, dim=-1).indices
            lengths[r] = n
        return CriticalSet(positions, lengths)

    def device_aux_bytes(self) -> int:
        return 0


class RecencySelector(OracleSelector):
    """One step ahead, zero state: step t+1 attends to step t's exact top-k (DESIGN.md's baseline).

    During step t the backend scores step t's query against the host-tier keys
    (exact, as :class:`OracleSelector`) and stores the top-k as the critical set
    of step t+1 (``lookahead``): the indices for step t+1 are fixed one step
    ahead, so their K/V can be copied before step t+1 needs it. Positions that
    enter the host tier between the two steps are not in it. A request's first
    sparse step has nothing stored yet and selects from its current query (a
    cold start). Keeps no device state (:meth:`device_aux_bytes` is 0).

    This is also what ``spec_host`` degenerates to without a speculated token
    (the ``none`` speculator): the speculators of the prediction issue replace
    step t's query by a speculated token's query for step t+1.
    """

    name = "recency"
    lookahead = True


#: Selectors by preset name. The prediction issue adds spec_host and quest_device.
SELECTORS: dict[str, type[Selector]] = {
    OracleSelector.name: OracleSelector,
    RecencySelector.name: RecencySelector,
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
