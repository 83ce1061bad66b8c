"""Prefetch settings shared by the attention backend and the plugin."""

from __future__ import annotations

from dataclasses import dataclass, fields

from dd_sglang.config import DDConfig, ExperimentalSection, PrefetchSection

_PREFETCH = PrefetchSection()
_EXPERIMENTAL = ExperimentalSection()


@dataclass(frozen=True)
class PrefetchParams:
    """Prediction and transfer settings of one server: the preset's ``prefetch`` section and the
    prefetch switches of its ``experimental`` section (:meth:`from_config`).

    Each attribute is the schema key of the same name, :class:`dd_sglang.config.PrefetchSection`
    or :class:`dd_sglang.config.ExperimentalSection`, which declares its type, default, range and
    meaning (rendered in ``docs/configuration.md``); the defaults here are read from there.
    """

    depth: int = _PREFETCH.depth
    hit_rate_sample: float = _PREFETCH.hit_rate_sample
    rerank: float = _PREFETCH.rerank
    transfer: str = _EXPERIMENTAL.transfer
    select: str = _EXPERIMENTAL.select
    gather: str = _EXPERIMENTAL.gather
    kernel: str = _EXPERIMENTAL.kernel
    first_level_tokens: int | None = _EXPERIMENTAL.first_level_tokens

    @classmethod
    def from_config(cls, cfg: DDConfig) -> PrefetchParams:
        """The settings of preset ``cfg``: its ``prefetch`` keys and the ``experimental`` keys named here."""
        values = {**cfg.prefetch.model_dump(), **cfg.experimental.model_dump()}
        return cls(**{f.name: values[f.name] for f in fields(cls)})


def quant_index_bytes_bound(tier_bytes: int) -> int:
    """Most host bytes a :class:`~dd_sglang.prefetch.index.QuantKeyIndex` over a host tier of
    ``tier_bytes`` (K+V) takes.

    Per key of ``head_dim`` elements the index holds ``head_dim + 4`` bytes; the tier holds
    ``2 x head_dim x itemsize``. Bounded for a 16-bit or wider KV cache and ``head_dim >= 64``:
    ``68 / 256`` of the tier (float32: half of that).

    Here, not in ``index``, so the launcher checks a preset without importing PyTorch.
    """
    return -(-tier_bytes * 68 // 256)
