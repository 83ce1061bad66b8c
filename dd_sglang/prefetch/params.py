"""Prefetch settings shared by the attention backend and the plugin."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefetchParams:
    """Prediction and transfer settings (built from the preset's validated ``prefetch`` section,
    :class:`dd_sglang.config.PrefetchSection`, which holds the defaults and ranges).

    Attributes:
        speculator: ``dual_token``, ``ngram`` or ``none`` (:mod:`dd_sglang.prefetch.speculators`).
        depth: prefetch depth ``w``: layer l's copy runs while layers ``l-w .. l-1`` compute;
            the layer ring holds ``w + 1`` layers.
        miss_policy: ``verify`` (at every layer, the real query's own set, chosen as ``host_sync``
            chooses it, replaces the prefetched one: hits stay, misses are fetched before attention,
            :mod:`dd_sglang.prefetch.verify`) or ``use_prefetched`` (attend over what arrived; an
            experiment: it loses answers that exact selection keeps).
        hit_rate_sample: fraction of (request, step)s on which the exact top-k of the real
            query is computed to measure the prefetch hit rate (0 disables, 1 every step).
        rerank: ``spec_host`` re-ranks exactly the ``rerank x k`` best candidates of its
            int8 host-tier key index (:class:`~dd_sglang.prefetch.selectors.SpecHostSelector`).
        transfer: ``worker`` (copies on the copy worker, overlapping the layers before),
            ``inline`` (on the forward thread when the layer needs them) or ``in_place`` (CPU fast
            path: no copy, attention reads the critical sets from the host tier by slot; elsewhere
            as ``inline``); ``auto``: ``worker`` on CUDA; on a CPU device ``in_place`` for a step of
            at least 6 (row, KV head) pairs, else ``inline``.
        branches: ``dual_token`` rides up to this many tokens (1 or 2): with 2, an unconfident
            argmax rides with the second most likely token and the selector ranks by both.
        confident: top-1 probability at or above which one token rides.
        real_query: when the next step's lookahead selection also ranks by the real token's
            query, beside the riding ones (max over all of them per KV head, same ``k``):
            ``never``; ``after_miss`` (the row's riding token is not the model's own guess: its
            last speculation was rejected or none rode, so a prompt lookup rides, or nothing);
            ``always``.
        select: where the next step's selection runs: ``worker`` (the select worker thread),
            ``inline`` (the forward thread, after the layer's attention), ``split`` (a CPU
            device with 2+ intra-op threads: the worker, with the forward thread's own
            operations on one intra-op thread during decode steps with a row selecting
            ahead; elsewhere, or on one thread, as ``worker``); ``auto``: ``worker``
            on CUDA; on a CPU device ``split`` for a step with at least
            :data:`~dd_sglang.prefetch.runner.SPLIT_MIN_ROWS` rows selecting ahead (with 2+
            intra-op threads), else ``inline`` (``bench/results/archive/decode_speed_select_auto_cpu.json``).
        gather: how host-tier rows reach the ring (:mod:`dd_sglang.prefetch.gather`): ``auto``,
            ``cpu``, ``kernel`` (CUDA: SGLang's transfer kernel reading the pinned tier) or
            ``staging`` (CUDA: host gather into pinned staging, then one copy).
        kernel: ``spec_host``'s and ``host_sync``'s selection (and verification) on the host: ``native`` (the C
            kernel, :mod:`dd_sglang.kernels.native`), ``torch`` (PyTorch operations) or ``auto``
            (``native`` where it builds, else ``torch``).
        sampling: ``coupled`` (a sampled sparse request's real token and its speculated successor
            are drawn with the same noise: :mod:`dd_sglang.attention.coupling`)
            or ``independent`` (SGLang samples as it always does; the speculation is the argmax).
    """

    speculator: str = "dual_token"
    depth: int = 2
    miss_policy: str = "verify"
    hit_rate_sample: float = 0.01
    rerank: float = 2.0
    transfer: str = "auto"
    select: str = "auto"
    gather: str = "auto"
    branches: int = 1
    confident: float = 0.9
    real_query: str = "never"
    kernel: str = "auto"
    sampling: str = "coupled"


def quant_index_bytes_bound(tier_bytes: int) -> int:
    """Most host bytes a :class:`~dd_sglang.prefetch.index.QuantKeyIndex` over a host tier of
    ``tier_bytes`` (K+V) takes.

    Per key of ``head_dim`` elements the index holds ``head_dim + 4`` bytes; the tier holds
    ``2 x head_dim x itemsize``. Bounded for a 16-bit or wider KV cache and ``head_dim >= 64``:
    ``68 / 256`` of the tier (float32: half of that).

    Here, not in ``index``, so the launcher checks a preset without importing PyTorch.
    """
    return -(-tier_bytes * 68 // 256)
