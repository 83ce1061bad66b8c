"""Named device profiles: which chooser, source and attender a decode step's sparse rows take.

A sparse step has three stages per layer (``docs/architecture.md`` draws them per profile):

* **choose** (:mod:`dd_sglang.prefetch.chooser`): one selection service with three policies, applied
  to each row by its selector: *sync* (the real query's set, at attention time: ``host_sync``,
  ``oracle``, ``quest_device``), *ahead* (the next step's set from the speculated query, after
  attention: ``spec_host``) and *verify* (every ahead row: the real query's set replaces the
  prefetched one before attention);
* **source** (:mod:`dd_sglang.prefetch.sources`): how the critical set's K/V reaches attention:
  ``copy_ahead`` (copied into the layer ring ``depth`` layers ahead, on the copy worker),
  ``copy_inline`` (copied on the forward thread when the layer needs it), ``in_place`` (nothing
  copied: the fused attention reads the host tier by slot);
* **attend** (:mod:`dd_sglang.prefetch.attenders`): ``fused_c`` (the C kernel reads the resident
  set from the device pool and the critical set from the ring or the host tier), ``flashinfer``
  (FlashInfer's paged decode over the ring), ``torch`` (the PyTorch reference over the ring).

Each is picked once, when the runner is built (:func:`resolve_profile`), from the device, the
C kernel's availability and the ``experimental`` switches; the per-layer path then calls the
stages' methods and tests no mode. The two profiles:

==========  ===========================  ===============================  ==========
profile     chooser (its preset)         source                           attender
==========  ===========================  ===============================  ==========
``cpu``     ``host_sync`` (sync)         ``in_place`` (copy_inline for    ``fused_c``
                                         a step under 6 (row, KV head)
                                         pairs or with exact rows)
``gpu``     verified ``spec_host``       ``copy_ahead``                   ``flashinfer``
==========  ===========================  ===============================  ==========

The chooser column names the selector each profile is measured with (``presets/cpu-smollm2.yaml``
sets ``host_sync``; the schema's default ``spec_host`` is the GPU design's); a request's own
``custom_params.dd_selector`` picks its policy within the same service.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dd_sglang.config import ExperimentalSection, choices
from dd_sglang.kernels import native as native_kernel

#: Query positions a row can have (the real one and at most one riding speculated token).
MAX_POSITIONS = 2
SOURCES = ("copy_ahead", "copy_inline", "in_place")
ATTENDERS = ("fused_c", "flashinfer", "torch")


@dataclass(frozen=True)
class DeviceProfile:
    """The stages one runner uses for every step (module docstring).

    Attributes:
        name: ``cpu`` or ``gpu`` (the named profile the device gets), with ``+`` and the
            ``experimental`` switches that changed a stage (``cpu+transfer=inline``).
        chooser: the selector the profile is measured with (``host_sync`` or ``spec_host``).
        source: one of :data:`SOURCES`.
        attender: one of :data:`ATTENDERS`.
    """

    name: str
    chooser: str
    source: str
    attender: str

    def __post_init__(self) -> None:
        for field, value, allowed in (("source", self.source, SOURCES), ("attender", self.attender, ATTENDERS)):
            if value not in allowed:
                raise ValueError(f"DeviceProfile.{field} must be one of {list(allowed)}, got {value!r}")

    def describe(self) -> str:
        """One line for the start-up log."""
        return f"{self.name} (chooser {self.chooser}, source {self.source}, attender {self.attender})"


#: The source each ``experimental.transfer`` value other than ``auto`` asks for.
_TRANSFER_SOURCE = {"worker": "copy_ahead", "inline": "copy_inline", "in_place": "in_place"}

CPU = DeviceProfile("cpu", "host_sync", "in_place", "fused_c")
GPU = DeviceProfile("gpu", "spec_host", "copy_ahead", "flashinfer")
PROFILES = {p.name: p for p in (CPU, GPU)}


def fused_attention_fits(pool_dtype: torch.dtype, head_dim: int, q_heads: int | None, kv_heads: int) -> bool:
    """Whether the fused C attention takes this model's layers: a bfloat16 or float32 KV cache,
    ``head_dim`` <= :data:`~dd_sglang.kernels.native.MAX_HEAD_DIM` and a known GQA group whose
    :data:`MAX_POSITIONS` query positions fit :data:`~dd_sglang.kernels.native.MAX_QUERIES`
    (``q_heads`` None: unknown, not taken)."""
    if q_heads is None or pool_dtype not in (torch.bfloat16, torch.float32) or head_dim > native_kernel.MAX_HEAD_DIM:
        return False
    return MAX_POSITIONS * (q_heads // kv_heads) <= native_kernel.MAX_QUERIES


def resolve_profile(device: torch.device, transfer: str, native: bool, fused_fits: bool,
                    host_contiguous: bool) -> DeviceProfile:  # fmt: skip
    """The profile a runner on ``device`` takes.

    Args:
        device: the device tier's device (``cuda`` gets :data:`GPU`, anything else :data:`CPU`).
        transfer: ``experimental.transfer`` (``auto``: the profile's source; ``worker`` ->
            ``copy_ahead``, ``inline`` -> ``copy_inline``, ``in_place`` -> ``in_place`` where the
            CPU profile's fused attention runs, else ``copy_inline``).
        native: the C kernel is used (:func:`dd_sglang.prefetch.runner.use_native_kernel`).
        fused_fits: :func:`fused_attention_fits` for the model and the device pool (whose buffers
            must be contiguous too).
        host_contiguous: the host tier's K/V buffers are contiguous (the C row copies need it).

    Returns:
        :data:`CPU` or :data:`GPU`, or a copy renamed ``cpu+...`` where a switch or the host changed a stage:
        without the C kernel (``experimental.kernel: torch``, or none built) or a model the fused
        attention does not take, a CPU runs ``torch`` and copies inline.

    Raises:
        ValueError: ``transfer`` is not one of the schema's values (the message names them).
    """
    allowed = choices(ExperimentalSection, "transfer")
    if transfer not in allowed:
        raise ValueError(f"experimental.transfer must be one of {list(allowed)}, got {transfer!r}")
    base = GPU if torch.device(device).type == "cuda" else CPU
    attender, source = base.attender, base.source
    changed = []
    if base is CPU and not (native and fused_fits and host_contiguous):
        attender, source = "torch", "copy_inline"
        changed.append("kernel=torch" if not native else "attender=torch")
    wanted = _TRANSFER_SOURCE.get(transfer, source)  # auto: the profile's own
    if wanted == "in_place" and attender != "fused_c":
        wanted = "copy_inline"
    if wanted != source:
        source = wanted
        changed.append(f"transfer={transfer}")
    if not changed:
        return base
    return DeviceProfile("+".join([base.name, *changed]), base.chooser, source, attender)
