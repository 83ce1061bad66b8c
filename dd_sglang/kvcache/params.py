"""Sparse-path settings shared by the KV-cache runtime and the attention backend."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace

import psutil

from dd_sglang.config import DDConfig, SparseSection, bounds
from dd_sglang.kvcache.dualpath import PATH_POLICIES

#: Host memory left available beside the host tier, in bytes. SGLang's HiCache keeps
#: 10 GiB free (``pool_host/base.py``: ``HICACHE_HOST_MEMORY_RESERVE_BYTES``), a margin
#: sized for GPU hosts; the host tier's size is given explicitly (``host_tier_bytes``),
#: so a smaller margin applies.
HOST_MEMORY_MARGIN_BYTES = 512 * 1024**2
#: Environment switch: ``0`` leaves :func:`~dd_sglang.kvcache.host_memory.host_zeros` buffers on
#: 4 KiB pages; ``1`` (default) advises huge pages. Here, not in ``host_memory``, so the launcher
#: refuses a bad value without importing PyTorch.
HUGE_PAGES_ENV = "DD_SGLANG_HOST_HUGE_PAGES"


def host_memory_available_bytes() -> int:
    """Bytes the host tier may take now: the machine's available memory (``psutil``'s
    ``available``) less :data:`HOST_MEMORY_MARGIN_BYTES`. Lives here, not in
    :mod:`dd_sglang.kvcache.host_pool`, so the launcher checks a preset without importing SGLang."""
    return int(psutil.virtual_memory().available) - HOST_MEMORY_MARGIN_BYTES



def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, itemsize: int) -> int:
    """Bytes of one token's K and V over every layer: ``layers x 2 x kv_heads x head_dim x itemsize``
    (SmolLM2-135M in bfloat16: 30 x 2 x 3 x 64 x 2 = 23,040)."""
    return num_layers * 2 * num_kv_heads * head_dim * itemsize


def sglang_input_limits(bound: int) -> tuple[int, int]:
    """SGLang's ``(max_req_len, max_req_input_len)`` for a bound of ``bound`` tokens (the context, or
    the device pool): ``bound - 1`` and ``bound - 6``; a prompt of ``max_req_input_len`` tokens or more
    is refused (``sglang/srt/managers/tp_worker.py: get_worker_info``, SGLang 0.5.23)."""
    return bound - 1, bound - 6

@dataclass(frozen=True)
class SparseParams:
    """Sparse-path settings (token counts unless named ``_bytes``).

    Built from the preset's validated ``sparse`` section and ``experimental.n_keep``
    (:meth:`from_config`); the schema (:class:`dd_sglang.config.SparseSection`) holds the
    defaults, the allowed ranges and each key's meaning; this class has none of its own.

    Attributes:
        min_sparse_len: requests whose context reaches this many tokens go sparse.
        top_k: critical-set size per layer and KV head.
        n_sink: first tokens kept resident on the device.
        n_recent: last tokens kept resident on the device (the sliding window).
        n_keep: extra resident tokens, those with the largest key L2 norm summed over layers
            and KV heads (``experimental.n_keep``).
        page_size: host-tier allocation unit, and how many decode tokens are
            flushed to the host tier at a time.
        host_tier_bytes: host-tier capacity (K+V of all layers).
        selector: critical-set selector name (``dd_sglang.prefetch.selectors``).
        request_selectors: selector names a request may choose with ``custom_params.dd_selector``
            besides ``selector``; None: every one (:meth:`request_selector_names`).
        request_max_top_k: largest ``custom_params.dd_top_k`` a request may ask; None: the
            schema's 1,000,000 (:attr:`request_top_k_max`).
        policy: when a request at or past ``min_sparse_len`` leaves the dense path, one of
            :data:`PATH_POLICIES`: ``always`` (at that length) or ``pressure`` (only when its device
            KV is needed for other work: :mod:`dd_sglang.kvcache.pressure`).
    """

    min_sparse_len: int
    top_k: int
    n_sink: int
    n_recent: int
    n_keep: int
    page_size: int
    host_tier_bytes: int
    selector: str
    request_selectors: tuple[str, ...] | list[str] | None = None
    request_max_top_k: int | None = None
    policy: str = "always"

    @classmethod
    def from_config(cls, cfg: DDConfig, **changes) -> SparseParams:
        """The settings of preset ``cfg`` (its ``sparse`` keys and ``experimental.n_keep``), with
        ``changes`` applied (a scheduler process's share of ``host_tier_bytes``, say)."""
        values = {**cfg.sparse.model_dump(), "n_keep": cfg.experimental.n_keep}
        return replace(cls(**{f.name: values[f.name] for f in fields(cls)}), **changes)

    @property
    def resident_bound(self) -> int:
        """Most device slots a sparse request holds: sink + keep + window + one page pending flush."""
        return self.n_sink + self.n_keep + self.n_recent + self.page_size

    def request_selector_names(self, known: tuple[str, ...]) -> tuple[str, ...]:
        """The names of ``known`` a request may give as ``custom_params.dd_selector``: every one
        where ``request_selectors`` is None, else those in it and ``selector`` (``known``'s order)."""
        if self.request_selectors is None:
            return known
        allowed = {*self.request_selectors, self.selector}
        return tuple(name for name in known if name in allowed)

    @property
    def request_top_k_max(self) -> int:
        """Largest ``custom_params.dd_top_k`` a request may ask (tokens per layer and KV head)."""
        return TOP_K_RANGE[1] if self.request_max_top_k is None else self.request_max_top_k


#: Per-request overrides a client may put in ``sampling_params.custom_params``
#: (OpenAI routes: the ``custom_params`` body field), with their allowed values.
OVERRIDE_TOP_K = "dd_top_k"
OVERRIDE_SELECTOR = "dd_selector"
OVERRIDE_SPARSE = "dd_sparse"
OVERRIDE_POLICY = "dd_policy"
#: ``dd_trace: true`` asks for an attention trace of the request (:mod:`dd_sglang.prefetch.trace`), allowed
#: only on a server started with this environment variable naming the trace directory.
OVERRIDE_TRACE = "dd_trace"
TRACE_DIR_ENV = "DD_SGLANG_TRACE_DIR"
#: The schema's range of ``sparse.top_k``, which a request's ``dd_top_k`` shares.
TOP_K_RANGE = bounds(SparseSection, "top_k")


def request_overrides(
    custom_params,
    selectors: tuple[str, ...],
    max_top_k: int = TOP_K_RANGE[1],
) -> dict:
    """Validate a request's dd overrides; returns ``{"top_k": int, "selector": str, "sparse": bool,
    "policy": str, "trace": bool}`` (keys present only). ``dd_sparse: false`` keeps a
    request on the dense path whatever its length (an exact answer, or a dense reference beside sparse
    ones); ``dd_policy`` (one of :data:`PATH_POLICIES`) replaces the preset's ``sparse.policy`` for it.

    Args:
        custom_params: SGLang's ``SamplingParams.custom_params`` (a dict or None; anything else
            is refused: ``/generate`` passes any JSON value through).
        selectors: the allowed selector names (:meth:`SparseParams.request_selector_names`).
        max_top_k: the largest ``dd_top_k`` allowed (:attr:`SparseParams.request_top_k_max`).

    Raises:
        ValueError: ``custom_params`` not a dict, a ``dd_`` key in any case that is not one of
            the overrides (a typo would otherwise be ignored; so would ``dd_speculator`` and
            ``dd_miss_policy``, switches measured worse and deleted), or an override has the wrong
            type or is out of range; the message names
            the field and the allowed values. SGLang turns it into an HTTP 400 before the
            request is queued (``patches/sampling_sampling_params.py``).
    """
    if custom_params is None:
        return {}
    if not isinstance(custom_params, dict):  # /generate takes any JSON here; a string would drop every override
        raise ValueError(
            f"custom_params must be a JSON object such as {{\"{OVERRIDE_TOP_K}\": 256}}, got {type(custom_params).__name__}"
        )
    _check_override_keys(custom_params)
    out = _scalar_overrides(custom_params, max_top_k)
    for key, field, allowed in (
        (OVERRIDE_SELECTOR, "selector", selectors),
        (OVERRIDE_POLICY, "policy", PATH_POLICIES),
    ):
        if key in custom_params:
            v = custom_params[key]
            if v not in allowed:
                raise ValueError(f"custom_params.{key} must be one of {list(allowed)} on this server, got {v!r}")
            out[field] = v
    return out


def _check_override_keys(custom_params: dict) -> None:
    """Refuse a ``dd_`` key in any case that is not an override (:func:`request_overrides`); ValueError
    naming the key and the known ones."""
    known = (OVERRIDE_TOP_K, OVERRIDE_SELECTOR, OVERRIDE_SPARSE, OVERRIDE_POLICY, OVERRIDE_TRACE)
    for key in custom_params:
        if isinstance(key, str) and key.lower().startswith("dd_") and key not in known:
            raise ValueError(
                f"custom_params.{key} is not a dd_sglang override (keys are lower case); known: {list(known)}"
            )


def _scalar_overrides(custom_params: dict, max_top_k: int) -> dict:
    """``{"top_k": int, "sparse": bool, "trace": bool}`` (keys present only) from ``dd_top_k`` (an integer in
    ``[TOP_K_RANGE[0], max_top_k]``), ``dd_sparse`` (a bool) and ``dd_trace`` (a bool; true only where
    :data:`TRACE_DIR_ENV` is set in this process); ValueError otherwise."""
    out: dict = {}
    if OVERRIDE_TOP_K in custom_params:
        v = custom_params[OVERRIDE_TOP_K]
        lo, hi = TOP_K_RANGE[0], max_top_k
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise ValueError(f"custom_params.{OVERRIDE_TOP_K} must be an integer in [{lo}, {hi}], got {v!r}")
        out["top_k"] = v
    for key, field in ((OVERRIDE_SPARSE, "sparse"), (OVERRIDE_TRACE, "trace")):
        if key in custom_params:
            v = custom_params[key]
            if not isinstance(v, bool):
                raise ValueError(f"custom_params.{key} must be true or false, got {v!r}")
            out[field] = v
    if out.get("trace") and not os.environ.get(TRACE_DIR_ENV):
        raise ValueError(f"custom_params.{OVERRIDE_TRACE}: this server writes no attention traces "
                         f"(start it with {TRACE_DIR_ENV} naming a directory)")  # fmt: skip
    return out
