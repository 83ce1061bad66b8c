"""GPU check of the sparse decode path's CUDA side, in one run of a few minutes; one JSON file.

Usage::

    python -m bench.gpu_check [--out bench/results/gpu_check.json] [--budget-s 270]
    python -m bench.gpu_check --dry-run          # no GPU: tiny shapes, PyTorch reference, same JSON layout
    make gpu-check                               # the first form, in the project's venv

Imports nothing of SGLang: only torch, ``dd_sglang.kernels`` and
``dd_sglang.kvcache.layer_buffers`` (and ``flashinfer`` / ``cupy`` when
installed), so it runs on a GPU host that has PyTorch but not SGLang
(README, "CUDA path", for bringing FlashInfer there as a wheel).

What it measures (bf16, each part timed with CUDA events, medians):

(a) **Accuracy.** :class:`~dd_sglang.kernels.dispatch.SparseAttention` (FlashInfer)
    against the PyTorch reference
    (:func:`~dd_sglang.kernels.sparse_decode.sparse_decode_attention` in float32 on
    the same bf16 inputs), on random steps shaped like the layer ring: batch
    1/16/64 rows, GQA group 1/4/8, head_dim 64/128, top_k 64/512/2048 (each
    row's own critical length drawn in ``[top_k/2, top_k]``), a resident set
    of up to 132 columns, the speculated column on half the rows, ring column
    capacity above the step's columns, 8 KV heads. Reported: max abs error per
    configuration and overall; pass when it is at most ``--atol`` (2e-2: the
    bf16 output's rounding plus FlashInfer's bf16 P·V, on outputs of magnitude
    up to ~3).
(b) **Sparse vs dense attention** at a 32k context, top_k = 2048 (1/16),
    Llama-3.1-8B's heads (8 KV, group 4, head_dim 128), batch 1/8/32: one
    sparse call (both query positions, 132 resident + 2048 + 1 columns) against
    one dense decode call over 32,768 tokens (FlashInfer's paged decode,
    page_size 16, the kernel SGLang's dense decode uses; PyTorch SDPA when
    FlashInfer is absent). Also timed: the real query alone (one position),
    what reading K/V once per (row, head) would approach.
(c) **Full sparse layer step** (batch 8, same shape): gather the critical set
    from a pinned host tier into the layer ring slot with the runner's
    :class:`~dd_sglang.prefetch.gather.RingGather` (``staging``: host
    ``index_select`` into pinned staging, one copy; ``kernel``: SGLang's
    transfer kernel, where ``sgl_kernel`` imports; on the CPU ``cpu``), and,
    with CuPy, an unbounded zero-copy GPU ``index_select`` from the pinned
    tier; gather the resident set from a device pool; attention. Against the
    dense attention of (b). Sequential (the overlap with other layers is
    ``bench.transfer_cuda``'s subject).

FlashInfer JIT-compiles its kernels on first use; the JIT phase (four
modules, built concurrently) is timed separately and its time is inside the
budget. ``--budget-s`` stops part (a) early (the JSON lists what ran).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from dd_sglang.kernels.dispatch import SparseAttention
from dd_sglang.kernels.flashinfer_decode import TENSOR_CORE_MIN_GROUP
from dd_sglang.kernels.sparse_decode import fold_gqa, sparse_decode_attention
from dd_sglang.kvcache.layer_buffers import LayerRingBuffer
from dd_sglang.prefetch.gather import RingGather, flat_rows, ring_rows

N_RES = 4 + 128  # sinks + window: the resident columns of the CPU preset
HKV = 8
LONG_CONTEXT = 32768


# ----------------------------------------------------------------------------- shared pieces
def make_step(rows, hkv, group, head_dim, top_k, device, dtype, gen, full=False):
    """A random sparse step shaped like the ring: ``(q, keys, values, mask, capacity)``.

    ``gen``: ``(cpu_generator, device_generator)`` (structure on the CPU, tensors drawn on the device).

    ``keys``/``values`` are ``[rows, hkv, N, D]`` views of a zero-filled slot with column
    capacity ``N + 8``; ``mask[r, s]``: the row's resident prefix, its own critical length, the
    speculated column (``s = 1``, every other row). ``full``: every row uses all columns.
    """
    n = N_RES + top_k + 1
    cap = n + 8
    slot_k = torch.zeros(rows + 1, hkv, cap, head_dim, dtype=dtype, device=device)
    slot_v = torch.zeros_like(slot_k)
    keys, values = slot_k[:rows, :, :n], slot_v[:rows, :, :n]
    cpu, dev = gen
    keys.copy_(randn(keys.shape, dev, dtype))
    values.copy_(randn(values.shape, dev, dtype))
    mask = torch.zeros(rows, 2, n, dtype=torch.bool)
    for r in range(rows):
        res = N_RES if full else int(torch.randint(1, N_RES + 1, (1,), generator=cpu))
        k = top_k if full else int(torch.randint(max(1, top_k // 2), top_k + 1, (1,), generator=cpu))
        mask[r, :, :res] = True
        mask[r, :, N_RES : N_RES + k] = True
        if full or r % 2 == 0:
            mask[r, 1, n - 1] = True
    q = fold_gqa(randn((rows, 2, hkv * group, head_dim), dev, dtype), hkv)
    return q, keys, values, mask.to(device), cap


def randn(shape, gen: torch.Generator, dtype) -> torch.Tensor:
    """Standard normal values drawn on ``gen``'s device."""
    return torch.randn(tuple(shape), generator=gen, device=gen.device).to(dtype)


