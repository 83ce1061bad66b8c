"""The key indexes the selectors read, created on first use and shared by every step.

* ``"host"``: the int8 key index (:class:`~dd_sglang.prefetch.index.QuantKeyIndex`) that
  ``spec_host``, ``host_sync`` and verification read, in host memory;
* ``"device"``: ``quest_device``'s per-block min/max summaries
  (:class:`~dd_sglang.prefetch.index.KeyBlockIndex`), on the device tier's device.
"""

from __future__ import annotations

import torch

from dd_sglang.prefetch.index import KeyBlockIndex, QuantKeyIndex


class KeyIndexes:
    """The indexes over one host tier's keys, by location.

    Args:
        host_k: the host tier's keys, ``[layers, slots, Hkv, D]``.
        device: the device tier's device (where ``quest_device``'s index lives).
        native: whether the int8 host index is built and read by the C kernel.
        block_means: whether the int8 host index also keeps its 16-slot blocks' mean keys (the
            two-level selection's first level, ``experimental.first_level_tokens``).
    """

    def __init__(self, host_k: torch.Tensor, device: torch.device, native: bool, block_means: bool = False):
        self.host_k = host_k
        self.device = device
        self.native = native
        self.block_means = block_means
        self.by_location: dict[str, KeyBlockIndex | QuantKeyIndex] = {}

    def index(self, location: str) -> KeyBlockIndex | QuantKeyIndex:
        """The index at ``location`` (``"host"`` or ``"device"``, module docstring), created on first use."""
        idx = self.by_location.get(location)
        if idx is None:
            if location == "host":
                idx = QuantKeyIndex(self.host_k, "cpu", native=self.native, block_means=self.block_means)
            else:
                idx = KeyBlockIndex(self.host_k, self.device)
            self.by_location[location] = idx
        return idx

    def of(self, selector) -> KeyBlockIndex | QuantKeyIndex | None:
        """The index ``selector`` reads (created on first use), or None for a selector that reads none."""
        return self.index(selector.index_location) if selector.index_location else None

    def aux_bytes(self) -> dict[str, int]:
        """Device bytes of selection state by selector (``quest_device``'s device index)."""
        dev = self.by_location.get("device")
        return {"quest_device": dev.nbytes} if dev is not None else {}

    def host_index_bytes(self) -> int:
        """Host bytes of the int8 key index ``spec_host``, ``host_sync`` and verification read."""
        idx = self.by_location.get("host")
        return idx.nbytes if idx is not None else 0
