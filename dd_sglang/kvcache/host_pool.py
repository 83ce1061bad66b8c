"""``HostSparseKVPool``: the host tier, full K and V of offloaded tokens for every layer.

Extends SGLang's ``HostKVCache`` (``sglang/srt/mem_cache/pool_host/base.py``),
reusing its page-granular slot allocator (``alloc``/``free``/``available_size``,
double-alloc and double-free checks, lock), its host-memory budget check and
its pinning policy. What differs from SGLang's ``MHATokenToKVPoolHost``:

* Layout is layer-first, ``k``/``v`` of ``shape: [num_layers, num_slots, num_kv_heads, head_dim]``,
  so one layer's gather of an arbitrary token subset is one ``index_select``
  per K and V (:meth:`gather`), the access the sparse decode path makes every
  step. SGLang's pool is built around whole-page device<->host transfers.
* Capacity is given in bytes (``host_tier_bytes``) and rounded down to whole pages.
* :meth:`alloc` returns a copy of the free-list slice, never a view (SGLang
  issue #19332: views of the free list kept host RSS alive).
* Unpinned buffers are advised onto transparent huge pages (:mod:`dd_sglang.kvcache.host_memory`):
  the sparse step reads them at scattered rows.
* It is built from plain geometry, not from a device pool's pointer tables,
  so it works on the CPU platform.

Byte accounting: ``capacity_bytes = k.nbytes + v.nbytes`` (padding page
included); ``used_bytes = allocated_slots x bytes_per_token`` with
``bytes_per_token = num_layers x 2 x num_kv_heads x head_dim x itemsize``.
"""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.pool_host.base import HostKVCache

from dd_sglang.kvcache.host_memory import host_zeros
from dd_sglang.kvcache.params import HOST_MEMORY_MARGIN_BYTES, host_memory_available_bytes, kv_bytes_per_token


