"""The CPU kernels (``cpu_select.c``): built at first use with the system C compiler.

* :func:`spec_host_select`: ``spec_host``'s whole selection for a chunk of layers, every row
  and KV head (:class:`LayerSelection`: the same, bound once a step and called layer by layer),
  the same arithmetic as :meth:`dd_sglang.prefetch.selectors.SpecHostSelector.score_layers` followed by the top-k,
  one task per (layer, row) with no tensor of intermediate scores (the PyTorch version
  dispatches ~40 operations per chunk and writes every candidate's score for every query head
  to memory and back); also ``host_sync``'s and verification's scoring.
* :func:`measure_hits`: the sampled prefetch hit-rate measurement of one layer.
* :func:`gather_rows`: a row copy into the layer ring (each row once, no temporary); :func:`gather_sets`:
  the same for sets of host slots, the row indices built in C.
* :func:`sparse_attend`: the fused sparse decode attention of a layer (:mod:`dd_sglang.kernels.native_attend`).

``tests/test_native_select.py`` checks each against its PyTorch counterpart.

**Build.** :mod:`dd_sglang.kernels.native_build` compiles and loads the library (at first use,
once per source, flags and CPU); its :func:`build`, :func:`load`, :func:`available`,
:func:`unavailable_reason` and :class:`NativeUnavailable` are re-exported here. Without a
compiler the selector uses its PyTorch path (``experimental.kernel: auto``).

**Threads.** The tasks are split over ``torch.get_num_threads()`` OpenMP threads; a selection
with fewer tasks than threads (one row of one layer: a selection at attention time or a verification at
batch 1) runs each task on every thread instead, its candidates' int8 scores split in blocks of
16 and then its KV heads (``select_task_wide``: the same arithmetic, the same sets). The library
is built with ``-fopenmp`` and binds to the ``libgomp.so.1`` PyTorch has already loaded, so
these are PyTorch's own intra-op threads. A thread pool of its own (tried first: half the
tasks on a Python helper thread, ctypes releasing the GIL) competed with PyTorch's workers,
which spin between operations: in the server the selection then took longer than PyTorch's
(136 against 94 ms a step at 4k x 8, in a run of ``bench.decode_speed --torch-kernel`` whose
JSON was replaced by the next run's).

Imports no other dd_sglang layer.
"""

from __future__ import annotations

import torch

from dd_sglang.kernels import native_build as _library
from dd_sglang.kernels.native_attend import ATTEND_PARALLEL_TASKS, sparse_attend
from dd_sglang.kernels.native_build import (
    FLAGS,
    MAX_HEAD_DIM,
    MAX_QUERIES,
    SOURCE,
    NativeUnavailable,
    available,
    build,
    load,
    unavailable_reason,
)

