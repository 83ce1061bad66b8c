"""Host selection at the shapes of real 7-8B models, 32k and 128k tokens: the full scan against two-level.

No weights are loaded: the host tier is built at each model's published attention shape
(layers, KV heads, query heads, head_dim from its ``config.json``) and filled with keys that keep
the structure of a real model's keys, namely SmolLM2's own: SmolLM2-135M prefills ``--source-tokens``
of real text (HF transformers); a 128-dim key of KV head ``h`` at layer ``l`` is SmolLM2's layer ``l
mod 30`` keys of KV heads ``h mod 3`` and ``(h + 1) mod 3`` side by side (post-RoPE, bfloat16), and
position ``p`` takes SmolLM2's position ``p mod source`` plus Gaussian noise of 5% of each channel's
spread, so tiles are not copies. The selection queries are SmolLM2's decode-step queries at that
layer, paired the same way, query head ``j`` of KV head ``h`` from SmolLM2's query head ``(3 h + j)
mod 9``. What is real: the channel statistics, outlier channels and RoPE phases of a real model's
keys; what is not: a 7B model's own keys (none can be loaded here).

Per shape and length, one request (one row), one layer at a time (the kernel's one-row path,
every thread on one task, as a batch-1 step runs): selection time per layer (best of
``--repeats``) times the model's layer count gives the step's selection time; bytes read per
step: the int8 index rows scored (``head_dim + 4`` bytes per token and KV head) and the block means for
two-level, plus the re-ranked exact keys (bfloat16); and this machine's read bandwidth (a float32
sum over 1 GiB on every thread) as the physical floor of the full scan. ``gpu_step_ms``: the
step a GPU would hide the selection behind (20 ms: decode of a 7-8B model at batch 1-8 on one
H100/H200); ``fits`` says whether the selection does.

Run: ``python -m bench.select_shapes --out bench/results/select_shapes_cpu.json`` (about 5 min).
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from dd_sglang.kernels import native
from dd_sglang.prefetch.index import QuantKeyIndex
from dd_sglang.prefetch.scoring import row_blocks

#: Published attention shapes (``config.json`` of each model: num_hidden_layers,
#: num_key_value_heads, num_attention_heads, hidden_size / num_attention_heads).
SHAPES = {
    "llama-3.1-8b": {"layers": 32, "kv_heads": 8, "q_heads": 32, "head_dim": 128},
    "qwen2.5-7b": {"layers": 28, "kv_heads": 4, "q_heads": 28, "head_dim": 128},
}
N_SINK, N_RECENT, BLOCK = 4, 128, 16


def read_bandwidth_gbs(gib: float = 1.0, repeats: int = 3) -> float:
    """This machine's read bandwidth: bytes of a float32 tensor of ``gib`` GiB summed on every
    thread, over the best of ``repeats`` sums (GB/s, 1e9 bytes)."""
    x = torch.ones(int(gib * (1 << 30)) // 4)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return round(x.numel() * 4 / best / 1e9, 2)


@torch.no_grad()
def smollm2_source(tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SmolLM2's post-RoPE keys ``[30, 3, tokens, 64]`` (bfloat16) of a real text's first ``tokens``
    and the next decode step's queries ``[30, 9, 64]`` (float32)."""
    from transformers import AutoTokenizer, DynamicCache

    from bench.ceiling import QueryCapture, load_model
    from dd_sglang.models.smollm2 import prepare_model
    from harness.texts import available_texts, text

    tok = AutoTokenizer.from_pretrained(prepare_model(progress=False))
    model = load_model()
    ids = tok.encode(text(available_texts()[0]))[: tokens + 1]
    cap = QueryCapture(model)
    cache = DynamicCache(config=model.config)
    model(torch.tensor([ids[:tokens]]), past_key_values=cache, use_cache=True)
    model(torch.tensor([[ids[tokens]]]), past_key_values=cache, use_cache=True, position_ids=torch.tensor([[tokens]]))
    keys = torch.stack([cache.layers[i].keys[0, :, :tokens] for i in range(len(model.model.layers))])
    queries = torch.stack([cap.queries[i] for i in range(len(model.model.layers))])
    cap.close()
    return keys.to(torch.bfloat16), queries.float()