class HostSparseKVPool(HostKVCache):
    """Host-tier KV pool.

    Args:
        num_layers: transformer layers held (all of them).
        num_kv_heads: KV heads per layer (per TP rank).
        head_dim: K and V head size.
        dtype: element type, e.g. ``torch.bfloat16``.
        capacity_bytes: ``host_tier_bytes``: upper bound on K+V bytes, >= one page plus padding.
        page_size: slots per page (tokens, >= 1); every allocation is whole pages.
        pin_memory: page-lock the buffers (only where CUDA exists; ignored otherwise).

    Raises:
        ValueError: a non-positive dimension, or ``capacity_bytes`` below two pages
            (one usable page plus SGLang's padding page); the message names the field.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        capacity_bytes: int,
        page_size: int = 1,
        pin_memory: bool = False,
    ):
        for name, value in (
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("page_size", page_size),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.layer_num = self.target_layer_num = num_layers
        self.head_num = num_kv_heads
        self.head_dim = head_dim
        itemsize = torch.empty((), dtype=dtype).element_size()
        per_token = kv_bytes_per_token(num_layers, num_kv_heads, head_dim, itemsize)
        usable_pages = capacity_bytes // (per_token * page_size) - 1  # one padding page, as SGLang reserves
        if usable_pages < 1:
            raise ValueError(
                f"host_tier_bytes must be >= {2 * per_token * page_size} (two pages of {page_size} tokens "
                f"x {per_token} B), got {capacity_bytes}"
            )
        super().__init__(
            dtype=dtype,
            device_capacity_tokens=0,
            size_per_token=per_token,
            start_layer=0,
            end_layer=num_layers - 1,
            host_to_device_ratio=0.0,
            host_size=0,
            page_size=page_size,
            layout="layer_first",
            pin_memory=bool(pin_memory and torch.cuda.is_available()),
            device="cpu",
            host_token_capacity=(usable_pages + 1) * page_size,
        )

    def _allocate_host_buffer(self) -> None:
        """Check host memory against :data:`HOST_MEMORY_MARGIN_BYTES`, then allocate the buffers.

        Replaces SGLang's check (10 GiB reserve, HiCache wording) for this pool.

        Raises:
            ValueError: the tier does not fit; the message names ``sparse.host_tier_bytes``.
        """
        requested = self.size * self.size_per_token
        available = host_memory_available_bytes()
        if requested > available:
            raise ValueError(
                f"sparse.host_tier_bytes: the host tier needs {requested} bytes of host memory but only "
                f"{max(available, 0)} are available (free memory less {HOST_MEMORY_MARGIN_BYTES} B); "
                "lower sparse.host_tier_bytes in the preset"
            )
        self.kv_buffer = self.init_kv_buffer()
        self.fd = getattr(self.allocator, "fd", None)

    # --- geometry and accounting -------------------------------------------------
    def get_size_per_token(self) -> int:
        """K+V bytes of one token over all layers."""
        return self.size_per_token

    def init_kv_buffer(self):
        shape = (self.layer_num, self.size, self.head_num, self.head_dim)
        self.k = host_zeros(shape, self.dtype, pin_memory=self.pin_memory)
        self.v = host_zeros(shape, self.dtype, pin_memory=self.pin_memory)
        return [self.k, self.v]

    @property
    def capacity_bytes(self) -> int:
        """Bytes of the K and V buffers, padding page included."""
        return self.k.nbytes + self.v.nbytes

    @property
    def usable_tokens(self) -> int:
        """Slots that can be allocated (the padding page excluded)."""
        return self.size - self.page_size

    @property
    def used_bytes(self) -> int:
        """Bytes of allocated slots."""
        return (self.usable_tokens - self.available_size()) * self.size_per_token

    # --- allocation ------------------------------------------------------------------
    def clear(self) -> None:
        """Free every slot (SGLang's ``clear``), keeping the last page out: it is padding."""
        super().clear()
        self.free_slots = self.free_slots[: self.usable_tokens]

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """``need_size`` slots (a multiple of ``page_size``) as a new int64 tensor, or None if full."""
        got = super().alloc(need_size)
        return None if got is None else got.clone()

    def alloc_tokens(self, n_tokens: int) -> torch.Tensor | None:
        """Slots for ``n_tokens`` tokens, rounded up to whole pages; None if the tier is full.

        Raises:
            ValueError: ``n_tokens`` < 1.
        """
        if n_tokens < 1:
            raise ValueError(f"n_tokens must be >= 1, got {n_tokens}")
        pages = -(-n_tokens // self.page_size)
        return self.alloc(pages * self.page_size)

    # --- data movement ----------------------------------------------------------------
    def write(self, layer_id: int, host_slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store one layer's K/V (``[n, num_kv_heads, head_dim]`` each) at ``host_slots`` (``[n]`` int64)."""
        self.k[layer_id].index_copy_(0, host_slots, k.to(self.dtype, copy=False).cpu())
        self.v[layer_id].index_copy_(0, host_slots, v.to(self.dtype, copy=False).cpu())

    def gather(self, layer_id: int, host_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V at ``host_slots``: two ``index_select`` calls.

        Returns:
            ``(k, v)``, each ``[len(host_slots), num_kv_heads, head_dim]``, new tensors in host memory.
        """
        return self.k[layer_id].index_select(0, host_slots), self.v[layer_id].index_select(0, host_slots)

    def backup_from_device_all_layer(
        self, device_pool, host_indices, device_indices, io_backend=None
    ) -> None:
        """Copy every layer's K/V from SGLang's device pool (``k_buffer[l][device_indices]``) to the host."""
        host = host_indices.cpu().long()
        dev = device_indices.to(device_pool.k_buffer[0].device).long()
        for layer in range(self.layer_num):
            self.write(layer, host, device_pool.k_buffer[layer][dev], device_pool.v_buffer[layer][dev])

    def load_to_device_per_layer(
        self, device_pool, host_indices, device_indices, layer_id, io_backend=None, *, is_draft: bool = False
    ) -> None:
        """Copy one layer's K/V at ``host_indices`` into the device pool at ``device_indices``."""
        k, v = self.gather(layer_id, host_indices.cpu().long())
        dev = device_indices.to(device_pool.k_buffer[layer_id].device).long()
        device_pool.k_buffer[layer_id][dev] = k.to(device_pool.k_buffer[layer_id].device, non_blocking=True)
        device_pool.v_buffer[layer_id][dev] = v.to(device_pool.v_buffer[layer_id].device, non_blocking=True)

    # --- HiCache L3 storage pages: not supported by the host tier ----------------------
    def get_data_page(self, index, flat: bool = True) -> torch.Tensor:
        raise NotImplementedError("HostSparseKVPool does not serve HiCache L3 storage pages")

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        raise NotImplementedError("HostSparseKVPool does not serve HiCache L3 storage pages")

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        raise NotImplementedError("HostSparseKVPool does not serve HiCache L3 storage pages")
