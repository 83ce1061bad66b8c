"""The GPU profile's stages driven on CPU tensors: what crosses between host and device per layer, and
which rows the dense backend serves.

No GPU here. :class:`OnDevice` marks the tensors that live in HBM on a GPU (the layer's queries and new
K/V, the device KV pool, the layer ring, the step plan's device tensors, the batch's output slots)
and counts, on the forward thread, every read of one on the host (``.cpu()``, ``.item()``,
``.tolist()``, ``bool()``, ``.to("cpu")``: a device-to-host copy, which waits for the GPU) and every
host tensor used in an operation on one (a host-to-device copy in the forward's stream). The
counts are taken independently of the code under test: by PyTorch's own dispatch, not by the code
reporting itself. A ``.to(t.device)`` keeps a tensor where ``t`` is and is not counted; the copy
worker's and the select worker's threads are not the forward's and are not counted.

Verification needs each layer's real query on the host before that layer's attention (one copy down),
and the misses it finds go up (K and V); the next step's selection needs the speculated query on the
host (one copy down, after the layer's attention). Nothing else may cross in a layer.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.overrides import TorchFunctionMode

from dd_sglang.kvcache.layer_buffers import LayerRingBuffer
from dd_sglang.prefetch import runner as runner_module
from dd_sglang.prefetch.params import PrefetchParams
from dd_sglang.prefetch.profile import GPU
from dd_sglang.prefetch.runner import SparseStepRunner
from tests.test_backend_unit import HQ, LAYERS, PROMPT, Harness

PACKAGE = str(Path(runner_module.__file__).resolve().parents[1])
_D2H = {torch.Tensor.cpu, torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__bool__,
        torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__}  # fmt: skip


class OnDevice(torch.Tensor):
    """A CPU tensor standing for one in HBM (module docstring); :class:`_Device` propagates the mark."""

    __torch_function__ = torch._C._disabled_torch_function_impl


class _Log:
    on = False
    thread = threading.get_ident()
    seen: Counter = Counter()
    layers: list[Counter] = []  # one Counter per layer run


def _caller() -> str:
    """``file.py:function`` of the innermost dd_sglang frame that made the transfer."""
    f = sys._getframe(2)
    while f is not None:
        if f.f_code.co_filename.startswith(PACKAGE):
            return f"{Path(f.f_code.co_filename).name}:{f.f_code.co_name}"
        f = f.f_back
    return "?"


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)


def _target(args, kwargs):
    """The device a ``.to`` / factory call names: a ``torch.device`` object (where a tensor already is:
    the device, here) or a string (``"cpu"``: the host)."""
    dev = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (str, torch.device))), None))
    return dev


def _wrap(x):
    if isinstance(x, torch.Tensor) and not isinstance(x, OnDevice):
        return x.as_subclass(OnDevice)
    if isinstance(x, tuple):
        return tuple(_wrap(y) for y in x)
    if isinstance(x, list):
        return [_wrap(y) for y in x]
    return x


class _Device(TorchFunctionMode):
    """While on: the result of an operation on a device tensor, of ``.to(<a torch.device>)`` and of a
    factory given ``device=<a torch.device>`` is a device tensor; reading one on the host
    (:data:`_D2H`, ``.to("cpu")``) gives a host tensor. On the forward thread, while a layer runs
    (``_Log.on``), each read counts as ``d2h`` and each host tensor (not 0-dim) moved to the device or
    used beside a device tensor counts as ``h2d``, named by the dd_sglang function that made it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ins = list(_tensors(list(args) + list(kwargs.values())))
        on_dev = any(isinstance(t, OnDevice) for t in ins)
        target = _target(args, kwargs) if func is torch.Tensor.to or "device" in kwargs else None
        kind = to_dev = None
        if func in _D2H or (func is torch.Tensor.to and target == "cpu"):
            kind = "d2h" if on_dev else None
        elif isinstance(target, torch.device):
            to_dev = True
            kind = "h2d" if ins and not on_dev and ins[0].dim() > 0 else None
        elif on_dev:
            to_dev = True
            kind = "h2d" if any(not isinstance(t, OnDevice) and t.dim() > 0 for t in ins) else None
        if kind is not None and _Log.on and threading.get_ident() == _Log.thread:
            _Log.seen[(kind, _caller())] += 1
        out = func(*args, **kwargs)
        return _wrap(out) if to_dev else out


def _dev(t):
    return t if t is None or isinstance(t, OnDevice) else t.as_subclass(OnDevice)


def _gpu_harness(monkeypatch, **overrides) -> Harness:
    """The backend tests' harness with a runner of the GPU profile (copy ahead on the copy worker,
    selection ahead on the select worker, verified ``spec_host``, the gathered attention) and the
    device's tensors marked."""
    h = Harness(top_k=24, selector="spec_host", **overrides)
    h.backend.runner = SparseStepRunner(h.rt.host, "cpu", h.rt.host.k.dtype, h.r2t,
                                        PrefetchParams(hit_rate_sample=0.0, select="worker"), h.events, q_heads=HQ,
                                        profile=GPU)  # fmt: skip
    h.rt.add_release_listener(h.backend.runner.release)
    for i in range(LAYERS):
        h.pool.k_buffer[i], h.pool.v_buffer[i] = _dev(h.pool.k_buffer[i]), _dev(h.pool.v_buffer[i])
    reserve = LayerRingBuffer.reserve

    def reserve_on_device(self, *a):
        reserve(self, *a)
        self.k, self.v = _dev(self.k), _dev(self.v)

    monkeypatch.setattr(LayerRingBuffer, "reserve", reserve_on_device)
    init = h.backend.init_forward_metadata

    def init_on_device(fb):  # the step plan's device tensors are made under the mode
        fb.out_cache_loc, fb.input_ids = _dev(fb.out_cache_loc), _dev(fb.input_ids)
        with _Device():
            init(fb)

    h.backend.init_forward_metadata = init_on_device
    forward_decode = h.backend.forward_decode

    def counted(q, k, v, layer, fb, **kw):  # one layer: the inputs are the device's; count while it runs
        _Log.on, _Log.seen = True, Counter()
        try:
            with _Device():
                return forward_decode(_dev(q), _dev(k), _dev(v), layer, fb, **kw)
        finally:
            _Log.on = False
            _Log.layers.append(_Log.seen)

    h.backend.forward_decode = counted
    return h


