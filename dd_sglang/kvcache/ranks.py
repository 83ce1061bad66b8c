"""Which data- and tensor-parallel rank a scheduler process is, and its share of the host tier.

SGLang starts one scheduler process per (DP rank, TP rank): ``--dp-size N``
runs N independent replicas, each with its own device KV pool, radix tree and
scheduler (``managers/data_parallel_controller.py`` dispatches each request to
one of them); ``--tp-size M`` splits every replica's attention heads over M
processes, each holding ``num_kv_heads / M`` KV heads of every token in its
own KV pool (``MHATokenToKVPool.head_num`` is already the rank-local count).

dd_sglang follows that layout without any cross-rank state:

* every scheduler process builds its own :class:`~dd_sglang.kvcache.sparse_runtime.SparseRuntime`
  (host tier, DualPath states, host prefix entries) over its own device pool,
  so the host tier of a TP rank holds exactly that rank's KV heads, and the
  selectors choose critical sets per local KV head;
* ``sparse.host_tier_bytes`` is the host-tier budget of the whole server:
  :func:`host_tier_share` gives each of the ``dp_size x tp_size`` processes an
  equal share. Because a TP rank's bytes per token are ``1 / tp_size`` of the
  whole model's, each DP replica then holds ``host_tier_bytes / dp_size /
  bytes_per_token`` tokens, and the launcher's host-memory check
  (``host_tier_bytes`` against available memory) stays exact.

:func:`current_ranks` reads the ranks from SGLang's runtime context
(``sglang.srt.runtime_context.get_parallel``), published in each scheduler
process before the tree cache is built.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankInfo:
    """Ranks of one SGLang scheduler process. Sizes are >= 1, ranks in ``[0, size)``.

    Attributes:
        dp_rank: data-parallel replica (0 without ``--dp-size``).
        dp_size: number of replicas (``--dp-size``).
        tp_rank: tensor-parallel rank inside the replica.
        tp_size: ``--tp-size``.
        attn_tp_rank: attention tensor-parallel rank (equals ``tp_rank`` without DP attention);
            request-level counts (DualPath states, transitions) are written by ``attn_tp_rank == 0`` only,
            since every TP rank of a replica sees the same requests.

    Raises:
        ValueError: a size below 1 or a rank outside ``[0, size)`` (the message names the field).
    """

    dp_rank: int = 0
    dp_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    attn_tp_rank: int = 0

    def __post_init__(self):
        for rank, size in (("dp_rank", "dp_size"), ("tp_rank", "tp_size"), ("attn_tp_rank", "tp_size")):
            n, r = getattr(self, size), getattr(self, rank)
            if n < 1:
                raise ValueError(f"{size} must be >= 1, got {n}")
            if not 0 <= r < n:
                raise ValueError(f"{rank} must be in [0, {n}) ({size}={n}), got {r}")

    @property
    def primary(self) -> bool:
        """True on the process that counts request-level events for its replica (attention-TP rank 0)."""
        return self.attn_tp_rank == 0

    @property
    def processes(self) -> int:
        """Scheduler processes of the server: ``dp_size x tp_size``."""
        return self.dp_size * self.tp_size


def host_tier_share(total_bytes: int, ranks: RankInfo) -> int:
    """Bytes of host tier one scheduler process gets: ``total_bytes // (dp_size x tp_size)``.

    Args:
        total_bytes: ``sparse.host_tier_bytes``, the server's whole host-tier budget (bytes, >= 1).
        ranks: the process's :class:`RankInfo`.

    Raises:
        ValueError: ``total_bytes`` < 1 (names ``sparse.host_tier_bytes``).
    """
    if total_bytes < 1:
        raise ValueError(f"sparse.host_tier_bytes must be >= 1, got {total_bytes}")
    return total_bytes // ranks.processes


def _read(parallel, name: str, default: int) -> int:
    try:
        value = getattr(parallel, name)
    except (AttributeError, RuntimeError, ValueError):
        return default
    return default if value is None else int(value)


def current_ranks() -> RankInfo:
    """This process's ranks from SGLang's runtime context; ``RankInfo()`` where none is published
    (a process that is not a scheduler, or a unit test)."""
    try:
        from sglang.srt.runtime_context import get_parallel
    except ImportError:  # pragma: no cover - SGLang is a dependency
        return RankInfo()
    p = get_parallel()
    tp_size = max(1, _read(p, "tp_size", 1))
    dp_size = max(1, _read(p, "dp_size", 1))
    tp_rank = _read(p, "tp_rank", 0)
    dp_rank = _read(p, "dp_rank", 0)
    attn_tp_rank = _read(p, "attn_tp_rank", tp_rank)
    if not 0 <= dp_rank < dp_size:  # attention-DP layouts number replicas differently; keep it bounded
        dp_rank = dp_rank % dp_size
    return RankInfo(dp_rank, dp_size, tp_rank % tp_size, tp_size, attn_tp_rank % tp_size)
