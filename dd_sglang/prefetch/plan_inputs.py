"""What the step plan reads besides the forward batch: :class:`PlanInputs`, wired once by the runner.

Its own module so that :mod:`dd_sglang.prefetch.plan` and :mod:`dd_sglang.prefetch.plan_rows`
(which both read it) import it from one place, and neither imports the other for its type.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from dd_sglang.prefetch.params import PrefetchParams
from dd_sglang.prefetch.predictions import PredictionStore
from dd_sglang.prefetch.selectors import SELECTORS, Selector, make_selector
from dd_sglang.prefetch.speculators import DualTokenSpeculator


@dataclass(frozen=True)
class PlanInputs:
    """What :func:`build_step_plan` reads besides the forward batch (wired once by the backend).

    ``selectors``: instances by name; ``speculator``: the speculator; ``indexes``: key index by location
    (``"host"``, ``"device"``), created on first use by ``make_index(location)``.
    """

    req_to_token: torch.Tensor
    selectors: dict[str, Selector]
    speculator: DualTokenSpeculator
    store: PredictionStore
    make_index: object  # Callable[[str], KeyBlockIndex]
    hit_rate_sample: float
    rng: random.Random

    @classmethod
    def from_params(cls, params: PrefetchParams, req_to_token: torch.Tensor, make_index, native: bool,
                    seed: int) -> PlanInputs:  # fmt: skip
        """The runner's inputs: one selector per name of :data:`SELECTORS` (the C kernel where
        ``native``), the speculator, a fresh prediction store, the preset's hit-rate settings, and a hit-rate sampling RNG seeded
        with ``seed``."""
        return cls(
            req_to_token=req_to_token,
            selectors={name: make_selector(name, params.rerank, native, params.first_level_tokens)
                       for name in SELECTORS},  # fmt: skip
            speculator=DualTokenSpeculator(),
            store=PredictionStore(),
            make_index=make_index,
            hit_rate_sample=params.hit_rate_sample,
            rng=random.Random(seed),
        )