def timed(fn, device, iters, warmup=3):
    """Median milliseconds of ``fn()`` (CUDA events on CUDA, wall clock elsewhere)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


def wall_ms(fn, device, iters, warmup=2):
    """Median wall milliseconds of ``fn()`` including host work (synchronised)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


class DenseAttention:
    """Dense decode attention over a contiguous per-row cache: FlashInfer's paged decode
    (page_size 16) when available, else PyTorch SDPA."""

    def __init__(self, rows, hkv, group, head_dim, context, device, dtype, gen, use_flashinfer):
        self.hq, self.d = hkv * group, head_dim
        dev = gen[1]
        self.k = randn((rows, context, hkv, head_dim), dev, dtype)
        self.v = randn((rows, context, hkv, head_dim), dev, dtype)
        self.q = randn((rows, self.hq, head_dim), dev, dtype)
        self.kind = "torch_sdpa"
        if use_flashinfer:
            import flashinfer

            page = 16
            pages = context // page
            ws = torch.zeros(128 << 20, dtype=torch.uint8, device=device)
            self.w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                ws, "NHD", use_tensor_cores=group >= TENSOR_CORE_MIN_GROUP, backend="fa2"
            )
            indptr = torch.arange(rows + 1, dtype=torch.int32, device=device) * pages
            indices = torch.arange(rows * pages, dtype=torch.int32, device=device)
            last = torch.full((rows,), page, dtype=torch.int32, device=device)
            self.w.plan(
                indptr, indices, last, self.hq, hkv, head_dim, page, q_data_type=dtype, kv_data_type=dtype
            )
            self.cache = (
                self.k.view(rows * pages, page, hkv, head_dim),
                self.v.view(rows * pages, page, hkv, head_dim),
            )
            self.out = torch.empty_like(self.q)
            self.kind = "flashinfer_paged_decode_page16"

    def __call__(self):
        if self.kind.startswith("flashinfer"):
            return self.w.run(self.q, self.cache, out=self.out)
        q = self.q.unsqueeze(2)  # [rows, Hq, 1, D]
        return torch.nn.functional.scaled_dot_product_attention(
            q, self.k.transpose(1, 2), self.v.transpose(1, 2), enable_gqa=True
        )


