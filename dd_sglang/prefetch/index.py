"""Key indexes of the host tier: the int8 copy of its keys and its per-block min/max summaries.

**Quantised key index** (``spec_host``). :class:`QuantKeyIndex` keeps an int8
copy of every host-tier key, one absmax scale per token, layer and KV head
(float32), in host memory: ``num_layers x host_slots x num_kv_heads x
(head_dim + 4)`` bytes, 68/256 of a bfloat16 tier's K+V bytes (68/512 of a
float32 one). A selection quantises the query heads too and scores every
candidate with one int8 x int8 GEMM per row (a quarter of a float32 key's
bytes, half of a bfloat16 one's), then re-ranks the best ``rerank x k`` with
the exact keys. Measured on SmolLM2 (``bench/index_recall.py``,
``bench/results/index_recall_cpu.json``): at 4k and 7.9k tokens and k 256
the re-ranked set holds 0.999 of the exact top 256.

**Block index** (``quest_device``). :class:`KeyBlockIndex` keeps, per layer, the element-wise min and
max of the keys of every block of :data:`BLOCK_TOKENS` consecutive host-tier
slots (Quest's page summaries: Tang et al., "Quest", ICML 2024, section 3),
``shape: [num_layers, num_blocks, num_kv_heads, head_dim]`` each, in the host
tier's dtype. The host tier allocates whole pages of ``sparse.page_size``
contiguous slots (a multiple of the block size), so block ``b`` is slots
``[16 b, 16 b + 16)`` and holds 16 consecutive positions of one request. A
request's blocks are summarised when its KV reaches the host tier (offload,
then each page flush): :meth:`KeyBlockIndex.update`. Where it lives decides
what it costs: in host memory (``spec_host``) it is host bytes and no device
state; on the device (``quest_device``) it is auxiliary device state.
Bytes: ``2 x num_layers x (host_slots / 16) x num_kv_heads x head_dim x
itemsize`` = 1/16 of the host tier's bytes.

**Block means** (two-level selection, ``experimental.first_level_tokens``). With ``block_means``,
:class:`QuantKeyIndex` also keeps, per layer, 16-slot block and KV head, the mean of the block's
keys quantised like a key (int8, one absmax scale): ``num_layers x (host_slots / 16) x
num_kv_heads x (head_dim + 4)`` bytes, 1/16 of the index. The C kernel ranks a row's blocks by
them before it scores tokens (:func:`dd_sglang.kernels.native.spec_host_select`, ``pages``). An
exact alternative was measured first and rejected: Quest's min/max bound (above) orders blocks
with a guarantee, but on SmolLM2's keys at 7.9k tokens a scan in bound order must read 99.7% of the
16-token blocks before the next bound falls below the 512th (``rerank x k``-th) score (``bench.select_recall``).

The step's candidates and the batched scoring that reads these indexes (and the tier's keys in
place) are in :mod:`dd_sglang.prefetch.scoring`.
"""

from __future__ import annotations

import torch

