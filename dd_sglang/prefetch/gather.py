"""Critical-set gather: host-tier K/V rows into a layer ring slot, one call per layer for every row and head.

Each selected token of each KV head is one row of ``head_dim`` elements in the
host tier (a layer's ``[slots, Hkv, D]`` buffer viewed as ``[slots x Hkv, D]``:
row ``slot x Hkv + h``); its destination is one row of the ring slot (a
``[R, Hkv, N, D]`` buffer viewed as ``[R x Hkv x N, D]``: row
``(r x Hkv + h) x N + c``, :func:`ring_rows`). :func:`flat_rows` builds the
source index once per layer; :meth:`RingGather.copy` moves the rows. Three ways, by where the ring
lives:

* ``cpu``: the "device" is the CPU; each row is copied once, straight into its
  ring row (the C kernel's :func:`~dd_sglang.kernels.native.gather_rows`, on
  PyTorch's threads; 0.37 against 1.05 ms for 30 layers at 1 row and 2.7
  against 6.4 ms at 8 rows of 3 x 256 bf16 rows, SmolLM2's shapes), or, where
  the kernel is not built, one ``index_select`` per K and V written into the
  slot.
* ``kernel`` (CUDA, the default there): SGLang's own host-to-device transfer
  kernel (``sgl_kernel.kvcacheio.transfer_kv_per_layer``, the one HiCache and
  HiSparse use) reads the pinned host tier directly by index (zero copy through
  unified addressing) with a bounded number of thread blocks
  (:data:`BLOCK_QUOTA`), so it takes few SMs from the layers computing beside
  it. Measured on an H200 (DESIGN.md): such a gather moves 93-100% of pinned
  memcpy bandwidth for 256-byte rows, against 55-70% for a 16-core host gather
  plus a copy; so it is the default where ``sgl_kernel`` imports.
* ``staging`` (CUDA): a host ``index_select`` into a pinned staging buffer
  (one per ring slot, reused; an event keeps a refill from overtaking the
  copy still reading it), then one copy-engine transfer.

The CUDA modes have not run in this repository's tests (no GPU here); they are
written against the documented calls and covered by
``tests/test_transfer_schedule_cuda.py`` where CUDA exists.
"""

from __future__ import annotations

import torch

from dd_sglang.kernels import native as native_kernel

#: Thread blocks per SM the transfer kernel may use (sgl_kernel's ``block_quota``; its default is 2).
BLOCK_QUOTA = 1


def flat_rows(slots: torch.Tensor) -> torch.Tensor:
    """``[..., n, Hkv, k]`` host slots -> ``[..., n x Hkv x k]`` int64 rows of a layer's ``[slots x Hkv, D]``
    view (leading dimensions, e.g. layers, are kept)."""
    hkv = slots.shape[-2]
    return (slots * hkv + torch.arange(hkv, device=slots.device).view(hkv, 1)).flatten(-3)


def ring_rows(rows: torch.Tensor, hkv: int, columns: int, c0: int, width: int) -> torch.Tensor:
    """Destination rows of a ``[R, Hkv, columns, D]`` slot for plan rows ``rows``, columns ``[c0, c0 + width)``.

    Returns ``[len(rows) x Hkv x width]`` int64, in the order :func:`flat_rows` lists sources.
    """
    base = (rows.view(-1, 1, 1) * hkv + torch.arange(hkv).view(1, hkv, 1)) * columns
    return (base + c0 + torch.arange(width).view(1, 1, width)).flatten()