# ----------------------------------------------------------------------------- (a)
def part_accuracy(att, device, dtype, configs, atol, deadline, gen):
    rows_out, worst = [], 0.0
    for rows, group, head_dim, top_k in configs:
        if time.monotonic() > deadline:
            break
        q, keys, values, mask, cap = make_step(rows, HKV, group, head_dim, top_k, device, dtype, gen)
        scale = head_dim**-0.5
        att.plan(mask, HKV, group, cap, dtype, device, head_dim)
        got = att.run(q, keys, values, scale).float()
        m4 = mask.repeat_interleave(group, dim=1).unsqueeze(1)
        want = sparse_decode_attention(q.float(), keys.float(), values.float(), m4, scale)
        err = float((got - want).abs().max())
        worst = max(worst, err)
        rows_out.append({"batch": rows, "group": group, "head_dim": head_dim, "top_k": top_k,
                         "max_abs_err": err, "max_abs_out": float(want.abs().max())})  # fmt: skip
        del q, keys, values, mask, got, want
    return {
        "impl": att.kind,
        "reference": "sparse_decode_attention in float32 on the same bf16 inputs",
        "atol": atol,
        "configs_run": len(rows_out),
        "configs_planned": len(configs),
        "max_abs_err": worst,
        "pass": bool(rows_out) and worst <= atol,
        "results": rows_out,
    }


# ----------------------------------------------------------------------------- (b)
def part_sparse_vs_dense(att, device, dtype, batches, context, top_k, use_fi, iters, gen):
    group, head_dim = 4, 128
    out = []
    for rows in batches:
        q, keys, values, mask, cap = make_step(
            rows, HKV, group, head_dim, top_k, device, dtype, gen, full=True
        )
        scale = head_dim**-0.5
        att.plan(mask, HKV, group, cap, dtype, device, head_dim)
        sparse_ms = timed(lambda q=q, k=keys, v=values, s=scale: att.run(q, k, v, s), device, iters)
        # The real query alone (one request per row and head): what reading K/V once per
        # (row, head) would approach (module docstring of flashinfer_decode, "Not built").
        q1 = q[:, :, :group].contiguous()
        att.plan(mask[:, :1].contiguous(), HKV, group, cap, dtype, device, head_dim)
        one_ms = timed(lambda q=q1, k=keys, v=values, s=scale: att.run(q, k, v, s), device, iters)
        del q, q1, keys, values, mask
        dense = DenseAttention(rows, HKV, group, head_dim, context, device, dtype, gen, use_fi)
        dense_ms = timed(dense, device, iters)
        columns = N_RES + top_k + 1
        item = torch.finfo(dtype).bits // 8
        out.append({
            "batch": rows, "sparse_ms": sparse_ms, "dense_ms": dense_ms, "dense_kernel": dense.kind,
            "speedup": dense_ms / sparse_ms if sparse_ms > 0 else None,
            "sparse_one_position_ms": one_ms,
            "speedup_one_position": dense_ms / one_ms if one_ms > 0 else None,
            "sparse_kv_bytes": 2 * rows * HKV * 2 * columns * head_dim * item,  # two positions
            "dense_kv_bytes": rows * HKV * context * head_dim * 2 * item,
        })  # fmt: skip
        del dense
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {
        "shape": {"kv_heads": HKV, "group": group, "head_dim": head_dim, "context": context,
                  "top_k": top_k, "resident": N_RES, "columns": N_RES + top_k + 1, "query_positions": 2},
        "impl": att.kind,
        "results": out,
    }  # fmt: skip


# ----------------------------------------------------------------------------- (c)
def _cupy_view(host: torch.Tensor):
    """A CUDA tensor over a pinned host tensor's memory (zero copy, through CuPy and DLPack), or None."""
    try:
        import cupy
    except Exception:
        return None, "cupy not importable"
    try:
        raw = host.view(torch.int16)
        mem = cupy.cuda.UnownedMemory(raw.data_ptr(), raw.nbytes, raw, torch.cuda.current_device())
        arr = cupy.ndarray(tuple(raw.shape), dtype=cupy.int16, memptr=cupy.cuda.MemoryPointer(mem, 0))
        return torch.from_dlpack(arr).view(host.dtype), None
    except Exception as e:  # pragma: no cover - depends on the host
        return None, f"{type(e).__name__}: {e}"


