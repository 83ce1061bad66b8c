"""The fused sparse decode attention of the CPU kernels (``dd_sparse_attend`` in ``cpu_select.c``).

:func:`sparse_attend` attends every sparse row of a step over its layer ring slot in one call,
reading the resident set from the device pool and the critical set from the host tier in place
where told to; :mod:`dd_sglang.kernels.native` re-exports it with the other kernels. The library
is built and loaded by :mod:`dd_sglang.kernels.native_build`.

Imports no other dd_sglang layer.
"""

from __future__ import annotations

import torch

from dd_sglang.kernels import native_build as _library
from dd_sglang.kernels.native_build import MAX_HEAD_DIM, MAX_QUERIES, NativeUnavailable, load

__all__ = ["ATTEND_PARALLEL_TASKS", "sparse_attend"]


#: Tasks (row x KV head) from which :func:`sparse_attend` splits them over PyTorch's threads; below,
#: the calling thread runs them alone (waking the other threads costs more than 1-row work).
ATTEND_PARALLEL_TASKS = 6

_ATTEND_DTYPES = (torch.bfloat16, torch.float32)


def sparse_attend(q: torch.Tensor, q_tok: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                  out: torch.Tensor, out_tok: torch.Tensor, scale: float,
                  resident: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                  critical: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None) -> None:  # fmt: skip
    """Sparse decode attention of a step's rows over their ring slot, written into the layer's
    output (``dd_sparse_attend`` in ``cpu_select.c``): for each plan row ``r``, KV head ``h`` and
    query position ``p`` with ``out_tok[r, p] >= 0``, each of the ``G`` query heads of ``h`` attends
    (softmax of ``scale q . k``, float32) to the columns ``c`` with ``mask[r, p, c]`` and its output goes
    to ``out[out_tok[r, p], h G + g]``. The same result as folding the queries
    (:func:`~dd_sglang.kernels.sparse_decode.fold_gqa` of ``q[q_tok]``), SDPA with the mask and
    scattering the output, up to float32 rounding order.

    Args:
        q: ``[tokens, Hq, D]`` bfloat16 or float32 (any token stride; heads ``D`` apart, contiguous
            within a head: e.g. a view of the fused QKV projection).
        q_tok: ``[R, P]`` int64, each query's token.
        keys, values: the ring slot, ``[rows >= R, Hkv, ncols, D]`` contiguous, bfloat16 or float32.
        mask: ``[R, P, N]`` bool contiguous, ``N <= ncols``; a position with an output token must
            read at least one column.
        out: ``[tokens', Hq, D]``, ``q``'s dtype, heads ``D`` apart.
        out_tok: ``[R, P]`` int64, each output's token, or -1 (position unused: nothing written).
        scale: softmax scale.
        resident: ``(pool_k, pool_v, slots)``: read columns ``[0, n_res)`` (the resident set) from the
            device pool's ``[slots, Hkv, D]`` buffers (contiguous, the slot's dtype) at ``slots``
            ``[R, n_res]`` (int64, contiguous) instead of the ring slot, which then need not hold
            them; None: every column from the ring slot.
        critical: ``(host_k, host_v, slots, c_lo)``: read column ``c_lo + j`` of row ``r`` and KV head
            ``h`` in place from the host tier's layer ``[S, Hkv, D]`` buffers (contiguous, the slot's
            dtype) at host slot ``slots[r, h, j]`` (``[R, Hkv, n]`` int64 contiguous) where that slot
            is >= 0, instead of from the ring slot (the critical set, never copied); None: no such
            column.

    Raises:
        NativeUnavailable: the kernel is not loaded.
        ValueError: dtypes, layouts or shapes the kernel does not take (the message says which).
    """
    lib = _library._lib
    if lib is None:
        lib = load()
    if lib is None:
        raise NativeUnavailable("the CPU kernels are not built here")
    r, p = q_tok.shape
    _, hkv, ncols, d = keys.shape
    hq = q.shape[1]
    _check_attend_inputs(q, q_tok, keys, values, mask, out, out_tok)
    pool = _NO_RESIDENT if resident is None else _resident_pointers(resident, keys, r)
    host = _NO_CRITICAL if critical is None else _critical_pointers(critical, keys, r)
    threads = torch.get_num_threads() if r * hkv >= ATTEND_PARALLEL_TASKS else 1
    rc = lib.dd_sparse_attend(r, hkv, hq // hkv, p, d, mask.shape[2], ncols, q.data_ptr(), q.stride(0), q_tok.data_ptr(),
                              keys.data_ptr(), values.data_ptr(), mask.data_ptr(), out.data_ptr(), out.stride(0),
                              out_tok.data_ptr(), int(q.dtype == torch.bfloat16), int(keys.dtype == torch.bfloat16),
                              float(scale), *pool, *host, threads)  # fmt: skip
    if rc != 0:
        raise ValueError(f"sparse_attend: the kernel refused G={hq // hkv}, D={d}, N={mask.shape[2]} "
                         f"(at most {MAX_QUERIES} query heads per KV head, head_dim {MAX_HEAD_DIM})")  # fmt: skip