class RingGather:
    """Moves host-tier rows into ring slots (module docstring).

    Args:
        host_k, host_v: the host tier's ``[layers, slots, Hkv, D]`` buffers (pinned on CUDA hosts).
        device: the ring's device.
        mode: ``auto`` (``cpu`` on a CPU device; on CUDA ``kernel`` where ``sgl_kernel`` imports,
            else ``staging``), or one of ``cpu``, ``kernel``, ``staging``.
        native: ``cpu`` mode copies with the C kernel where it is built (``experimental.kernel``
            ``torch`` turns it off).

    Raises:
        ValueError: an unknown mode, or a CUDA mode on a CPU device.
    """

    def __init__(self, host_k: torch.Tensor, host_v: torch.Tensor, device: torch.device, mode: str = "auto",
                 native: bool = True):  # fmt: skip
        self.host_k, self.host_v = host_k, host_v
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self._transfer = None
        if mode == "auto":
            mode = "cpu"
            if cuda:
                mode = "kernel" if self._kernel() is not None else "staging"
        if mode not in ("cpu", "kernel", "staging"):
            raise ValueError(f"experimental.gather must be auto, cpu, kernel or staging, got {mode!r}")
        if mode != "cpu" and not cuda:
            raise ValueError(f"experimental.gather {mode} needs a CUDA device, the ring is on {self.device}")
        if mode == "kernel" and self._kernel() is None:
            raise ValueError("experimental.gather kernel needs sgl_kernel (SGLang's CUDA kernels)")
        self.mode = mode
        # The C copies write through host pointers: a CPU ring only (``cpu`` mode on a CUDA ring
        # gathers on the host, then copies to the device).
        self.native = native and mode == "cpu" and not cuda and native_kernel.available()
        self._copy = (self._copy_kernel if mode == "kernel" else self._copy_staging if mode == "staging"
                      else self._copy_native if self.native else self._copy_cpu)  # fmt: skip
        self._dst_cache: dict[tuple, torch.Tensor] = {}
        self._staging: dict[int, tuple[torch.Tensor, torch.Tensor, object]] = {}

    def _kernel(self):
        if self._transfer is None:
            try:
                from sgl_kernel.kvcacheio import transfer_kv_per_layer
            except Exception:  # no CUDA build of sgl_kernel here
                return None
            self._transfer = transfer_kv_per_layer
        return self._transfer

    def copy(self, layer: int, src_rows: torch.Tensor, k_dst: torch.Tensor, v_dst: torch.Tensor,
             rows: torch.Tensor | slice, c0: int, width: int, slot: int = 0) -> int:  # fmt: skip
        """Copy host rows ``src_rows`` of ``layer`` (K and V) into columns ``[c0, c0 + width)`` of
        plan rows ``rows`` of a ring slot, by the mode chosen at construction.

        ``k_dst``/``v_dst``: the slot, contiguous ``[R, Hkv, N, D]``; ``src_rows``: ``[n x Hkv x
        width]`` int64 (:func:`flat_rows` of ``[n, Hkv, width]`` slots); ``rows``: the ``n`` plan rows
        (a slice or ``[n]`` int64); ``slot``: the ring slot index (staging buffers are per slot).
        On CUDA the call is asynchronous on the current stream. Returns the bytes moved (K and V).
        """
        return self._copy(layer, src_rows, k_dst, v_dst, rows, c0, width, slot)

    def copy_sets(self, layer: int, slots: torch.Tensor, k_dst: torch.Tensor, v_dst: torch.Tensor,
                  rows: torch.Tensor, c0: int, slot: int = 0) -> int:  # fmt: skip
        """Copy the sets ``slots`` (``[n, Hkv, w]`` int64 host slots of ``layer``) into columns
        ``[c0, c0 + w)`` of plan rows ``rows`` (``[n]`` int64) of a ring slot: :meth:`copy` of their
        :func:`flat_rows`, or, with the C kernel on a contiguous host tier and slot of the same dtype,
        one C call that builds no index (:func:`~dd_sglang.kernels.native.gather_sets`: a set chosen at
        attention time is copied on the forward thread, every layer). Returns the bytes moved."""
        hk, hv = self.host_k[layer], self.host_v[layer]
        if self.native and hk.is_contiguous() and hv.is_contiguous() and self._c_slot(k_dst, v_dst):
            return native_kernel.gather_sets(hk, hv, k_dst, v_dst, slots.contiguous(), rows.to(torch.int64), c0)
        return self.copy(layer, flat_rows(slots), k_dst, v_dst, rows, c0, slots.shape[2], slot)

    def _c_slot(self, k_dst: torch.Tensor, v_dst: torch.Tensor) -> bool:
        """Whether the C copies write this slot: contiguous, the host tier's dtype."""
        return k_dst.dtype == self.host_k.dtype and k_dst.is_contiguous() and v_dst.is_contiguous()

    def _copy_kernel(self, layer, src_rows, k_dst, v_dst, rows, c0, width, slot) -> int:
        """``kernel``: SGLang's transfer kernel reads the pinned host tier from the GPU."""
        d = self.host_k.shape[3]
        src_k, src_v = self.host_k[layer].view(-1, d), self.host_v[layer].view(-1, d)
        r = torch.arange(k_dst.shape[0])[rows] if isinstance(rows, slice) else rows
        dst = ring_rows(r, k_dst.shape[1], k_dst.shape[2], c0, width)
        self._transfer(src_k=src_k, dst_k=k_dst.view(-1, d), src_v=src_v, dst_v=v_dst.view(-1, d),
                       src_indices=src_rows.to(self.device, non_blocking=True),
                       dst_indices=dst.to(self.device, non_blocking=True),
                       item_size=d * src_k.element_size(), block_quota=BLOCK_QUOTA)  # fmt: skip
        return 2 * int(src_rows.numel()) * d * src_k.element_size()

    def _copy_native(self, layer, src_rows, k_dst, v_dst, rows, c0, width, slot) -> int:
        """``cpu`` with the C kernel: one C row copy for K and V (a slot of another dtype or layout:
        PyTorch's indexing)."""
        d = self.host_k.shape[3]
        src_k, src_v = self.host_k[layer].view(-1, d), self.host_v[layer].view(-1, d)
        if not self._c_slot(k_dst, v_dst):
            return self._copy_cpu(layer, src_rows, k_dst, v_dst, rows, c0, width, slot)
        dst = self._dst_rows(rows, k_dst.shape, c0, width)
        native_kernel.gather_rows(src_k, src_v, k_dst.view(-1, d), v_dst.view(-1, d), src_rows, dst)
        return 2 * int(src_rows.numel()) * d * src_k.element_size()

    def _copy_cpu(self, layer, src_rows, k_dst, v_dst, rows, c0, width, slot) -> int:
        """``cpu``: PyTorch's ``index_select`` on the host, then one copy into the slot."""
        d = self.host_k.shape[3]
        src_k, src_v = self.host_k[layer].view(-1, d), self.host_v[layer].view(-1, d)
        self._write(k_dst, v_dst, rows, c0, width, src_k.index_select(0, src_rows), src_v.index_select(0, src_rows))
        return 2 * int(src_rows.numel()) * d * src_k.element_size()

    def _copy_staging(self, layer, src_rows, k_dst, v_dst, rows, c0, width, slot) -> int:
        """``staging``: a host gather into the slot's pinned staging buffers, then one copy to the device
        (an event marks when the buffers may be reused)."""
        d = self.host_k.shape[3]
        src_k, src_v = self.host_k[layer].view(-1, d), self.host_v[layer].view(-1, d)
        kk, vv = self._stage(slot, int(src_rows.numel()), d, src_k.dtype)
        torch.index_select(src_k, 0, src_rows, out=kk)
        torch.index_select(src_v, 0, src_rows, out=vv)
        self._write(k_dst, v_dst, rows, c0, width, kk, vv)
        evt = torch.cuda.Event()
        evt.record()
        self._staging[slot] = (*self._staging[slot][:2], evt)
        return 2 * int(src_rows.numel()) * d * src_k.element_size()

    def _write(self, k_dst, v_dst, rows, c0: int, width: int, kk: torch.Tensor, vv: torch.Tensor) -> None:
        """Gathered host rows ``kk``/``vv`` (``[n x Hkv x width, D]``) into columns ``[c0, c0 + width)`` of ``rows``."""
        if not isinstance(rows, slice):
            rows = rows.to(self.device)
        shape, cols = (-1, k_dst.shape[1], width, kk.shape[1]), slice(c0, c0 + width)
        k_dst[rows, :, cols] = kk.view(shape).to(self.device, non_blocking=True)
        v_dst[rows, :, cols] = vv.view(shape).to(self.device, non_blocking=True)

    def _dst_rows(self, rows: torch.Tensor | slice, shape: torch.Size, c0: int, width: int) -> torch.Tensor:
        """:func:`ring_rows` of ``rows`` in a slot of ``shape``; for a slice of rows (the fixed rows,
        the same every layer of a step) built once per shape and kept (a few distinct keys)."""
        if not isinstance(rows, slice):
            return ring_rows(rows.to(torch.int64), shape[1], shape[2], c0, width)
        key = (rows.start, rows.stop, tuple(shape), c0, width)
        dst = self._dst_cache.get(key)
        if dst is None:
            if len(self._dst_cache) > 64:
                self._dst_cache.clear()
            dst = ring_rows(torch.arange(shape[0])[rows], shape[1], shape[2], c0, width)
            self._dst_cache[key] = dst
        return dst

    def _stage(self, slot: int, m: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Pinned ``[m, D]`` K and V staging views of ``slot``'s buffers, once their last copy finished."""
        got = self._staging.get(slot)
        if got is not None and got[2] is not None:
            got[2].synchronize()  # the transfer that read this buffer last is done
        if got is None or got[0].shape[0] < m:
            k = torch.empty(m, d, dtype=dtype, pin_memory=True)
            v = torch.empty(m, d, dtype=dtype, pin_memory=True)
            got = (k, v, None)
            self._staging[slot] = got
        return got[0][:m], got[1][:m]
