"""Layer-scoped device buffers for the sparse rows' attention K/V: a ring of ``depth + 1`` layer slots.

A decode step of the sparse path needs, per layer, the K/V its sparse rows
attend to in one device buffer: the critical set (copied from the host tier),
the resident set (gathered from the device pool at attention time) and each
speculated token's own K/V. Only the layers in flight need it at once: the
layer being attended and the ``depth`` layers whose copies run ahead of it
(:mod:`dd_sglang.prefetch.schedule`). So the buffer is a ring of ``depth + 1``
slots, layer ``l`` using slot ``l % (depth + 1)``, not one buffer per layer.

Bytes (exact, what :attr:`LayerRingBuffer.nbytes` reports)::

    2 (K and V) x (depth + 1) x rows x num_kv_heads x columns x head_dim x dtype.itemsize

where ``rows`` and ``columns`` (resident + critical + 1 per row,
:attr:`dd_sglang.prefetch.step_plan.ColumnLayout.columns`) are the capacities reserved
for the running batch (:meth:`LayerRingBuffer.reserve`: grown when a step needs
more, kept while steps fit, released when no sparse row runs). Slots are
zero-filled when allocated: masked columns are never read as NaN.
"""

from __future__ import annotations

import torch


class LayerRingBuffer:
    """Critical-set K/V slots for the layers in flight.

    Args:
        depth: prefetch depth ``w`` (>= 0): slots = ``w + 1``.
        device: where the slots live (the device tier's device).
        dtype: the KV dtype.

    Raises:
        ValueError: ``depth < 0``.
    """

    def __init__(self, depth: int, device: torch.device | str, dtype: torch.dtype):
        if depth < 0:
            raise ValueError(f"prefetch.depth must be >= 0, got {depth}")
        self.depth = depth
        self.n_slots = depth + 1
        self.device = torch.device(device)
        self.dtype = dtype
        self.k: torch.Tensor | None = None  # [n_slots, rows, Hkv, columns, D]
        self.v: torch.Tensor | None = None
        self.peak_bytes = 0
        self.allocations = 0

    @property
    def shape(self) -> tuple[int, ...]:
        """``(n_slots, rows, num_kv_heads, columns, head_dim)`` reserved, or ``()`` when released."""
        return tuple(self.k.shape) if self.k is not None else ()

    @property
    def nbytes(self) -> int:
        """Device bytes held now (K and V, every slot)."""
        return 0 if self.k is None else self.k.nbytes + self.v.nbytes

    def reserve(self, rows: int, num_kv_heads: int, k: int, head_dim: int) -> None:
        """Make every slot hold at least ``[rows, num_kv_heads, k, head_dim]`` (``k``: columns).

        Reallocates (contents lost) only when a dimension grows or the head layout changes;
        ``rows == 0`` releases the buffer.
        """
        if rows <= 0 or k <= 0:
            self.release()
            return
        if self.k is not None:
            _, r0, h0, k0, d0 = self.k.shape
            if r0 >= rows and k0 >= k and h0 == num_kv_heads and d0 == head_dim:
                return
            rows, k = max(rows, r0), max(k, k0)
        shape = (self.n_slots, rows, num_kv_heads, k, head_dim)
        self.k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.allocations += 1
        self.peak_bytes = max(self.peak_bytes, self.nbytes)

    def slot(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V views of the slot layer ``layer`` uses: ``[rows, num_kv_heads, columns, head_dim]`` each.

        Raises:
            RuntimeError: nothing is reserved.
        """
        if self.k is None:
            raise RuntimeError("LayerRingBuffer.slot() before reserve()")
        i = layer % self.n_slots
        return self.k[i], self.v[i]

    def release(self) -> None:
        """Give the slots back (no sparse rows in the batch)."""
        self.k = self.v = None