def _gather_modes(device) -> list[str]:
    """:class:`RingGather` modes to time: ``cpu`` on the CPU; ``staging`` on CUDA, and ``kernel``
    where SGLang's ``sgl_kernel`` imports (a GPU machine with the project installed)."""
    if device.type != "cuda":
        return ["cpu"]
    try:
        from sgl_kernel.kvcacheio import transfer_kv_per_layer  # noqa: F401
    except Exception:
        return ["staging"]
    return ["staging", "kernel"]


def part_layer_step(att, device, dtype, rows, context, top_k, use_fi, iters, gen):
    group, head_dim = 4, 128
    hkv, d = HKV, head_dim
    columns = N_RES + top_k + 1
    pin = device.type == "cuda"
    cpu, dev = gen
    # Host tier, one layer ([layers, slots, Hkv, D]): each row owns `context` slots.
    host_k = torch.empty(1, rows * context, hkv, d, dtype=dtype, pin_memory=pin)
    host_v = torch.empty_like(host_k, pin_memory=pin)
    for t in (host_k, host_v):
        t.copy_(randn(t.shape, dev, dtype))
    pos = torch.randint(0, context, (rows, hkv, top_k), generator=cpu)
    src = flat_rows(pos + torch.arange(rows).view(rows, 1, 1) * context)
    # Device pool holding the resident sets.
    pool_k = randn((rows * N_RES, hkv, d), dev, dtype)
    pool_v = randn((rows * N_RES, hkv, d), dev, dtype)
    res_slots = torch.arange(rows * N_RES, device=device).view(rows, N_RES)
    ring = LayerRingBuffer(0, device, dtype)
    ring.reserve(rows, hkv, columns, d)
    k_slot, v_slot = ring.slot(0)
    keys, values = k_slot[:rows, :, :columns], v_slot[:rows, :, :columns]
    dst = ring_rows(torch.arange(rows), hkv, ring.shape[3], N_RES, top_k)
    mask = torch.zeros(rows, 2, columns, dtype=torch.bool)
    mask[:, :, : N_RES + top_k] = True
    mask[:, 1, -1] = True
    q = fold_gqa(randn((rows, 2, hkv * group, d), dev, dtype), hkv)
    att.plan(mask.to(device), hkv, group, ring.shape[3], dtype, device, d)
    scale = d**-0.5

    def resident():
        keys[:, :, :N_RES] = pool_k[res_slots].transpose(1, 2)
        values[:, :, :N_RES] = pool_v[res_slots].transpose(1, 2)

    def attention():
        return att.run(q, keys, values, scale)

    def step(gather):
        gather()
        resident()
        return attention()

    gathered = 2 * rows * hkv * top_k * d * (torch.finfo(dtype).bits // 8)
    res = {
        "shape": {"batch": rows, "kv_heads": hkv, "group": group, "head_dim": d, "context": context,
                  "top_k": top_k, "resident": N_RES, "gathered_bytes": gathered},
        "resident_gather_ms": timed(resident, device, iters),
        "attention_ms": timed(attention, device, iters),
        "gather": {},
    }  # fmt: skip
    for mode in _gather_modes(device):
        g = RingGather(host_k, host_v, device, mode)

        def gather(g=g):
            g.copy(0, src, k_slot, v_slot, dst)

        ms = wall_ms(gather, device, iters)
        res["gather"][mode] = {"gather_ms": ms, "gbps": gathered / ms / 1e6,
                               "step_ms": wall_ms(lambda f=gather: step(f), device, iters)}  # fmt: skip
        # The step's result over what this gather brought, against the reference on the same slot.
        got = step(gather).float()
        m4 = mask.to(device).repeat_interleave(group, dim=1).unsqueeze(1)
        want = sparse_decode_attention(q.float(), keys.float(), values.float(), m4, scale)
        res["gather"][mode]["step_max_abs_err"] = float((got - want).abs().max())
        want_k = host_k[0].view(-1, d).index_select(0, src).to(device).view(rows, hkv, top_k, d)
        res["gather"][mode]["gathered_equal"] = bool(torch.equal(keys[:, :, N_RES : N_RES + top_k], want_k))
    dev_k, why_not = _cupy_view(host_k) if pin else (None, "no CUDA")
    if dev_k is not None:  # a GPU index_select reading the pinned tier directly, all SMs allowed
        dev_v = _cupy_view(host_v)[0]
        src_dev, dst_dev = src.to(device), dst.to(device)

        def zero_copy():
            k_slot.view(-1, d)[dst_dev] = dev_k[0].view(-1, d).index_select(0, src_dev)
            v_slot.view(-1, d)[dst_dev] = dev_v[0].view(-1, d).index_select(0, src_dev)

        ms = wall_ms(zero_copy, device, iters)
        res["gather"]["cupy_zero_copy"] = {"gather_ms": ms, "gbps": gathered / ms / 1e6,
                                           "step_ms": wall_ms(lambda: step(zero_copy), device, iters)}  # fmt: skip
    else:
        res["gather"]["cupy_zero_copy"] = f"not run: {why_not}"
    dense = DenseAttention(rows, hkv, group, d, context, device, dtype, gen, use_fi)
    res["dense_attention_ms"] = timed(dense, device, iters)
    res["dense_kernel"] = dense.kind
    for v in res["gather"].values():
        if isinstance(v, dict):
            v["step_vs_dense"] = v["step_ms"] / res["dense_attention_ms"]
    return res


# ----------------------------------------------------------------------------- JIT warm-up
def warm_up(device, dtype, groups, head_dims, workers):
    """Build and load FlashInfer's kernels for every (kernel kind, head_dim) the check uses,
    concurrently (each is an nvcc build on first use); returns seconds and any error."""
    jobs = {}  # (tensor cores, head_dim) -> a group that selects that kernel
    for g in groups:
        for d in head_dims:
            jobs.setdefault((g >= TENSOR_CORE_MIN_GROUP, d), g)

    def one(key):
        g, d = jobs[key], key[1]
        att = SparseAttention(device, impl="flashinfer")
        gen = (torch.Generator().manual_seed(0), torch.Generator(device=device).manual_seed(0))
        q, keys, values, mask, cap = make_step(1, 1, g, d, 8, device, dtype, gen)
        att.plan(mask, 1, g, cap, dtype, device, d)
        att.run(q, keys, values, d**-0.5)
        torch.cuda.synchronize()

    t = time.monotonic()
    errors = []
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as ex:
            for fut in [ex.submit(one, k) for k in jobs]:
                fut.result()
    except Exception as e:  # retry one by one (a concurrent build failing should not end the check)
        errors.append(f"concurrent: {type(e).__name__}: {e}")
        for k in jobs:
            try:
                one(k)
            except Exception as e2:
                errors.append(f"{k}: {type(e2).__name__}: {e2}")
    return {"modules": [f"{'tensor_core' if tc else 'cuda_core'}_hd{d}" for tc, d in jobs],
            "seconds": time.monotonic() - t, "errors": errors}  # fmt: skip


# ----------------------------------------------------------------------------- main
def environment(device):
    env = {"python": platform.python_version(), "torch": torch.__version__, "device": str(device)}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    try:
        import flashinfer

        env["flashinfer"] = getattr(flashinfer, "__version__", "?")
    except Exception as e:
        env["flashinfer"] = None
        env["flashinfer_error"] = f"{type(e).__name__}: {e}"
    env["sglang_imported"] = any(m == "sglang" or m.startswith("sglang.") for m in sys.modules)
    return env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/gpu_check.json, "
                    "bench/results/gpu_check_dryrun.json with --dry-run)")  # fmt: skip
    ap.add_argument(
        "--dry-run", action="store_true", help="no GPU: tiny shapes on the CPU, PyTorch reference"
    )
    ap.add_argument(
        "--budget-s", type=float, default=270.0, help="stop part (a) once this much time has passed"
    )
    ap.add_argument("--atol", type=float, default=2e-2)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--jit-workers", type=int, default=4)
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    deadline = t0 + args.budget_s
    dtype = torch.bfloat16
    if args.dry_run:
        device = torch.device("cpu")
        impl = "torch"
        configs = [(b, g, d, k) for b in (1, 3) for g in (1, 4) for d in (64,) for k in (64, 128)]
        context, top_k, batches, step_rows, iters = 1024, 64, [1, 2], 2, 2
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench.gpu_check needs CUDA (or --dry-run)")
        device = torch.device("cuda", torch.cuda.current_device())
        impl = "auto"
        configs = [
            (b, g, d, k) for b in (1, 16, 64) for g in (1, 4, 8) for d in (64, 128) for k in (64, 512, 2048)
        ]
        context, top_k, batches, step_rows, iters = (
            LONG_CONTEXT,
            LONG_CONTEXT // 16,
            [1, 8, 32],
            8,
            args.iters,
        )
    gen = (torch.Generator().manual_seed(0), torch.Generator(device=device).manual_seed(0))
    env = environment(device)
    if args.dry_run:
        env["note"] = ("dry run: CPU, tiny shapes, the PyTorch reference on both sides of every comparison; "
                       "it checks that the check runs and writes this file, its timings mean nothing")  # fmt: skip
    result = {"benchmark": "bench.gpu_check: FlashInfer sparse decode vs reference; sparse vs dense; layer step",
              "dry_run": args.dry_run, "environment": env}  # fmt: skip
    out_path = Path(
        args.out
        or ("bench/results/gpu_check_dryrun.json" if args.dry_run else "bench/results/gpu_check.json")
    )
    att = SparseAttention(device, impl=impl)
    result["sparse_attention"] = {"kind": att.kind, "reason": att.reason}
    use_fi = att.kind == "flashinfer"
    if use_fi:
        result["jit"] = warm_up(device, dtype, (1, 4, 8), (64, 128), args.jit_workers)
    t = time.monotonic()
    result["accuracy"] = part_accuracy(att, device, dtype, configs, args.atol, deadline, gen)
    result["accuracy"]["seconds"] = time.monotonic() - t
    t = time.monotonic()
    result["sparse_vs_dense"] = part_sparse_vs_dense(
        att, device, dtype, batches, context, top_k, use_fi, iters, gen
    )
    result["sparse_vs_dense"]["seconds"] = time.monotonic() - t
    t = time.monotonic()
    result["layer_step"] = part_layer_step(
        att, device, dtype, step_rows, context, top_k, use_fi, max(3, iters // 3), gen
    )
    result["layer_step"]["seconds"] = time.monotonic() - t
    result["seconds"] = time.monotonic() - t0
    speed = [r["speedup"] for r in result["sparse_vs_dense"]["results"] if r["speedup"]]
    result["summary"] = {
        "impl": att.kind,
        "accuracy_pass": result["accuracy"]["pass"],
        "max_abs_err": result["accuracy"]["max_abs_err"],
        "sparse_speedup_at_1_16": {str(r["batch"]): round(r["speedup"], 2) for r in result["sparse_vs_dense"]["results"]},
        "min_speedup": min(speed) if speed else None,
        "seconds": round(result["seconds"], 1),
    }  # fmt: skip
    from bench.machine import provenance  # imports no SGLang (tests/test_gpu_check.py)

    result = {"provenance": provenance(dtype=str(dtype).removeprefix("torch.")), **result}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=1, default=_json_default) + "\n")
    print(json.dumps(result["summary"], indent=1))
    print(f"wrote {out_path}")
    return 0 if result["accuracy"]["pass"] and (args.dry_run or use_fi) else 1


def _json_default(x):
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    return str(x)


if __name__ == "__main__":
    sys.exit(main())
