"""The one sparse-attention entry point of the decode step: FlashInfer on CUDA, PyTorch elsewhere.

The attention backend builds one :class:`SparseAttention` for the KV pool's
device, calls :meth:`SparseAttention.plan` once per decode step (right after
the prefetch layer's ``StepPlan``) and :meth:`SparseAttention.run` once per
layer. The implementation is chosen once, at construction, and logged once:

1. ``impl`` (argument, else the environment variable ``DD_SPARSE_ATTENTION``,
   else ``auto``) must be ``auto``, ``flashinfer`` or ``torch``; anything else
   is a ``ValueError`` naming it.
2. ``torch``: the PyTorch reference
   (:func:`~dd_sglang.kernels.sparse_decode.sparse_decode_attention`).
3. A device that is not CUDA: the reference under ``auto``; ``flashinfer`` is a
   ``ValueError``.
4. CUDA: ``import flashinfer`` and build
   :class:`~dd_sglang.kernels.flashinfer_decode.FlashInferSparseDecode`. If that
   fails, ``auto`` falls back to the reference (the log line gives the error);
   ``flashinfer`` raises it.

A step FlashInfer cannot serve (float32 K/V, a head_dim other than 64/128/256)
runs on the reference; a warning says so once per reason.
"""

from __future__ import annotations

import logging
import os

import torch

from dd_sglang.kernels.flashinfer_decode import FlashInferSparseDecode, flashinfer_supports
from dd_sglang.kernels.sparse_decode import sparse_decode_attention

logger = logging.getLogger(__name__)

IMPLS = ("auto", "flashinfer", "torch")
ENV_VAR = "DD_SPARSE_ATTENTION"


class SparseAttention:
    """Sparse decode attention of every sparse row of a step (module docstring).

    Args:
        device: the device of the KV pool (and the layer ring).
        impl: ``auto`` | ``flashinfer`` | ``torch``; None reads ``DD_SPARSE_ATTENTION`` (default ``auto``).
        max_rows: passed to :class:`FlashInferSparseDecode` (index buffers sized up front).

    Attributes:
        kind: ``"flashinfer"`` or ``"torch"``, the implementation chosen.
        reason: why (the logged text).

    Raises:
        ValueError: ``impl`` is not one of :data:`IMPLS`, or ``flashinfer`` on a non-CUDA device.
        ImportError / RuntimeError: ``impl="flashinfer"`` and FlashInfer cannot be set up.
    """

    def __init__(self, device: torch.device | str, impl: str | None = None, max_rows: int = 0):
        self.device = torch.device(device)
        impl = impl if impl is not None else os.environ.get(ENV_VAR, "auto")
        if impl not in IMPLS:
            raise ValueError(f"sparse attention impl ({ENV_VAR}) must be one of {IMPLS}, got {impl!r}")
        self._fi: FlashInferSparseDecode | None = None
        self.kind, self.reason = self._choose(impl, max_rows)
        logger.info("dd_sglang sparse decode attention: %s (%s)", self.kind, self.reason)
        self._mask: torch.Tensor | None = None  # the step's [R, S, N] mask
        self._mask4: torch.Tensor | None = None  # expanded for the reference, per step
        self._use_fi = False
        self._warned: set[str] = set()

    def _choose(self, impl: str, max_rows: int) -> tuple[str, str]:
        if impl == "torch":
            return "torch", "impl 'torch' requested"
        if self.device.type != "cuda":
            if impl == "flashinfer":
                raise ValueError(f"sparse attention impl 'flashinfer' needs a CUDA device, got {self.device}")
            return "torch", f"device {self.device} is not CUDA"
        try:
            self._fi = FlashInferSparseDecode(self.device, max_rows=max_rows)
        except Exception as e:  # ImportError, or a broken install failing at import time
            if impl == "flashinfer":
                raise
            return "torch", f"FlashInfer unavailable on {self.device}: {type(e).__name__}: {e}"
        import flashinfer

        return "flashinfer", f"FlashInfer {getattr(flashinfer, '__version__', '?')} on {self.device}"

    def _warn_once(self, why: str) -> None:
        if why not in self._warned:
            self._warned.add(why)
            logger.warning("dd_sglang sparse decode attention: PyTorch reference for %s", why)

    def plan(self, mask: torch.Tensor, num_kv_heads: int, group: int | None, columns: int,
             dtype: torch.dtype, device: torch.device | str,
             head_dim: int | None = None) -> None:  # fmt: skip
        """Once per decode step, before the first layer's :meth:`run`.

        Args:
            mask: ``shape: [R, S, N], dtype: torch.bool`` (``StepPlan.layout.mask``, ``S = StepPlan.layout.positions``):
                columns each row's real / speculated queries read, the same for every KV head and layer.
            num_kv_heads: ``Hkv`` of the K/V :meth:`run` will get.
            group: query heads per KV head, or None (read from ``q`` at the first :meth:`run`).
            columns: the column stride of the K/V :meth:`run` will get (the layer ring's column
                capacity, ``>= N``).
            dtype: the K/V dtype.
            device: the K/V device (must be this dispatcher's).
            head_dim: or None (read from ``q``).

        Raises:
            ValueError: ``device`` is not this dispatcher's, or bad shapes (the message says which).
        """
        device = torch.device(device)
        if device.type != self.device.type or (device.index or 0) != (self.device.index or 0):
            raise ValueError(f"plan() for {device}, but this SparseAttention serves {self.device}")
        if mask.dim() != 3 or mask.dtype != torch.bool:
            raise ValueError(
                f"mask must be a [rows, positions, columns] bool tensor, got {tuple(mask.shape)} {mask.dtype}"
            )
        if columns < mask.shape[2]:
            raise ValueError(f"columns must be >= mask.shape[2] = {mask.shape[2]}, got {columns}")
        self._mask, self._mask4 = mask, None
        self._use_fi = False
        if self._fi is not None:
            why = flashinfer_supports(dtype, group, head_dim)
            if why is None:
                self._fi.plan(mask, num_kv_heads, columns, dtype, group=group, head_dim=head_dim)
                self._use_fi = True
            else:
                self._warn_once(why)

    def run(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
        """One layer's sparse attention over the planned columns.

        Args:
            q: ``[R, Hkv, S x G, D]`` (GQA folded, :func:`~dd_sglang.kernels.sparse_decode.fold_gqa`).
            keys, values: ``[R, Hkv, N, D]`` (views of the layer ring's slot).
            scale: softmax scale.

        Returns:
            ``[R, Hkv, S x G, D]``: q's dtype on the reference, the K/V dtype on FlashInfer, where
            it is a view of a buffer the next :meth:`run` overwrites (consume or copy it first).

        Raises:
            RuntimeError: no :meth:`plan` before. ValueError: shapes disagree with the plan.
        """
        mask = self._mask
        if mask is None:
            raise RuntimeError("SparseAttention.run() before plan()")
        if self._use_fi:
            s = mask.shape[1]
            why = flashinfer_supports(keys.dtype, q.shape[2] // s, q.shape[3])
            if why is None:
                return self._fi.run(q, keys, values, scale)
            self._warn_once(why)
            self._use_fi = False
        if self._mask4 is None:
            group = q.shape[2] // mask.shape[1]
            self._mask4 = mask.repeat_interleave(group, dim=1).unsqueeze(1)
        return sparse_decode_attention(q, keys, values, self._mask4, scale)