def test_a_verified_step_of_the_gpu_profile_crosses_only_where_the_design_says(monkeypatch):
    """Per layer of a verified step: the real query down (``LayerVerification.run``), the misses up (K and V,
    ``RingCopies.put_verified``), the speculated query down for the next step's selection
    (``AheadSelection.after_layer``): nothing else, whether the speculated token was right or not."""
    h = _gpu_harness(monkeypatch)
    h.req.origin_input_ids = [5, 6, 7, 8] * (PROMPT // 4)
    h.step()  # the first sparse step: the row selects at attention time (a cold start)
    assert h.backend.runner.profile is GPU
    assert type(h.backend.runner.step_source).__name__ == "RingCopies"
    fetching_layers = 0
    for tok in (99, None):  # rejected, then what prompt lookup proposes
        repaired = h.events.repaired
        _Log.layers.clear()
        h.step(tok=tok)
        assert len(_Log.layers) == LAYERS
        fetched = 0
        for seen in _Log.layers:
            want = {("d2h", "verify.py:run"): 1, ("d2h", "ahead_selection.py:after_layer"): 1}
            if seen.get(("h2d", "sources.py:put_verified")):  # this layer had misses: where to, then K and V
                want[("h2d", "sources.py:put_verified")] = 2
                fetched += 1
            assert seen == want, seen
        assert (fetched > 0) == (h.events.repaired > repaired)
        fetching_layers += fetched
    assert fetching_layers > 0  # the misses' path ran
    assert h.events.cold_n == LAYERS and h.events.hits_lookups[1] > 0


def test_the_counter_sees_a_host_read_in_the_layer_path(monkeypatch):
    """The check can fail: a ``.tolist()`` of a device tensor added to the attender's per-layer call is counted."""
    from dd_sglang.prefetch.attenders import GatheredAttender

    h = _gpu_harness(monkeypatch)
    h.req.origin_input_ids = [5, 6, 7, 8] * (PROMPT // 4)
    h.step()
    inputs = GatheredAttender.inputs

    def reads_back(self, plan, *a):
        plan.layout.qidx.tolist()
        return inputs(self, plan, *a)

    monkeypatch.setattr(GatheredAttender, "inputs", reads_back)
    _Log.layers.clear()
    h.step()
    assert [seen[("d2h", "runner.py:layer_inputs")] for seen in _Log.layers] == [1] * LAYERS  # named by its caller


class DenseRecorder:
    """A dense delegate that is not ``torch_native`` (as FlashInfer is not): records the batches it is
    planned on and the query rows it attends; its output is twice the queries."""

    def __init__(self):
        self.planned, self.rows = [], []

    def init_forward_metadata(self, fb):
        self.planned.append(fb)

    def forward_decode(self, q, k, v, layer, fb, save_kv_cache=True, **kw):
        assert fb is self.planned[-1] and not save_kv_cache and k is None
        self.rows.append(q.shape[0])
        return q * 2


def test_the_dense_backend_is_planned_and_run_on_the_dense_rows_only():
    """A sparse row (batch row 0) beside a dense request (row 1): the dense delegate is planned on a sub-batch
    of row 1 alone (its pool index, length, length sum and slot), attends its query alone in every layer
    and its output is row 1's; a step whose rows are all sparse never plans the delegate."""
    h = Harness(top_k=24, selector="host_sync")
    dense = DenseRecorder()
    h.backend.dense = dense
    fb, qs, outs = h.step(dense_row=(1, 40))
    sub = dense.planned[-1]
    assert sub.batch_size == 1 and sub.req_pool_indices.tolist() == [1] and sub.seq_lens.tolist() == [40]
    assert sub.seq_lens_cpu.tolist() == [40] and sub.seq_lens_sum == 40
    assert sub.out_cache_loc.tolist() == fb.out_cache_loc[1:].tolist()
    assert dense.rows == [1] * LAYERS
    for i in range(LAYERS):
        assert torch.equal(outs[i][1], qs[i][0][1] * 2)
    planned = len(dense.planned)
    h.step()
    assert len(dense.planned) == planned and dense.rows == [1] * LAYERS


def test_an_all_dense_step_plans_the_dense_backend_on_the_whole_batch():
    h = Harness(top_k=24, selector="host_sync")
    dense = DenseRecorder()
    h.backend.dense = dense
    h.backend.runtime = None  # no sparse runtime: every row is dense
    fb = SimpleNamespace(forward_mode=SimpleNamespace(is_decode=lambda: True), batch_size=2)
    h.backend.init_forward_metadata(fb)
    assert dense.planned == [fb] and fb.dd_step.plan is None