__all__ = ["ATTEND_PARALLEL_TASKS", "FLAGS", "GATHER_SERIAL_BYTES", "MAX_HEAD_DIM", "MAX_QUERIES", "SOURCE",
           "LayerSelection", "NativeUnavailable", "available", "build", "copy_rows_unchecked", "gather_rows",
           "gather_rows_unchecked", "gather_sets", "load", "measure_hits", "quantize_keys", "sparse_attend",
           "spec_host_select", "unavailable_reason"]


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def spec_host_select(
    q: torch.Tensor,
    slots: torch.Tensor,
    ok: torch.Tensor,
    q8: torch.Tensor,
    kscale: torch.Tensor,
    keys: torch.Tensor,
    k: int,
    m: int,
    scale: float,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    pages: tuple[torch.Tensor, torch.Tensor, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``spec_host``'s selection of ``L`` layers (module docstring; arithmetic in ``cpu_select.c``).

    Args:
        q: ``[L, rows, Hkv x G, D]`` float32, the selection queries grouped by KV head.
        slots, ok: ``[rows, P]`` int64 host slot of each position and bool candidate flag.
        q8, kscale: the ``L`` layers' int8 key index, ``[L, S, Hkv, D]`` int8 and ``[L, S, Hkv]``
            float32 (:class:`~dd_sglang.prefetch.index.QuantKeyIndex`; contiguous per layer).
        keys: the ``L`` layers' host keys ``[L, S, Hkv, D]``, bfloat16 or float32.
        k: set size per KV head; ``m``: candidates re-ranked exactly (``k <= m``).
        scale: softmax scale.
        out: where to write ``(positions, slots)`` (contiguous ``[L, rows, Hkv, k]`` int64, e.g. views
            of the next step's sets), instead of new tensors.
        pages: the two-level selection's first level, ``(c8, cscale, n)``: the ``L`` layers' 16-slot
            block means ``[L, S / 16, Hkv, D]`` int8 and ``[L, S / 16, Hkv]`` float32
            (:attr:`~dd_sglang.prefetch.index.QuantKeyIndex.block_means`) and the blocks kept per KV
            head ``n >= 1``: each row's candidates are first cut to its KV heads' ``n`` best blocks (the
            union), then selected as without it. None: every candidate (the full scan).

    Returns:
        ``(positions, slots)``, each ``[L, rows, Hkv, k]`` int64, best first (``out`` when given).

    Raises:
        NativeUnavailable: the kernel is not loaded (:func:`load` returned None).
        ValueError: a shape or dtype the kernel does not take (the message names it).
    """
    lib = load()
    if lib is None:
        raise NativeUnavailable("the CPU selection kernel is not built here")
    n_layers, rows, hkv, d = keys.shape[0], slots.shape[0], keys.shape[2], keys.shape[3]
    _check_select_inputs(q, keys, q8, kscale, rows, k, m)
    g = q.shape[2] // hkv
    q = q.to(torch.float32).contiguous()
    slots = slots.to(torch.int64).contiguous()
    ok = ok.to(torch.uint8).contiguous()
    pos_out, slot_out = _select_outputs(out, (n_layers, rows, hkv, k))
    s = keys.shape[1]
    c8, cscale, n_pages = _check_pages(pages, q8, kscale)
    args = (n_layers, rows, hkv, g, d, slots.shape[1], s, _ptr(q), _ptr(slots), _ptr(ok), _ptr(q8),
            _ptr(kscale), _ptr(keys), int(keys.dtype == torch.bfloat16), k, m, float(scale),
            _ptr(pos_out), _ptr(slot_out), c8, cscale, n_pages)  # fmt: skip
    rc = lib.dd_spec_host_select_par(*args, torch.get_num_threads())  # fewer tasks than threads: each on all
    if rc != 0:
        raise ValueError(f"the CPU selection kernel refused group {g}, head_dim {d}, k {k}, m {m}")
    return pos_out, slot_out


class LayerSelection:
    """:func:`spec_host_select` of one group of rows, bound once (a step) and called layer after layer.

    A selection at attention time runs once per layer of every step (30 calls a step for SmolLM2):
    :func:`spec_host_select` converts and checks its inputs and allocates its outputs at each call,
    which in the server cost about a third of the kernel's own time at one request (measured with a
    scratch timer around the C call: ~2.7 of ~9.3 ms a step). Here the candidates, the output
    tensors and the per-layer addresses are prepared once; a call passes the layer's queries.

    Args:
        slots, ok: ``[rows, P]`` host slot of each position and candidate flag (any integer / bool dtype).
        q8, kscale: every layer's int8 key index, ``[layers, S, Hkv, D]`` int8 and ``[layers, S, Hkv]`` float32.
        keys: every layer's host keys ``[layers, S, Hkv, D]``, bfloat16 or float32.
        k, m: set size per KV head and candidates re-ranked exactly (``1 <= k <= m``).
        q_heads: query heads per row (``Hkv x G``).
        pages: the first level, as :func:`spec_host_select`'s (every layer's block means), or None.

    Raises:
        NativeUnavailable: the kernel is not loaded.
        ValueError: a shape, dtype or layout the kernel does not take (the message names it).
    """

    def __init__(self, slots: torch.Tensor, ok: torch.Tensor, q8: torch.Tensor, kscale: torch.Tensor,
                 keys: torch.Tensor, k: int, m: int, q_heads: int,
                 pages: tuple[torch.Tensor, torch.Tensor, int] | None = None):  # fmt: skip
        self._lib = load()
        if self._lib is None:
            raise NativeUnavailable("the CPU selection kernel is not built here")
        layers, s, hkv, d = keys.shape
        rows = slots.shape[0]
        _check_select_inputs(torch.empty(layers, rows, q_heads, d), keys, q8, kscale, rows, k, m)
        c8, cscale, n_pages = _check_pages(pages, q8, kscale)
        self.slots = slots.to(torch.int64).contiguous()
        self.ok = ok.to(torch.uint8).contiguous()
        self.positions, self.chosen = _select_outputs(None, (1, rows, hkv, k))
        self.q_shape = (rows, q_heads, d)
        self._fixed = (rows, hkv, q_heads // hkv, d, self.slots.shape[1], s)
        self._bases = tuple(_ptr(t) for t in (q8, kscale, keys))
        self._strides = tuple(t.stride(0) * t.element_size() for t in (q8, kscale, keys))
        self._page_bases = (c8, cscale)
        self._page_strides = ((pages[0].stride(0) * pages[0].element_size(), pages[1].stride(0) * 4)
                              if c8 is not None else (0, 0))  # fmt: skip
        self._tail = (int(keys.dtype == torch.bfloat16), k, m)
        self._n_pages = n_pages
        self._keep = (q8, kscale, keys, pages)  # the addresses above stay valid

    def __call__(self, q: torch.Tensor, layer: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The sets of ``layer``: ``q`` ``[rows, Hkv x G, D]`` float32 contiguous, the selection
        queries grouped by KV head. Returns ``(positions, slots)``, ``[rows, Hkv, k]`` int64 views
        of buffers the next call overwrites (the caller copies them out first).

        Raises:
            ValueError: ``q`` is not float32 contiguous of the bound shape, or the kernel refused.
        """
        if q.dtype != torch.float32 or tuple(q.shape) != self.q_shape or not q.is_contiguous():
            raise ValueError(f"q must be float32 contiguous {self.q_shape}, got {q.dtype} {tuple(q.shape)}")
        (b8, bs, bk), (s8, ss, sk) = self._bases, self._strides
        c8, cs = self._page_bases
        if c8 is not None:
            c8, cs = c8 + layer * self._page_strides[0], cs + layer * self._page_strides[1]
        rc = self._lib.dd_spec_host_select_par(
            1, *self._fixed, _ptr(q), _ptr(self.slots), _ptr(self.ok), b8 + layer * s8, bs + layer * ss,
            bk + layer * sk, *self._tail, float(scale), _ptr(self.positions), _ptr(self.chosen), c8, cs,
            self._n_pages, torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise ValueError(f"the CPU selection kernel refused the bound shape {self._fixed}, "
                             f"k and m {self._tail[1:]}")  # fmt: skip
        return self.positions[0], self.chosen[0]


def _check_select_inputs(q: torch.Tensor, keys: torch.Tensor, q8: torch.Tensor, kscale: torch.Tensor, rows: int,
                         k: int, m: int) -> None:  # fmt: skip
    """:func:`spec_host_select`'s checks of its inputs (its Args); ValueError naming what it does not take."""
    n_layers, hkv, d = keys.shape[0], keys.shape[2], keys.shape[3]
    if keys.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"keys must be bfloat16 or float32, got {keys.dtype}")
    if q.shape[0] != n_layers or q.shape[1] != rows or q.shape[2] % hkv or q.shape[3] != d:
        raise ValueError(f"q {tuple(q.shape)} does not match keys {tuple(keys.shape)} and {rows} rows")
    if not 1 <= k <= m:
        raise ValueError(f"need 1 <= k <= m, got k={k}, m={m}")
    if q.shape[2] > MAX_QUERIES or d > MAX_HEAD_DIM:
        raise ValueError(f"the CPU selection kernel takes at most {MAX_QUERIES} queries per row and head_dim "
                         f"{MAX_HEAD_DIM}, got {q.shape[2]} and {d}")  # fmt: skip
    for name, t in (("keys", keys), ("q8", q8), ("kscale", kscale)):
        if not t[0].is_contiguous() or (n_layers > 1 and t.stride(0) != t[0].numel()):
            raise ValueError(f"{name} must be contiguous")


def _check_pages(pages: tuple[torch.Tensor, torch.Tensor, int] | None, q8: torch.Tensor,
                 kscale: torch.Tensor) -> tuple[int | None, int | None, int]:  # fmt: skip
    """The first level's kernel arguments (addresses of the block means and scales, blocks kept):
    ``(None, None, 0)`` for no first level. ValueError when the block means do not match the index
    (``[L, S / 16, Hkv, D]`` int8 and ``[L, S / 16, Hkv]`` float32, contiguous per layer) or ``n < 1``."""
    if pages is None:
        return None, None, 0
    c8, cs, n = pages
    n_layers, s, hkv, d = q8.shape
    if n < 1:
        raise ValueError(f"pages: blocks kept per KV head must be >= 1, got {n}")
    if c8.dtype != torch.int8 or tuple(c8.shape) != (n_layers, s // 16, hkv, d) or s % 16:
        raise ValueError(f"pages: block means must be int8 {(n_layers, s // 16, hkv, d)}, got {c8.dtype} "
                         f"{tuple(c8.shape)}")  # fmt: skip
    if cs.dtype != torch.float32 or tuple(cs.shape) != (n_layers, s // 16, hkv):
        raise ValueError(f"pages: block scales must be float32 {(n_layers, s // 16, hkv)}, got {cs.dtype} "
                         f"{tuple(cs.shape)}")  # fmt: skip
    for name, t in (("block means", c8), ("block scales", cs)):
        if not t[0].is_contiguous() or (n_layers > 1 and t.stride(0) != t[0].numel()):
            raise ValueError(f"pages: {name} must be contiguous")
    return _ptr(c8), _ptr(cs), int(n)


def _select_outputs(out: tuple[torch.Tensor, torch.Tensor] | None,
                    shape: tuple[int, int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(positions, slots)`` for :func:`spec_host_select` to write: new ``shape`` int64 tensors, or
    ``out`` once checked (contiguous int64 of that shape; ValueError otherwise)."""
    if out is None:
        pos_out = torch.empty(*shape, dtype=torch.int64)
        return pos_out, torch.empty_like(pos_out)
    pos_out, slot_out = out
    for t in out:
        if t.dtype != torch.int64 or tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(f"out must be contiguous int64 {shape}, got {t.dtype} {tuple(t.shape)}")
    return pos_out, slot_out


def quantize_keys(keys: torch.Tensor, slots: torch.Tensor, q8: torch.Tensor, scale: torch.Tensor) -> None:
    """Write the int8 key index of host ``slots`` for every layer (``dd_quantize_keys``): per layer,
    slot and KV head ``scale = max(max |k|, 1e-12) / 127`` and ``q8 = round(k / scale)`` (to even),
    clamped to [-127, 127]; the same bytes as
    :meth:`~dd_sglang.prefetch.index.QuantKeyIndex.update`'s PyTorch arithmetic, in one pass.

    Args:
        keys: the host tier's keys ``[L, S, Hkv, D]``, bfloat16 or float32, contiguous.
        slots: ``[n]`` int64 host slots.
        q8: ``[L, S, Hkv, D]`` int8 and ``scale``: ``[L, S, Hkv]`` float32, contiguous (written at
            ``slots``).

    Raises:
        NativeUnavailable: the kernel is not loaded.
        ValueError: a dtype, shape or layout it does not take (the message names it).
    """
    lib = load()
    if lib is None:
        raise NativeUnavailable("the CPU selection kernel is not built here")
    if keys.dtype not in (torch.bfloat16, torch.float32) or keys.dim() != 4:
        raise ValueError(f"keys must be [L, S, Hkv, D] bfloat16 or float32, got {keys.dtype} {tuple(keys.shape)}")
    if q8.dtype != torch.int8 or q8.shape != keys.shape:
        raise ValueError(f"q8 must be int8 {tuple(keys.shape)}, got {q8.dtype} {tuple(q8.shape)}")
    if scale.dtype != torch.float32 or scale.shape != keys.shape[:3]:
        raise ValueError(f"scale must be float32 {tuple(keys.shape[:3])}, got {scale.dtype} {tuple(scale.shape)}")
    if keys.shape[3] > MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be at most {MAX_HEAD_DIM}, got {keys.shape[3]}")
    for name, t in (("keys", keys), ("q8", q8), ("scale", scale)):
        if not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"{name} must be a contiguous CPU tensor")
    slots = slots.to(torch.int64).contiguous()
    n_layers, s, hkv, d = keys.shape
    rc = lib.dd_quantize_keys(n_layers, s, hkv, d, _ptr(keys), int(keys.dtype == torch.bfloat16), _ptr(slots),
                              int(slots.numel()), _ptr(q8), _ptr(scale), torch.get_num_threads())  # fmt: skip
    if rc != 0:
        raise ValueError(f"the CPU kernel refused head_dim {d}")


#: Bytes (K or V) below which a copy runs on the calling thread alone (a 1-row SmolLM2 step's
#: layer moves 768 x 128 B). A second thread gained nothing measurable at that size: the
#: server's copy phase was 3.5 ms a step at 4k x 1 either way (an uncommitted dev script).
GATHER_SERIAL_BYTES = 1 << 20


def _gather_threads(nbytes: int) -> int:
    return 1 if nbytes < GATHER_SERIAL_BYTES else torch.get_num_threads()


def gather_rows(src_k: torch.Tensor, src_v: torch.Tensor, dst_k: torch.Tensor, dst_v: torch.Tensor,
                src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:  # fmt: skip
    """``dst_k[dst_rows[i]] = src_k[src_rows[i]]`` (and V) for every ``i``, in one pass on PyTorch's threads.

    Args:
        src_k, src_v: ``[n_src, row]`` contiguous CPU tensors; dst_k, dst_v: ``[n_dst, row]``
            contiguous, same dtype and row width.
        src_rows, dst_rows: ``[m]`` int64 row indices, in range (not checked: the caller builds them
            from the plan).

    Raises:
        NativeUnavailable: the kernel is not loaded.
        ValueError: dtypes, row widths or contiguity differ (the message names them).
    """
    lib = load()
    if lib is None:
        raise NativeUnavailable("the CPU kernels are not built here")
    if not (src_k.dtype == src_v.dtype == dst_k.dtype == dst_v.dtype):
        raise ValueError(f"gather_rows: dtypes differ ({src_k.dtype}, {dst_k.dtype})")
    if not (src_k.shape[1:] == src_v.shape[1:] == dst_k.shape[1:] == dst_v.shape[1:]):
        raise ValueError(f"gather_rows: row widths differ ({tuple(src_k.shape)}, {tuple(dst_k.shape)})")
    if not all(t.is_contiguous() for t in (src_k, src_v, dst_k, dst_v, src_rows, dst_rows)):
        raise ValueError("gather_rows: tensors must be contiguous")
    row_bytes = src_k[0].numel() * src_k.element_size()
    lib.dd_gather_rows(_ptr(src_k), _ptr(src_v), _ptr(dst_k), _ptr(dst_v), _ptr(src_rows), _ptr(dst_rows),
                       int(src_rows.numel()), row_bytes, _gather_threads(int(src_rows.numel()) * row_bytes))  # fmt: skip


def gather_rows_unchecked(src_k: int, src_v: int, dst_k: int, dst_v: int, src_rows: torch.Tensor,
                          dst_rows: torch.Tensor, row_bytes: int) -> None:  # fmt: skip
    """:func:`gather_rows` by address, for a caller that checked its buffers once per step.

    ``src_k`` ... ``dst_v``: data pointers (``tensor.data_ptr()``) of buffers whose rows are
    ``row_bytes`` apart; ``src_rows`` / ``dst_rows``: ``[m]`` contiguous int64 CPU row indices, in
    range. Nothing is checked: a wrong index writes out of bounds.

    Raises:
        NativeUnavailable: the kernel is not loaded.
    """
    lib = _library._lib
    if lib is None:
        lib = load()
    if lib is None:
        raise NativeUnavailable("the CPU kernels are not built here")
    m = int(src_rows.numel())
    lib.dd_gather_rows(src_k, src_v, dst_k, dst_v, src_rows.data_ptr(), dst_rows.data_ptr(), m, row_bytes,
                       _gather_threads(m * row_bytes))  # fmt: skip


def gather_sets(src_k: torch.Tensor, src_v: torch.Tensor, dst_k: torch.Tensor, dst_v: torch.Tensor,
                slots: torch.Tensor, rows: torch.Tensor, c0: int) -> int:  # fmt: skip
    """Copy ``n`` critical sets of one layer into a ring slot (``dd_gather_sets``): for set ``i``, KV
    head ``h`` and column ``c``, ``dst[rows[i], h, c0 + c] = src[slots[i, h, c], h]`` for K and V, the
    row indices computed in C (one call, no index tensors: the sets chosen at attention time, one
    call a layer; :func:`gather_rows` takes prebuilt indices).

    Args:
        src_k, src_v: one layer of the host tier, ``[S, Hkv, D]``, contiguous.
        dst_k, dst_v: the ring slot, ``[R, Hkv, N, D]``, contiguous, the source's dtype.
        slots: ``[n, Hkv, w]`` int64 host slots (``c0 + w <= N``); rows: ``[n]`` int64 slot rows
            (``< R``). Contiguous CPU tensors; the indices are not checked (the caller's plan and
            selection build them).

    Returns:
        Bytes moved (K and V).

    Raises:
        NativeUnavailable: the kernel is not loaded.
        ValueError: dtypes, shapes or contiguity that do not fit (the message names them).
    """
    lib = _library._lib or load()
    if lib is None:
        raise NativeUnavailable("the CPU kernels are not built here")
    n, hkv, w = slots.shape
    d = src_k.shape[-1]
    if not (src_k.dtype == src_v.dtype == dst_k.dtype == dst_v.dtype):
        raise ValueError(f"gather_sets: dtypes differ ({src_k.dtype}, {dst_k.dtype})")
    if src_k.shape[1:] != (hkv, d) or dst_k.shape[1] != hkv or dst_k.shape[3] != d or c0 + w > dst_k.shape[2]:
        raise ValueError(f"gather_sets: slots {tuple(slots.shape)} from {tuple(src_k.shape)} at column {c0} do not "
                         f"fit a slot {tuple(dst_k.shape)}")  # fmt: skip
    if slots.dtype != torch.int64 or rows.dtype != torch.int64 or rows.shape != (n,):
        raise ValueError(f"gather_sets: slots and rows must be int64 [n, Hkv, w] and [n], got {slots.dtype} "
                         f"{tuple(slots.shape)}, {rows.dtype} {tuple(rows.shape)}")  # fmt: skip
    if not all(t.is_contiguous() for t in (src_k, src_v, dst_k, dst_v, slots, rows)):
        raise ValueError("gather_sets: tensors must be contiguous")
    row_bytes = d * src_k.element_size()
    m = n * hkv * w
    lib.dd_gather_sets(_ptr(src_k), _ptr(src_v), _ptr(dst_k), _ptr(dst_v), _ptr(slots), _ptr(rows), n, hkv, w,
                       dst_k.shape[2], c0, row_bytes, _gather_threads(m * row_bytes))  # fmt: skip
    return 2 * m * row_bytes


def copy_rows_unchecked(src: int, dst: int, src_rows: torch.Tensor, dst_rows: torch.Tensor, row_bytes: int) -> None:
    """``dst`` row ``dst_rows[i]`` = ``src`` row ``src_rows[i]`` (rows ``row_bytes`` apart from each
    base address), serial on the calling thread (``dd_copy_rows``): a few rows, e.g. the speculated
    tokens' new K/V read through the fused QKV projection's stride. Unchecked, as
    :func:`gather_rows_unchecked`.

    Raises:
        NativeUnavailable: the kernel is not loaded.
    """
    lib = _library._lib
    if lib is None:
        lib = load()
    if lib is None:
        raise NativeUnavailable("the CPU kernels are not built here")
    lib.dd_copy_rows(src, dst, src_rows.data_ptr(), dst_rows.data_ptr(), int(src_rows.numel()), row_bytes)


def measure_hits(q: torch.Tensor, slots: torch.Tensor, ok: torch.Tensor, keys: torch.Tensor, have: torch.Tensor,
                 top_k: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The prefetch hit-rate measurement of one layer (``dd_measure`` in ``cpu_select.c``).

    Per row and KV head: the exact top-``top_k[row]`` of the real query (exact scores of every
    candidate, DESIGN.md's GQA rule), how many of the first ``top_k[row]`` prefetched positions
    ``have`` are in it, and the softmax mass on each set.

    Args:
        q: ``[rows, Hkv x G, D]`` the real queries; slots, ok: ``[rows, P]`` candidates.
        keys: one layer's host keys ``[S, Hkv, D]``, bfloat16 or float32, contiguous.
        have: ``[rows, Hkv, K]`` int64 prefetched positions; top_k: ``[rows]`` int64 (``<= K``).

    Returns:
        ``(hits, mass_have, mass_top)``, each ``[rows, Hkv]`` (int64, float32, float32).

    Raises:
        NativeUnavailable: the kernel is not loaded. ValueError: shapes it does not take.
    """
    lib = load()
    if lib is None:
        raise NativeUnavailable("the CPU kernels are not built here")
    rows, hkv, d = slots.shape[0], keys.shape[1], keys.shape[2]
    if q.shape[0] != rows or q.shape[1] % hkv or q.shape[2] != d or have.shape[:2] != (rows, hkv):
        raise ValueError(f"measure_hits: q {tuple(q.shape)}, keys {tuple(keys.shape)}, have {tuple(have.shape)}, "
                         f"{rows} rows do not agree")  # fmt: skip
    if keys.dtype not in (torch.bfloat16, torch.float32) or not keys.is_contiguous():
        raise ValueError(f"measure_hits: keys must be contiguous bfloat16 or float32, got {keys.dtype}")
    g = q.shape[1] // hkv
    if g > MAX_QUERIES or d > MAX_HEAD_DIM:
        raise ValueError(f"measure_hits: at most {MAX_QUERIES} queries per KV head and head_dim {MAX_HEAD_DIM}")
    qf = q.to(torch.float32).contiguous()
    sl, okb = slots.to(torch.int64).contiguous(), ok.to(torch.uint8).contiguous()
    hv, kr = have.to(torch.int64).contiguous(), top_k.to(torch.int64).contiguous()
    hits = torch.zeros(rows, hkv, dtype=torch.int64)
    mass_have, mass_top = torch.zeros(rows, hkv), torch.zeros(rows, hkv)
    rc = lib.dd_measure(rows, hkv, g, d, sl.shape[1], hv.shape[2], _ptr(qf), _ptr(sl), _ptr(okb), _ptr(keys),
                        int(keys.dtype == torch.bfloat16), _ptr(hv), _ptr(kr), float(scale), _ptr(hits),
                        _ptr(mass_have), _ptr(mass_top), torch.get_num_threads())  # fmt: skip
    if rc != 0:
        raise ValueError("measure_hits: the kernel refused the shapes")
    return hits, mass_have, mass_top
