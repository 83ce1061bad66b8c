"""Host-memory buffers for the host tier, backed by transparent huge pages where Linux offers them.

Every sparse decode step reads the host tier at scattered rows: the int8 key index of every
candidate, the bf16 keys of the re-ranked ones, the K/V rows of the critical set. With 4 KiB
pages nearly each such row costs a TLB miss (a SmolLM2 row is 384 B of keys, a 4k-token
request's candidates 3 KiB apart). Buffers from :func:`host_zeros` are anonymous mappings
advised ``MADV_HUGEPAGE`` (``madvise(2)``, Linux >= 2.6.38; Python's :mod:`mmap`), so that the
kernel backs them with 2 MiB pages when ``/sys/kernel/mm/transparent_hugepage/enabled`` is
``always`` or ``madvise``. On this project's CPU machine (THP ``madvise``) a decode step's
selection ran 1.31x faster over such buffers at 4k tokens x 8 rows and 1.22x at 7.9k x 1
(``python -m bench.select_kernel``, ``bench/results/select_kernel_cpu.json``).

The advice changes no value: the buffer reads as zeros and behaves as any CPU tensor. Where the
advice is unavailable (another OS, THP ``never``) the buffer is the same mapping with 4 KiB
pages. Pinned buffers (``pin_memory=True``, CUDA) come from :func:`torch.zeros` unchanged: a
page-locked allocation is CUDA's, not ours to advise. ``DD_SGLANG_HOST_HUGE_PAGES=0`` in the
server's environment leaves the advice out (4 KiB pages): a host whose memory is too fragmented
for 2 MiB pages pays the kernel's compaction at each first touch (THP ``defrag``).
"""

from __future__ import annotations

import logging
import math
import mmap
import os
from pathlib import Path

import torch

from dd_sglang.kvcache.params import HUGE_PAGES_ENV

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20  # x86-64 and arm64 (4 KiB base pages) PMD-sized transparent huge page
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_wanted() -> bool:
    """Whether :func:`host_zeros` advises huge pages (:data:`HUGE_PAGES_ENV`, default on).

    Raises:
        ValueError: the variable is set to something other than ``0`` or ``1`` (names it).
    """
    value = os.environ.get(HUGE_PAGES_ENV, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{HUGE_PAGES_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


def transparent_huge_pages() -> str:
    """The kernel's THP mode: ``always``, ``madvise``, ``never``, or ``unavailable`` (no such file)."""
    try:
        text = THP_ENABLED.read_text()
    except OSError:
        return "unavailable"
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return "unavailable"


def host_zeros(shape: tuple[int, ...], dtype: torch.dtype, *, pin_memory: bool = False) -> torch.Tensor:
    """A zero-filled CPU tensor for the host tier, advised onto huge pages (module docstring).

    Args:
        shape: the tensor's shape (elements >= 0).
        dtype: its element type.
        pin_memory: page-lock it for CUDA copies (then :func:`torch.zeros`, no advice).

    Returns:
        A contiguous, writable CPU tensor of zeros, starting on a 2 MiB boundary when it is at
        least that large (its mapping is up to 2 MiB longer). It owns its mapping: the memory lives as
        long as the tensor (or any view of it) does.

    Raises:
        ValueError: a negative dimension (the message names it), or a bad :data:`HUGE_PAGES_ENV`.
    """
    for i, n in enumerate(shape):
        if n < 0:
            raise ValueError(f"shape[{i}] must be >= 0, got {n}")
    if pin_memory:
        return torch.zeros(shape, dtype=dtype, pin_memory=True)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    pad = HUGE_PAGE_BYTES if nbytes >= HUGE_PAGE_BYTES else 0  # room to start on a 2 MiB boundary
    buf = mmap.mmap(-1, nbytes + pad, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None) if huge_pages_wanted() else None
    if advice is not None:
        try:
            buf.madvise(advice)
        except OSError as exc:  # e.g. a kernel built without THP: plain pages, same values
            logger.debug("madvise(MADV_HUGEPAGE) on %d B failed: %s", nbytes, exc)
    # torch.frombuffer holds a reference to buf, so the mapping outlives this frame
    raw = torch.frombuffer(buf, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE_BYTES if pad else 0  # a multiple of the 4 KiB page
    return raw[start : start + nbytes].view(dtype).view(shape)
