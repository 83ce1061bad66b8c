"""Prepacked bfloat16 linear layers for the CPU platform (oneDNN's blocked weight layout).

On a CPU, PyTorch's ``F.linear`` of bfloat16 tensors runs oneDNN's matmul and
reorders the ``[out, in]`` weight into oneDNN's blocked layout on every call.
A decode step of a small model is mostly such calls with a few rows each
(``python -m bench.decode_speed --unpacked-dense`` measures the served effect
of packing once instead). SGLang's
own CPU engine packs weights the same way for its ``sgl_kernel`` AMX path
(``_amx_process_weight_after_loading`` in
``sglang/srt/layers/quantization/unquant.py``), which this platform cannot load.

:func:`packed_linear` packs a layer's weight once, on its first call
(``torch.ops.mkldnn._reorder_linear_weight``, the op PyTorch Inductor's CPU
weight-freezing pass uses), and then runs ``torch.ops.mkldnn._linear_pointwise``
on it, for products of at most :data:`PACK_MAX_ROWS` rows (decode steps; prefill
keeps ``F.linear``). A pack is used only where it is exact: before first use it
must give the same bits as ``F.linear`` on probe inputs of every row count it
may take (with the layer's bias, on the intra-op thread count of the call: a
CPU step that splits off its selection runs on 1 thread, others on all); a
weight that fails keeps ``F.linear`` there (logged). The probe runs once per weight shape,
bias or none and thread count (:data:`_probed`), on the first weight of that
kind, and its verdict holds for the others: whether two products give the same
bits is a property of the code paths oneDNN and PyTorch choose, which follow
the shapes, dtypes and threads, not the weights' values (SmolLM2's 121 linear
weights have 5 shapes: the start-up's first forward probes 5 of them, not
121; on 2 cores the probes of one weight per shape took ~0.9 s against ~9 s
estimated for all 121, and a server's first forward ~1 s against ~4 s). Packs are
dropped after each of SGLang's weight updates (:func:`invalidate_packs`, hooked
in ``patches/managers_scheduler_components_weight_updater.py``: their loaders
write through ``param.data``, which no version counter sees) and when a
layer's weight tensor is replaced (storage pointer or version changed).

Cost: one more copy of every packed weight in host memory (the tied
embedding keeps its plain copy for lookups). ``DD_SGLANG_CPU_PREPACK=0`` in the
launcher's environment turns packing off.

**Row buckets.** Products of more rows (prefill chunks) keep ``F.linear``, but
:func:`bucketed_linear` pads their rows with zeros up to :func:`bucket_rows`
(8 sizes per octave, at most 1/8 of the rows padding) and returns the real
rows. oneDNN builds a primitive per row count and weight shape and caches it
(:data:`dd_sglang.platform.ONEDNN_CACHE_CAPACITY` entries); real traffic brings
a new prompt length, so a new last-chunk row count, with nearly every request,
and each one built primitives that evicted others, whose freed memory the
scheduler kept (``docs/operations-memory.md``: ~1.15 MiB a request). With
buckets, a 4,096-row chunk size has 56 row counts above 32, 224 entries for
SmolLM2's 4 weight shapes, built once. Padding changes no real row's meaning but
may change its last bits where oneDNN blocks the product differently for the
padded count (2 of 68 (shape, rows) pairs on the AMX host this was written on),
as a different chunk size does. ``DD_SGLANG_CPU_ROW_BUCKETS=0`` turns it off.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

from dd_sglang.platform import PREPACK_ENV, ROW_BUCKETS_ENV

log = logging.getLogger(__name__)

#: Most rows (tokens: decode rows x query positions) a product takes through the pack; larger
#: products (prefill chunks) keep ``F.linear``. On the 2-core CPU this was written on, with 2 threads, the pack
#: gave other bits than ``F.linear`` for some shapes from 300 rows up (576 x 576 weights), where
#: oneDNN splits the work differently.
PACK_MAX_ROWS = 32
#: Row counts of the exactness probe: every count a packed product can take.
PROBE_ROWS = tuple(range(1, PACK_MAX_ROWS + 1))
#: oneDNN's batch-size hint for the packed layout. With 2, the packed product equalled ``F.linear``
#: bit for bit up to 64 rows on the machine this was written on (1 and 2 threads); with 1 it did
#: not from 64 rows up. :func:`_exact` checks it wherever it runs.
BATCH_HINT = 2
_ATTR = "_dd_prepacked"
#: (weight shape, has bias, threads) -> whether the pack of the first such weight was exact (:func:`_pack`).
_probed: dict[tuple, bool] = {}
_generation = 0
_logged = False


#: Row buckets per octave (:func:`bucket_rows`).
BUCKETS_PER_OCTAVE = 8
_BUCKETS = os.environ.get(ROW_BUCKETS_ENV, "1").strip() != "0"


def _cpu_bf16(w, x: torch.Tensor) -> bool:
    """Whether ``w`` is a tensor and ``w`` and ``x`` are both bfloat16 on the CPU."""
    return (isinstance(w, torch.Tensor) and w.dtype == x.dtype == torch.bfloat16
            and w.device.type == x.device.type == "cpu")  # fmt: skip


def bucket_rows(rows: int) -> int:
    """The row count a product of ``rows`` rows runs at: ``rows`` itself up to :data:`PACK_MAX_ROWS`
    (decode steps), else ``rows`` rounded up to a multiple of 1/8 of its octave's lower bound
    (:data:`BUCKETS_PER_OCTAVE` sizes per octave: 36, 40, ..., 64, 72, ..., 128, ..., 3840, 4096), so
    at most 1/8 of the rows are padding."""
    if rows <= PACK_MAX_ROWS:
        return rows
    step = 1 << ((rows - 1).bit_length() - 1 - (BUCKETS_PER_OCTAVE.bit_length() - 1))  # octave lower bound / 8
    return -(-rows // step) * step


def bucketed_linear(layer: torch.nn.Module, x: torch.Tensor, run) -> torch.Tensor | None:
    """``run`` (the layer's own product, ``[rows, in] -> [rows, out]``) on ``x``'s rows padded with zeros
    to :func:`bucket_rows`, the real rows returned (module docstring), or None where this does not
    apply: buckets off (:data:`dd_sglang.platform.ROW_BUCKETS_ENV` "0"), not a CPU bfloat16 input and
    weight, at most :data:`PACK_MAX_ROWS` rows, or rows already a bucket.

    Args:
        layer: a module with a ``weight`` ``[out, in]`` tensor.
        x: ``[..., in]`` activations.
        run: the product, called once on a ``[bucket_rows(rows), in]`` tensor.

    Returns:
        ``[..., out]``: ``run``'s first ``rows`` rows.
    """
    if not _BUCKETS or not _cpu_bf16(getattr(layer, "weight", None), x):
        return None
    width = x.shape[-1]
    rows = x.numel() // width if width else 0
    padded = bucket_rows(rows)
    if padded == rows:
        return None
    xp = x.new_empty(padded, width)
    xp[:rows] = x.reshape(rows, width)
    xp[rows:].zero_()
    out = run(xp)[:rows]
    return out.reshape(*x.shape[:-1], out.shape[-1])


def invalidate_packs() -> None:
    """Drop every pack (each layer packs again on its next call): after SGLang changed weights."""
    global _generation
    _generation += 1


def prepack_enabled() -> bool:
    """Whether packing is on: bfloat16 oneDNN available and :data:`PREPACK_ENV` not "0"."""
    if os.environ.get(PREPACK_ENV, "1").strip() == "0":
        return False
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


_ENABLED = prepack_enabled()


def _exact(weight: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the pack gives ``F.linear``'s bits (and, without bias, ``torch.matmul(x, weight.T)``'s:
    SGLang's lm_head product) on random bfloat16 inputs of :data:`PROBE_ROWS` rows."""
    gen = torch.Generator().manual_seed(0)
    for rows in PROBE_ROWS:
        x = torch.randn(rows, weight.shape[1], generator=gen).to(weight.dtype)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        if not torch.equal(F.linear(x, weight, bias), got):
            return False
        if bias is None and not torch.equal(torch.matmul(x, weight.T), got):  # SGLang's lm_head product
            return False
    return True


def _verdict(weight: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``packed`` is exact on the calling thread's current intra-op thread count: the
    probe's verdict for the weight's shape, bias or none and that count, probed here on first need
    (module docstring). A count can change while a server runs: a CPU step whose next-step
    selection runs on the select worker (``experimental.select: split``) runs its forward on 1 thread."""
    kind = (tuple(weight.shape), bias is not None, torch.get_num_threads())
    exact = _probed.get(kind)
    if exact is None:
        exact = _probed[kind] = _exact(weight, packed, bias)
        if not exact:
            log.warning("dd_sglang: packed bf16 linear %s differs from F.linear on %d threads; keeping "
                        "F.linear there", kind[0], kind[2])  # fmt: skip
    return exact


def _pack(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """oneDNN's packed copy of ``weight`` (``[out, in]`` bfloat16), or None where it is not exact
    on the current thread count (probed once per shape, bias or none and thread count: module
    docstring)."""
    global _logged
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT)
    if _verdict(weight, packed, bias):
        if not _logged:
            _logged = True
            log.info("dd_sglang: bf16 linear weights packed in oneDNN's layout on first use (%s=0 turns it off)",
                     PREPACK_ENV)  # fmt: skip
        return packed
    return None


def packed_linear(layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``F.linear(x, layer.weight, bias)`` through the layer's packed weight, or None where this path
    does not apply (the caller then runs its own ``F.linear``).

    Args:
        layer: a module with a ``weight`` ``[out, in]`` tensor (SGLang's linear layers).
        x: ``[..., in]`` activations.
        bias: ``[out]`` or None.

    Returns:
        ``[..., out]`` in ``x``'s dtype, the same bits as ``F.linear`` (module docstring), or None:
        packing off, not a CPU bfloat16 weight and input, a weight that needs gradients, a layer
        on SGLang's own AMX backend, a pack that was not exact, or more than :data:`PACK_MAX_ROWS`
        rows.
    """
    w = getattr(layer, "weight", None)
    if (
        not _ENABLED
        or not _cpu_bf16(w, x)
        or w.dim() != 2
        or w.requires_grad
        or getattr(layer, "use_intel_amx_backend", False)  # SGLang's own AMX path packed it already
        or (bias is not None and bias.dtype != torch.bfloat16)
        or x.numel() > PACK_MAX_ROWS * x.shape[-1]
    ):
        return None
    try:
        version = w._version
    except RuntimeError:  # an inference-mode tensor keeps no version counter (and cannot change in place)
        version = -1
    key = (_generation, w.data_ptr(), version, bias is None)
    entry = layer.__dict__.get(_ATTR)
    if entry is None or entry[0] != key:
        entry = (key, _pack(w.detach(), bias))
        layer.__dict__[_ATTR] = entry
    packed = entry[1]
    if packed is None or not _verdict(w, packed, bias):  # exact at the count it was packed at, not this one
        return None
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