#: :func:`sparse_attend`'s kernel arguments without a resident pool ``(pool_k, pool_v, slots, n_res)``
#: and without in-place critical sets ``(host_k, host_v, slots, c_lo, n_crit)``.
_NO_RESIDENT = (None, None, None, 0)
_NO_CRITICAL = (None, None, None, 0, 0)


def _check_attend_inputs(q: torch.Tensor, q_tok: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                         mask: torch.Tensor, out: torch.Tensor, out_tok: torch.Tensor) -> None:  # fmt: skip
    """:func:`sparse_attend`'s checks of its queries, ring slot, mask and outputs (its Args);
    ValueError naming the dtypes, layouts or shapes it does not take."""
    r, p = q_tok.shape
    _, hkv, ncols, d = keys.shape
    hq = q.shape[1]
    if q.dtype not in _ATTEND_DTYPES or out.dtype != q.dtype or keys.dtype not in _ATTEND_DTYPES \
            or values.dtype != keys.dtype:  # fmt: skip
        raise ValueError(f"sparse_attend: dtypes q {q.dtype}, out {out.dtype}, keys {keys.dtype}, values {values.dtype}")
    if q.stride(2) != 1 or q.stride(1) != d or out.stride(2) != 1 or out.stride(1) != d or hq % hkv \
            or q.shape[2] != d or not (keys.is_contiguous() and values.is_contiguous() and mask.is_contiguous()
                                       and q_tok.is_contiguous() and out_tok.is_contiguous()):  # fmt: skip
        raise ValueError(f"sparse_attend: layouts q {tuple(q.shape)} {q.stride()}, out {out.stride()}, keys "
                         f"{tuple(keys.shape)}: heads D apart, slot/mask/tokens contiguous, Hq % Hkv == 0")  # fmt: skip
    if mask.shape[:2] != (r, p) or mask.shape[2] > ncols or keys.shape[0] < r or values.shape != keys.shape:
        raise ValueError(f"sparse_attend: mask {tuple(mask.shape)} / slot {tuple(keys.shape)} do not match "
                         f"{r} rows x {p} positions")  # fmt: skip


def _resident_pointers(resident: tuple[torch.Tensor, torch.Tensor, torch.Tensor], keys: torch.Tensor,
                       r: int) -> tuple[int, int, int, int]:  # fmt: skip
    """:func:`sparse_attend`'s ``resident`` ``(pool_k, pool_v, slots)`` checked against the ring slot
    ``keys`` and ``r`` rows: ``(pool_k, pool_v, slots)`` data pointers and ``n_res``; ValueError otherwise."""
    _, hkv, _, d = keys.shape
    pool_k, pool_v, res = resident
    if pool_k.dtype != keys.dtype or pool_v.dtype != keys.dtype or pool_k.shape[1:] != (hkv, d) \
            or pool_v.shape != pool_k.shape or res.shape[0] != r or res.dtype != torch.int64 \
            or not (pool_k.is_contiguous() and pool_v.is_contiguous() and res.is_contiguous()):  # fmt: skip
        raise ValueError(f"sparse_attend: resident pool {tuple(pool_k.shape)} {pool_k.dtype} / slots "
                         f"{tuple(res.shape)} {res.dtype} do not match the slot {tuple(keys.shape)} {keys.dtype}")
    return pool_k.data_ptr(), pool_v.data_ptr(), res.data_ptr(), res.shape[1]


def _critical_pointers(critical: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int], keys: torch.Tensor,
                       r: int) -> tuple[int, int, int, int, int]:  # fmt: skip
    """:func:`sparse_attend`'s ``critical`` ``(host_k, host_v, slots, c_lo)`` checked against the ring
    slot ``keys`` and ``r`` rows: ``(host_k, host_v, slots)`` data pointers, ``c_lo`` and ``n_crit``
    (critical columns per row and KV head); ValueError otherwise."""
    _, hkv, _, d = keys.shape
    host_k, host_v, crit, c_lo = critical
    if host_k.dtype != keys.dtype or host_v.dtype != keys.dtype or host_k.shape[1:] != (hkv, d) \
            or host_v.shape != host_k.shape or crit.dim() != 3 or tuple(crit.shape[:2]) != (r, hkv) \
            or crit.dtype != torch.int64 or not (host_k.is_contiguous() and host_v.is_contiguous()
                                                 and crit.is_contiguous()) or c_lo < 0:  # fmt: skip
        raise ValueError(f"sparse_attend: host tier {tuple(host_k.shape)} {host_k.dtype} / critical slots "
                         f"{tuple(crit.shape)} {crit.dtype} do not match the slot {tuple(keys.shape)} {keys.dtype}")
    return host_k.data_ptr(), host_v.data_ptr(), crit.data_ptr(), int(c_lo), int(crit.shape[2])