def layer_keys(src: torch.Tensor, layer: int, hkv: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """One layer's keys ``[n, hkv, 128]`` bfloat16 from SmolLM2's (module docstring)."""
    s = src[layer % src.shape[0]].float()  # [3, T, 64]
    heads = [torch.cat([s[h % 3], s[(h + 1) % 3]], dim=-1) for h in range(hkv)]  # [T, 128] each
    k = torch.stack(heads, dim=1)  # [T, hkv, 128]
    reps = -(-n // k.shape[0])
    tiled = k.repeat(reps, 1, 1)[:n]
    spread = k.std(dim=0, keepdim=True)
    return (tiled + 0.05 * spread * torch.randn(tiled.shape, generator=gen)).to(torch.bfloat16)


def layer_queries(src_q: torch.Tensor, layer: int, hkv: int, g: int) -> torch.Tensor:
    """One layer's queries ``[1, 1, hkv * g, 128]`` from SmolLM2's 9 query heads (module docstring)."""
    q = src_q[layer % src_q.shape[0]]  # [9, 64]
    out = [torch.cat([q[(3 * h + j) % 9], q[(3 * h + j + 1) % 9]]) for h in range(hkv) for j in range(g)]
    return torch.stack(out).view(1, 1, hkv * g, 128)


def _kept_union(q: torch.Tensor, idx: QuantKeyIndex, n: int, pages: int) -> int:
    """Candidates the first level keeps for this row (the union over KV heads), recomputed in PyTorch."""
    lo, hi = N_SINK, n - N_RECENT
    blocks = torch.arange(lo // BLOCK, (hi - 1) // BLOCK + 1)
    if blocks.numel() <= pages:
        return hi - lo
    means, scales = idx.block_means
    hkv, d = means.shape[2], means.shape[3]
    qq = q.view(hkv, -1, d)
    qs = qq.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127
    a = torch.einsum("hgd,bhd->hgb", (qq / qs).round(), means[0, blocks].float()) * scales[0, blocks].T[:, None] * qs
    bs = (a - a.logsumexp(-1, keepdim=True)).amax(1)
    keep = torch.zeros(blocks.numel(), dtype=torch.bool)
    for h in range(hkv):
        keep[bs[h].topk(pages).indices] = True
    return int(keep[torch.arange(lo, hi) // BLOCK - blocks[0]].sum())


def measure(shape: dict, n: int, budgets: list[int], k: int, rerank: float, layers: int, repeats: int,
            src: tuple[torch.Tensor, torch.Tensor], gbs: float, gpu_step_ms: float) -> dict:  # fmt: skip
    """One shape at ``n`` tokens: per method, selection ms per step and bytes read per step."""
    hkv, d, n_layers = shape["kv_heads"], shape["head_dim"], shape["layers"]
    g = shape["q_heads"] // hkv
    m = int(math.ceil(rerank * k))
    total = -(-n // 64) * 64
    gen = torch.Generator().manual_seed(n)
    slots = torch.arange(total)
    rows = row_blocks([slots], [N_SINK], [n - N_RECENT], [torch.arange(N_SINK)])
    times: dict[str, list[float]] = {}
    kept: dict[str, list[int]] = {}
    methods = {"full_scan": None, **{f"two_level {b}": b // BLOCK for b in budgets}}
    for layer in range(layers):
        host_k = torch.zeros(1, total, hkv, d, dtype=torch.bfloat16)
        host_k[0, :n] = layer_keys(src[0], layer, hkv, n, gen)
        idx = QuantKeyIndex(host_k, native=True, block_means=True)
        idx.update(slots, 0, n)
        q = layer_queries(src[1], layer, hkv, g)
        for name, pages in methods.items():
            arg = None if pages is None else (*idx.block_means, pages)
            best = math.inf
            for _ in range(repeats):
                t0 = time.perf_counter()
                native.spec_host_select(q, *rows.tokens, idx.q8, idx.scale, host_k, k, m, d**-0.5, None, arg)
                best = min(best, time.perf_counter() - t0)
            times.setdefault(name, []).append(best)
            kept.setdefault(name, []).append(n - N_SINK - N_RECENT if pages is None else _kept_union(q, idx, n, pages))
        del host_k, idx
    cand = n - N_SINK - N_RECENT
    out = {}
    for name, pages in methods.items():
        per_layer_ms = 1000 * sum(times[name]) / len(times[name])
        rows_read = sum(kept[name]) / len(kept[name])
        index_bytes = n_layers * hkv * (d + 4) * (rows_read + (0 if pages is None else cand / BLOCK))
        exact_bytes = n_layers * hkv * m * d * 2
        step_ms = per_layer_ms * n_layers
        out[name] = {
            "select_ms_per_layer": round(per_layer_ms, 3),
            "select_ms_per_step": round(step_ms, 1),
            "candidates_scored_per_row": round(rows_read),
            "index_bytes_per_step": int(index_bytes),
            "bytes_per_step": int(index_bytes + exact_bytes),
            "floor_ms_at_read_bandwidth": round((index_bytes + exact_bytes) / gbs / 1e6, 1),
            "fits_gpu_step": step_ms <= gpu_step_ms,
            "gpu_step_left_ms": round(gpu_step_ms - step_ms, 1),
        }
    full = out["full_scan"]["index_bytes_per_step"]
    for v in out.values():
        v["index_fraction"] = round(v["index_bytes_per_step"] / full, 4)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--tokens", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--budgets", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--k", type=int, default=256)
    ap.add_argument("--rerank", type=float, default=2.0)
    ap.add_argument("--layers", type=int, default=3, help="layers measured per shape (times the model's count)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--source-tokens", type=int, default=8000)
    ap.add_argument("--gpu-step-ms", type=float, default=20.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from bench.cli import check_ranges

    check_ranges(ap, args, (("k", 1, 4096), ("layers", 1, 64), ("repeats", 1, 100), ("source_tokens", 1000, 8000),
                            ("gpu_step_ms", 0.1, 10_000.0)))  # fmt: skip
    if any(t < 2048 or t > 262_144 for t in args.tokens):
        ap.error(f"--tokens must each be in [2048, 262144], got {args.tokens}")
    if any(b < math.ceil(args.rerank * args.k) + 32 for b in args.budgets):
        ap.error(f"--budgets: each must be at least rerank x k + 32 = {math.ceil(args.rerank * args.k) + 32}")
    if not native.available():
        ap.error(f"the C selection kernel is not built here: {native.unavailable_reason()}")
    t0 = time.time()
    gbs = read_bandwidth_gbs()
    src = smollm2_source(args.source_tokens)
    runs = []
    for name in args.shapes:
        for n in args.tokens:
            r = measure(SHAPES[name], n, args.budgets, args.k, args.rerank, args.layers, args.repeats, src, gbs,
                        args.gpu_step_ms)  # fmt: skip
            runs.append({"shape": name, **SHAPES[name], "tokens": n, "methods": r})
            for mname, v in r.items():
                print(f"{name} {n:7d} {mname:16s} {v['select_ms_per_step']:8.1f} ms/step  index "
                      f"{v['index_fraction']:.3f}  floor {v['floor_ms_at_read_bandwidth']} ms", flush=True)  # fmt: skip
    out = {"bench": "select_shapes", "read_bandwidth_gbs": gbs, "threads": torch.get_num_threads(), "k": args.k,
           "rerank": args.rerank, "layers_measured": args.layers, "gpu_step_ms": args.gpu_step_ms, "runs": runs,
           "seconds": round(time.time() - t0, 1)}  # fmt: skip
    if args.out:
        from bench.cli import write_result

        write_result(out, args.out, dtype="float32")  # the model (HF, float32); the host tier holds bfloat16
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
