"""Sparse decode attention through FlashInfer's paged decode kernel (CUDA), on the layer ring as it is.

What it computes is :func:`dd_sglang.kernels.sparse_decode.sparse_decode_attention`
(the PyTorch reference): per sparse row ``r``, KV head ``h`` and query position
``s`` (0: the real token, then the speculated ones: ``S = StepPlan.layout.positions``
positions, 2 with one speculated token), softmax attention of the
``G`` query heads of ``h``'s GQA group over the columns ``mask[r, s]`` marks in
the row's slot of the layer ring (:mod:`dd_sglang.kvcache.layer_buffers`).

Mapping onto ``flashinfer.BatchDecodeWithPagedKVCacheWrapper``
---------------------------------------------------------------
The ring slot holds ``keys, values: [R, Hkv, C, D]`` (``C``: the ring's column
capacity, at least the step's ``N`` columns; a step's tensors are views
``[:R, :, :N]`` of the slot). With ``page_size = 1``:

1. **Requests.** Every (row ``r``, KV head ``h``, query position ``s``) is one
   decode request ``b = (r * Hkv + h) * S + s``, with ``num_kv_heads = 1`` and
   ``num_qo_heads = G``. That is the order of the folded queries in memory
   (``q: [R, Hkv, S * G, D]``, :func:`~dd_sglang.kernels.sparse_decode.fold_gqa`),
   so ``q`` is handed over as the view ``[R * Hkv * S, G, D]``, no copy; the
   output ``[R * Hkv * S, G, D]`` is viewed back as ``[R, Hkv, S * G, D]``.
2. **Pages.** The ring slot is the paged cache, viewed without a copy
   (``as_strided``) as ``R * Hkv * C`` one-token pages of one head (NHD:
   ``[pages, 1, 1, D]``, page stride ``D``): page ``p = r * Hkv * C + h * C + c``
   is column ``c`` of row ``r``, head ``h``.
3. **Index lists** (:func:`paged_kv_indices`, once per step): request ``b``'s
   ``kv_indices`` are the pages of the columns ``mask[r, s]`` marks, in column
   order; ``kv_indptr`` their offsets; ``kv_last_page_len`` is 1 (0 for a
   request without columns). The mask is the same for every KV head and every
   layer, and each layer's ring slot has the same layout, so one index list
   serves all layers, K and V.

Cost
----
* Reads: each request reads only its valid columns, ``D`` elements of K and V
  each through one index per token. The real and the speculated queries of a
  (row, head) are ``S`` requests over the same columns (a speculated one has
  its own column more), so K/V are read ``S`` times per layer; a row with fewer
  speculated tokens has its spare requests computed and discarded. Per layer
  and row, with ``S = 2``, that is
  ``2 x Hkv x (n_res + k + 1) x D x 2 x itemsize`` bytes against a dense
  decode's ``Hkv x context x D x 2 x itemsize``: at 32k context and
  ``k = 2048`` (1/16) about 7.5x fewer bytes, not 16x.
* Index memory: 4 bytes per (row, head, position, column): ``4 x S x R x Hkv x C``
  bytes, against ``2 x (depth + 1) x R x Hkv x C x D x itemsize`` for the ring
  (0.5% of it at ``D = 128``, bf16, depth 2, ``S = 2``).
* Planning: one pass of tensor ops over ``[R, Hkv, S, N]`` on the mask's device
  (no Python loop, no host sync), then FlashInfer's own ``plan()``, which
  copies ``kv_indptr`` to the host (one small device-to-host sync per step)
  to split long requests over thread blocks.

Why this mapping
----------------
* Critical sets differ per KV head, so a (row, head) pair cannot share one
  index list across heads as FlashInfer's multi-head pages would require;
  ``num_kv_heads = 1`` per request gives each head its own list.
* ``page_size = 1`` lets an index list name any set of columns, so masked
  columns are never read (a custom-mask kernel would read and discard them),
  and the ring slot is used in place: no per-layer repacking of K/V.
* Only documented wrapper API is used (``plan``/``run``, ``out=``,
  ``q_scale`` for the softmax scale); no hand-written CUDA.
* Not built: for ``S = 2``, one request per (row, head) holding both queries
  (``q_len_per_req = 2`` on the tensor-core path, whose bottom-right causal
  mask hides the last index from the first query) would read K/V once, given
  the speculated token's column last in each list: half the traffic, but it
  relies on the mask's structure and on a kernel path this project has not
  run (and does not fit ``S = 3``, where each speculated query has its own
  column the other must not read).

Kernel choice: FlashInfer's CUDA-core decode kernel for ``G < 4``, its
tensor-core (prefill) kernel for ``G >= 4`` (SGLang's rule for fp16/bf16 KV);
``backend="fa2"``. Supported here: fp16/bf16 q and KV, head_dim 64/128/256
(:func:`flashinfer_supports`).

Buffers (allocated once, filled in place)
-----------------------------------------
``kv_indptr`` ``[cap_requests + 1]``, ``kv_last_page_len`` ``[cap_requests]``,
``kv_indices`` ``[cap_requests x cap_columns + 1]`` (the last entry takes the
writes of masked columns), all int32 on the device, and the output
``[cap_requests, G, D]``: ``cap_requests = rows x Hkv x S`` and
``cap_columns`` follow the largest step seen (or ``max_rows`` given up front),
like the layer ring itself; they are reallocated only when a step outgrows
them. ``run()`` allocates nothing (the paged views are metadata only). A
FlashInfer workspace (``workspace_bytes``, 128 MiB by default) is shared by
the wrappers.

``flashinfer`` is imported only when :class:`FlashInferSparseDecode` is built;
:func:`paged_kv_indices` is plain PyTorch and runs on any device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
TENSOR_CORE_MIN_GROUP = 4


def flashinfer_supports(dtype: torch.dtype, group: int | None = None, head_dim: int | None = None):
    """None when the FlashInfer path serves this shape (a None argument: not known yet), else the
    reason it does not (a ``str`` for a log line)."""
    if dtype not in SUPPORTED_DTYPES:
        return f"dtype {dtype} (FlashInfer decode takes float16/bfloat16)"
    if head_dim is not None and head_dim not in SUPPORTED_HEAD_DIMS:
        return f"head_dim {head_dim} (supported: {SUPPORTED_HEAD_DIMS})"
    if group is not None and group < 1:
        return f"GQA group {group}"
    return None


def _check_page_inputs(mask: torch.Tensor, num_kv_heads: int, columns: int) -> None:
    """:func:`paged_kv_indices`' checks of ``mask``, ``num_kv_heads`` and ``columns`` (its Raises)."""
    if mask.dim() != 3 or mask.dtype != torch.bool:
        raise ValueError(
            f"mask must be a [rows, positions, columns] bool tensor, got {tuple(mask.shape)} {mask.dtype}"
        )
    if num_kv_heads < 1:
        raise ValueError(f"num_kv_heads must be >= 1, got {num_kv_heads}")
    if columns < mask.shape[2]:
        raise ValueError(f"columns (the K/V column stride) must be >= mask.shape[2] = {mask.shape[2]}, got {columns}")