from dd_sglang.kernels import native as native_kernel
from dd_sglang.kvcache.host_memory import host_zeros
from dd_sglang.prefetch.scoring import (
    BLOCK_TOKENS,
    RowBlocks,
    block_diagonal,
    int8_matmul,
    token_products,
    token_rows,
)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros on ``device``; in host memory, on huge pages (:func:`~dd_sglang.kvcache.host_memory.host_zeros`)."""
    if device.type == "cpu":
        return host_zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


class KeyBlockIndex:
    """Min/max key summaries of every 16-slot block of a host tier (module docstring).

    Args:
        host_k: the host tier's keys, ``shape: [num_layers, host_slots, num_kv_heads, head_dim]``
            (``HostSparseKVPool.k``); ``host_slots`` a multiple of :data:`BLOCK_TOKENS`.
        device: where the summaries live (``"cpu"``: host memory).

    Raises:
        ValueError: ``host_slots`` is not a multiple of :data:`BLOCK_TOKENS`.
    """

    def __init__(self, host_k: torch.Tensor, device: torch.device | str = "cpu"):
        n_layers, slots, hkv, d = host_k.shape
        if slots % BLOCK_TOKENS:
            raise ValueError(f"host tier slots ({slots}) must be a multiple of {BLOCK_TOKENS}")
        self.host_k = host_k
        self.device = torch.device(device)
        shape = (n_layers, slots // BLOCK_TOKENS, hkv, d)
        self.mins = _zeros(shape, host_k.dtype, self.device)
        self.maxs = _zeros(shape, host_k.dtype, self.device)

    @property
    def nbytes(self) -> int:
        """Bytes of the summaries (both tensors, every layer)."""
        return self.mins.nbytes + self.maxs.nbytes

    def update(self, host_slots: torch.Tensor, start: int, end: int) -> None:
        """Summarise positions ``[start, end)`` of one request, every layer.

        Whole blocks are recomputed (the block holding ``start`` may have been summarised
        partially before); a last partial block is summarised over its valid positions.

        Args:
            host_slots: ``[>= end]`` int64, the request's host slot per position.
            start, end: positions, ``0 <= start < end``.

        Raises:
            ValueError: the positions' slots are not whole contiguous aligned blocks (the host
                tier's page layout guarantees they are).
        """
        b = BLOCK_TOKENS
        slots, _, blocks = block_slots(host_slots, start, end)
        keys = self.host_k[:, slots.flatten()]  # [L, n, Hkv, D]
        keys = keys.view(keys.shape[0], -1, b, *keys.shape[2:])
        blocks = blocks.to(self.device)
        self.mins[:, blocks] = keys.amin(dim=2).to(self.device)
        self.maxs[:, blocks] = keys.amax(dim=2).to(self.device)


def block_slots(host_slots: torch.Tensor, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The 16-slot blocks holding positions ``[start, end)`` of one request.

    Args:
        host_slots: ``[>= end]`` int64, the request's host slot per position.
        start, end: positions, ``0 <= start < end``.

    Returns:
        ``(slots, valid, blocks)``: ``[n, 16]`` int64 host slots of each block's positions (past
        ``end - 1`` repeated as ``end - 1``'s slot), ``[n, 16]`` bool whether each is below ``end``,
        and ``[n]`` int64 block numbers (``slot // 16``).

    Raises:
        ValueError: the positions' slots are not whole contiguous aligned blocks (the host tier's
            page layout guarantees they are).
    """
    b = BLOCK_TOKENS
    pos = torch.arange(start // b * b, -(-end // b) * b)
    valid = (pos < end).view(-1, b)
    slots = host_slots[pos.clamp_(max=end - 1)].view(-1, b)
    base = slots[:, 0]
    full = valid[:, -1]
    expect = base.unsqueeze(1) + torch.arange(b)
    if base.remainder(b).any() or not torch.equal(slots[full], expect[full]):
        raise ValueError("host slots are not contiguous 16-aligned blocks; the block index needs them")
    return slots, valid, base // b


def _quantize_(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., D]`` float32 as int8 with one absmax scale per vector: ``(round(x / s)`` to even, clamped
    to [-127, 127], ``s = max(max |x|, 1e-12) / 127)``; ``x`` is overwritten (it becomes ``x / s``)."""
    s = x.abs().amax(dim=-1).clamp_(min=1e-12).div_(127.0)
    return x.div_(s.unsqueeze(-1)).round_().clamp_(-127, 127).to(torch.int8), s


#: :meth:`QuantKeyIndex.update`: largest float32 temporary of one chunk of positions (bytes).
UPDATE_CHUNK_BYTES = 32 << 20


class QuantKeyIndex:
    """Int8 copy of the host tier's keys with per-token absmax scales (module docstring).

    ``q8[l, s, h] = round(k / scale[l, s, h])``, ``scale = max |k| / 127`` over ``head_dim``, so
    ``q . k ~= scale x (q . q8)``.

    Args:
        host_k: the host tier's keys, ``[num_layers, host_slots, num_kv_heads, head_dim]``.
        device: where the copy lives (``"cpu"``: host memory).
        native: quantise with the C kernel (:func:`dd_sglang.kernels.native.quantize_keys`, the
            same bytes in one pass) where the keys and the copy are contiguous in host memory.
        block_means: also keep the 16-slot blocks' int8 mean keys (:attr:`block_means`).

    Raises:
        ValueError: ``block_means`` and ``host_slots`` is not a multiple of :data:`BLOCK_TOKENS`.
    """

    def __init__(self, host_k: torch.Tensor, device: torch.device | str = "cpu", native: bool = False,
                 block_means: bool = False):  # fmt: skip
        n_layers, slots, hkv, d = host_k.shape
        self.host_k = host_k
        self.device = torch.device(device)
        self.native = (native and host_k.device.type == "cpu" and self.device.type == "cpu"
                       and host_k.is_contiguous())  # fmt: skip
        self.q8 = _zeros((n_layers, slots, hkv, d), torch.int8, self.device)
        self.scale = _zeros((n_layers, slots, hkv), torch.float32, self.device)
        #: ``(means, scales)``: ``[L, S / 16, Hkv, D]`` int8 and ``[L, S / 16, Hkv]`` float32, the mean
        #: key of every 16-slot block quantised like a key (module docstring); None without ``block_means``.
        self.block_means: tuple[torch.Tensor, torch.Tensor] | None = None
        if block_means:
            if slots % BLOCK_TOKENS:
                raise ValueError(f"host tier slots ({slots}) must be a multiple of {BLOCK_TOKENS}")
            nb = slots // BLOCK_TOKENS
            self.block_means = (_zeros((n_layers, nb, hkv, d), torch.int8, self.device),
                                _zeros((n_layers, nb, hkv), torch.float32, self.device))  # fmt: skip

    @property
    def nbytes(self) -> int:
        """Bytes of the int8 keys and their scales (every layer), and of the block means where kept."""
        extra = sum(t.nbytes for t in self.block_means) if self.block_means else 0
        return self.q8.nbytes + self.scale.nbytes + extra

    def update(self, host_slots: torch.Tensor, start: int, end: int) -> None:
        """Quantise positions ``[start, end)`` of one request, layer by layer.

        Args:
            host_slots: ``[>= end]`` int64, the request's host slot per position.
            start, end: positions, ``0 <= start < end``.
        """
        if self.block_means is not None:
            self._update_means(host_slots, start, end)
        all_slots = host_slots[start:end].to(self.host_k.device)
        if self.native:
            native_kernel.quantize_keys(self.host_k, all_slots, self.q8, self.scale)
            return
        n_layers, _, hkv, d = self.host_k.shape
        # Every layer at once (a handful of operations, not ten a layer), in chunks of positions
        # whose float32 keys [L, n, Hkv, D] stay within UPDATE_CHUNK_BYTES (a whole prompt's
        # offload would otherwise make one temporary of its every layer's keys).
        step = max(1, UPDATE_CHUNK_BYTES // (n_layers * hkv * d * 4))
        for i in range(0, all_slots.numel(), step):
            slots = all_slots[i : i + step]
            dst = slots.to(self.device)
            q8, s = _quantize_(self.host_k.index_select(1, slots).float())
            self.q8[:, dst] = q8.to(self.device)
            self.scale[:, dst] = s.to(self.device)

    def _update_means(self, host_slots: torch.Tensor, start: int, end: int) -> None:
        """Recompute the block means of the blocks holding positions ``[start, end)`` (a block
        partly written before is recomputed whole; a last partial block averages its positions
        below ``end``), every layer, in chunks of blocks within :data:`UPDATE_CHUNK_BYTES`."""
        slots, valid, blocks = block_slots(host_slots, start, end)
        means, scales = self.block_means
        n_layers, _, hkv, d = self.host_k.shape
        b = BLOCK_TOKENS
        step = max(1, UPDATE_CHUNK_BYTES // (n_layers * b * hkv * d * 4))
        for i in range(0, blocks.numel(), step):
            sl, w = slots[i : i + step], valid[i : i + step].to(torch.float32)
            keys = self.host_k.index_select(1, sl.flatten().to(self.host_k.device)).float()
            keys = keys.view(n_layers, -1, b, hkv, d).mul_(w.view(1, -1, b, 1, 1))
            mean = keys.sum(dim=2).div_(w.sum(dim=1).view(1, -1, 1, 1))  # [L, n, Hkv, D]
            q8, s = _quantize_(mean)
            dst = blocks[i : i + step].to(self.device)
            means[:, dst] = q8.to(self.device)
            scales[:, dst] = s.to(self.device)

    def candidate_logits(self, q: torch.Tensor, layers: slice, rows: RowBlocks, scale: float) -> torch.Tensor:
        """Approximate logits of every candidate token of every row, int8 x int8, ``L`` layers at once.

        The queries are quantised too (one absmax scale per query head, as the keys per token
        and KV head), so the product is an int8 GEMM (:func:`int8_matmul`) over whole int8
        token rows, every KV head at once, read in place (:func:`token_products`): ``Hkv x D``
        bytes per token and no conversion of the keys. ``q . k ~= s_q x s_k x (q8 . k8)``;
        each factor's rounding error is at most half a step (1/254 of its absmax), which the
        exact re-ranking of the best ``rerank x k`` absorbs.

        Args:
            q: ``[L, rows, num_q_heads, head_dim]``.
            layers: the ``L`` consecutive layers (``slice(l0, l0 + L)``).
            rows: the rows' candidates (:attr:`RowBlocks.tokens`, :attr:`RowBlocks.runs`).

        Returns:
            ``[L, rows, num_kv_heads, group, P]`` float32, ``-inf`` where not a candidate.
        """
        slots, ok = rows.tokens
        r, p = slots.shape
        _, _, hkv, d = self.q8.shape
        n_layers, g = q.shape[0], q.shape[2] // hkv
        qf = q.to(self.device, torch.float32).view(n_layers, r, hkv, g, d)
        qs = qf.abs().amax(dim=-1, keepdim=True).clamp_(min=1e-12).div_(127.0)  # [L, R, Hkv, G, 1]
        w = block_diagonal(qf.div(qs).round_().to(torch.int8))
        q8 = self.q8[layers].view(n_layers, -1, hkv * d)
        prod = token_products(q8, rows, w, int8_matmul, torch.int32)  # [L, R, P, Hkv x G]
        out = prod.transpose(2, 3).to(torch.float32, memory_format=torch.contiguous_format)
        out = out.view(n_layers, r, hkv, g, p)
        ks = token_rows(self.scale[layers], rows)  # [L, R, P, Hkv]
        out.mul_(ks.transpose(2, 3).unsqueeze(3)).mul_(qs.mul_(scale))
        return out.masked_fill_(~ok.to(self.device).view(1, r, 1, 1, p), float("-inf")).cpu()