def paged_kv_indices(
    mask: torch.Tensor,
    num_kv_heads: int,
    columns: int,
    *,
    indptr: torch.Tensor | None = None,
    indices: torch.Tensor | None = None,
    last_page_len: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer page lists of a sparse step (module docstring, "Mapping"): pure tensor code.

    Request ``b = (r * num_kv_heads + h) * S + s`` lists, in column order, the pages
    ``r * num_kv_heads * columns + h * columns + c`` of the columns ``c`` with ``mask[r, s, c]``.

    Args:
        mask: ``shape: [R, S, N], dtype: torch.bool``: columns each row's query position reads
            (``StepPlan.layout.mask``; ``S = StepPlan.layout.positions``), the same for every KV head.
        num_kv_heads: ``Hkv`` (>= 1).
        columns: column stride ``C`` of the paged K/V (the ring slot's column capacity), ``>= N``.
        indptr: optional ``[>= B + 1]`` int32 buffer to fill in place (``B = R x Hkv x S``).
        indices: optional ``[>= B x N + 1]`` int32 buffer to fill in place; its last entry is
            scratch (masked columns are written there).
        last_page_len: optional ``[>= B]`` int32 buffer to fill in place.
        The three buffers, when given, must be on ``mask``'s device.

    Returns:
        ``(kv_indptr, kv_indices, kv_last_page_len)``: ``[B + 1]``, the whole ``indices`` buffer
        (valid prefix ``kv_indptr[-1]``; allocated ``[B x N + 1]`` when not given) and ``[B]``,
        int32, on ``mask``'s device. No host sync.

    Raises:
        ValueError: ``mask`` is not a 3-D bool tensor, ``num_kv_heads < 1``, ``columns < N``, or a
            buffer is too small or of the wrong dtype (the message names it).
    """
    _check_page_inputs(mask, num_kv_heads, columns)
    r, s, n = mask.shape
    b = r * num_kv_heads * s
    dev = mask.device
    indptr = _buffer(indptr, b + 1, dev, "indptr")
    indices = _buffer(indices, b * n + 1, dev, "indices")
    last_page_len = _buffer(last_page_len, b, dev, "last_page_len")
    counts = mask.sum(-1, dtype=torch.int32)  # [R, S]: the same for every KV head
    counts = counts.unsqueeze(1).expand(r, num_kv_heads, s).reshape(b)
    indptr[0] = 0
    torch.cumsum(counts, 0, dtype=torch.int32, out=indptr[1 : b + 1])
    last_page_len[:b] = (counts > 0).to(torch.int32)
    if b == 0:
        return indptr[:1], indices, last_page_len[:0]
    rank = mask.cumsum(-1, dtype=torch.int32) - 1  # [R, S, N]: place of a valid column in its list
    start = indptr[:b].view(r, num_kv_heads, s, 1)
    scratch = indices.numel() - 1
    dest = torch.where(mask.unsqueeze(1), start + rank.unsqueeze(1), scratch)  # [R, Hkv, S, N]
    heads = torch.arange(r * num_kv_heads, device=dev, dtype=torch.int32).view(r, num_kv_heads, 1, 1)
    page = heads * columns + torch.arange(n, device=dev, dtype=torch.int32).view(1, 1, 1, n)
    indices.index_put_((dest.reshape(-1).long(),), page.expand(r, num_kv_heads, s, n).reshape(-1))
    return indptr[: b + 1], indices, last_page_len[:b]


def _buffer(buf: torch.Tensor | None, size: int, device: torch.device, name: str) -> torch.Tensor:
    if buf is None:
        return torch.zeros(size, dtype=torch.int32, device=device)
    if buf.dtype != torch.int32 or buf.dim() != 1 or buf.numel() < size or buf.device != device:
        raise ValueError(
            f"{name} buffer must be a 1-D int32 tensor of >= {size} entries on {device}, "
            f"got {tuple(buf.shape)} {buf.dtype} on {buf.device}"
        )
    return buf


@dataclass(frozen=True)
class _Step:
    rows: int
    num_kv_heads: int
    positions: int
    columns: int
    dtype: torch.dtype

    @property
    def requests(self) -> int:
        return self.rows * self.num_kv_heads * self.positions


@dataclass(frozen=True)
class _PageBuffers:
    """The index buffers FlashInfer's page lists are written into (:func:`paged_kv_indices`), int32 on
    the device, for up to ``requests`` requests of ``columns`` columns: ``indptr`` ``[requests + 1]``,
    ``indices`` ``[requests x columns + 1]`` and ``last_page_len`` ``[requests]`` (None: none yet)."""

    requests: int = 0
    columns: int = 0
    indptr: torch.Tensor | None = None
    indices: torch.Tensor | None = None
    last_page_len: torch.Tensor | None = None

    @classmethod
    def allocate(cls, requests: int, columns: int, device: torch.device) -> _PageBuffers:
        """Zeroed buffers for ``requests`` requests of ``columns`` columns on ``device``."""
        indptr = torch.zeros(requests + 1, dtype=torch.int32, device=device)
        last = torch.zeros(requests, dtype=torch.int32, device=device)
        indices = torch.zeros(requests * columns + 1, dtype=torch.int32, device=device)
        return cls(requests, columns, indptr, indices, last)


class FlashInferSparseDecode:
    """FlashInfer sparse decode over the layer ring (module docstring): :meth:`plan` per step,
    :meth:`run` per layer.

    Args:
        device: the CUDA device of the KV pool and the ring.
        max_rows: sparse rows to size the index buffers for up front (0: size them by the
            first step and grow with the ring).
        workspace_bytes: FlashInfer's float workspace (split-KV partial results).
        wrapper_factory: ``(workspace, use_tensor_cores) -> wrapper`` with the ``plan``/``run``
            API of ``flashinfer.BatchDecodeWithPagedKVCacheWrapper``; None (the default) builds
            that wrapper (NHD, ``backend="fa2"``). Tests pass an emulator of its contract.

    Raises:
        ImportError: ``flashinfer`` cannot be imported (default factory).
        ValueError: ``device`` is not a CUDA device (default factory).
    """

    def __init__(self, device: torch.device | str, max_rows: int = 0, workspace_bytes: int = 128 << 20,
                 wrapper_factory=None):  # fmt: skip
        self.device = torch.device(device)
        if wrapper_factory is None:
            import flashinfer  # fail here, not at the first step

            if self.device.type != "cuda":
                raise ValueError(f"FlashInferSparseDecode needs a CUDA device, got {self.device}")

            def wrapper_factory(workspace, tensor_cores):
                return flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    workspace, "NHD", use_tensor_cores=tensor_cores, backend="fa2"
                )

        self._factory = wrapper_factory
        self.max_rows = max_rows
        self._workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        self._wrappers: dict[bool, object] = {}  # by use_tensor_cores, built on first use
        self._pages = _PageBuffers()  # grown by _reserve
        self._out: torch.Tensor | None = None
        self._step: _Step | None = None
        self._kernel: tuple[int, int] | None = None  # (group, head_dim) FlashInfer is planned for
        self.group: int | None = None  # learned from the first run() when plan() was not told
        self.head_dim: int | None = None

    # ---------------------------------------------------------------- per step
    def plan(self, mask: torch.Tensor, num_kv_heads: int, columns: int, dtype: torch.dtype,
             group: int | None = None, head_dim: int | None = None) -> None:  # fmt: skip
        """Fill the index buffers for a step and plan FlashInfer's kernel.

        Args:
            mask: ``[R, S, N]`` bool on :attr:`device` (``StepPlan.layout.mask``).
            num_kv_heads: ``Hkv``; ``columns``: the K/V column stride (ring column capacity).
            dtype: q and K/V dtype (float16/bfloat16, :func:`flashinfer_supports`).
            group, head_dim: the GQA group and head dim; when None, the values an earlier
                :meth:`run` saw are used, and before any run FlashInfer's ``plan()`` waits for
                the first :meth:`run` of the step (which reads them from ``q``).

        Raises:
            ValueError: bad shapes, dtype or device (see :func:`paged_kv_indices`).
        """
        if mask.device != self.device:
            raise ValueError(f"mask is on {mask.device}, the FlashInfer path on {self.device}")
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype}")
        step = _Step(int(mask.shape[0]), num_kv_heads, int(mask.shape[1]), columns, dtype)
        self._reserve(step)
        pages = self._pages
        paged_kv_indices(mask, num_kv_heads, columns, indptr=pages.indptr, indices=pages.indices,
                         last_page_len=pages.last_page_len)  # fmt: skip
        self._step, self._kernel = step, None
        group = group or self.group
        head_dim = head_dim or self.head_dim
        if group and head_dim:
            self._plan_kernel(group, head_dim)

    def _reserve(self, st: _Step) -> None:
        """Grow the index buffers to hold ``st`` (and ``max_rows`` rows of its shape)."""
        cap_b, cap_c = self._pages.requests, self._pages.columns
        need_b = max(st.requests, self.max_rows * st.num_kv_heads * st.positions)
        if need_b <= cap_b and st.columns <= cap_c:
            return
        self._pages = _PageBuffers.allocate(max(cap_b, need_b), max(cap_c, st.columns), self.device)
        self._out = None  # sized by requests too: rebuilt at the next kernel plan

    def _wrapper(self, tensor_cores: bool):
        w = self._wrappers.get(tensor_cores)
        if w is None:
            w = self._wrappers[tensor_cores] = self._factory(self._workspace, tensor_cores)
        return w

    def _plan_kernel(self, group: int, head_dim: int) -> None:
        st = self._step
        why = flashinfer_supports(st.dtype, group, head_dim)
        if why is not None:
            raise ValueError(f"FlashInfer sparse decode cannot serve {why}")
        b, pages = st.requests, self._pages
        cap_b = pages.requests
        out = self._out
        if out is None or out.shape != (cap_b, group, head_dim) or out.dtype != st.dtype:
            self._out = torch.empty(cap_b, group, head_dim, dtype=st.dtype, device=self.device)
        self._wrapper(group >= TENSOR_CORE_MIN_GROUP).plan(
            pages.indptr[: b + 1],
            pages.indices,
            pages.last_page_len[:b],
            group,
            1,
            head_dim,
            1,
            q_data_type=st.dtype,
            kv_data_type=st.dtype,
        )
        self._kernel = (group, head_dim)
        self.group, self.head_dim = group, head_dim

    # ---------------------------------------------------------------- per layer
    def run(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
        """Sparse attention of one layer over the planned columns.

        Args:
            q: ``[R, Hkv, S x G, D]`` (folded; cast to the planned dtype if it differs).
            keys, values: ``[R, Hkv, N, D]`` views of a ring slot with column stride ``columns``
                (``stride = (Hkv x columns x D, columns x D, D, 1)``), the planned dtype.
            scale: softmax scale.

        Returns:
            ``[R, Hkv, S x G, D]``, the planned dtype: a view of a buffer the next :meth:`run`
            overwrites (consume or copy it first).

        Raises:
            RuntimeError: no :meth:`plan` before.
            ValueError: shapes, strides or dtypes differ from the plan (the message names them).
        """
        st = self._step
        if st is None:
            raise RuntimeError("FlashInferSparseDecode.run() before plan()")
        r, hkv, nq, d = q.shape
        if (r, hkv) != (st.rows, st.num_kv_heads) or nq % st.positions:
            raise ValueError(f"q {tuple(q.shape)} does not match the plan ({st.rows} rows, "
                             f"{st.num_kv_heads} KV heads, {st.positions} positions)")  # fmt: skip
        group = nq // st.positions
        if self._kernel != (group, d):
            self._plan_kernel(group, d)
        c = st.columns
        want = (hkv * c * d, c * d, d, 1)
        for name, t in (("keys", keys), ("values", values)):
            bad = t.shape[:2] != (r, hkv) or t.shape[2] > c or t.shape[3] != d
            if bad or t.stride() != want or t.dtype != st.dtype:
                raise ValueError(
                    f"{name} {tuple(t.shape)} stride {t.stride()} {t.dtype} must be "
                    f"[{r}, {hkv}, <= {c}, {d}] with stride {want} and dtype {st.dtype} (a ring slot view)"
                )
        if q.dtype != st.dtype:
            q = q.to(st.dtype)
        b = st.requests
        pages = r * hkv * c
        kp = keys.as_strided((pages, 1, 1, d), (d, d, d, 1))
        vp = values.as_strided((pages, 1, 1, d), (d, d, d, 1))
        out = self._out[:b]
        q_scale = None if scale == d**-0.5 else scale * math.sqrt(d)
        wrapper = self._wrapper(group >= TENSOR_CORE_MIN_GROUP)
        wrapper.run(q.reshape(b, group, d), (kp, vp), out=out, q_scale=q_scale)
        return out.view(r, hkv, nq, d)
