"""Recall of the host selection against the exact top-k: the full scan and the two-level selection.

Per decode step, layer and KV head of SmolLM2 over real text (teacher-forced, HF transformers on
the CPU), the reference is the exact top-k of the real query computed here in plain PyTorch,
float32, apart from the selector code: a token's score is the max over the KV head's query heads
of its softmax probability over the candidates (every position but the 4 sinks and the last 128,
which stay resident). Against it:

* ``full_scan``: the C kernel's selection as the CPU preset runs it (``host_sync``: every
  candidate scored with the int8 index, the best ``rerank x k`` re-ranked exactly);
* ``two_level T``: the same kernel with a first level of ``T`` tokens per KV head
  (``experimental.first_level_tokens``: each KV head's best ``T / 16`` blocks by their int8 mean
  key, the union over KV heads, then as the full scan);
* ``exact_bound_scan``: what an exact two-level would read: the fraction of 16-token blocks whose
  Quest upper bound (element-wise min/max of the block's keys, with the exact normaliser) reaches
  the ``rerank x k``-th best score, i.e. the blocks a scan in bound order must read before it can
  stop with the exact top ``rerank x k``.

* ``emulated B-bit m``: the same pipeline written here in plain PyTorch (not the kernel), with the
  index's keys quantised to ``B`` bits (per token and KV head, absmax / (2^(B-1) - 1), round half to
  even; the query to int8 as the kernel does) and ``m`` candidates re-ranked exactly: what a lower-bit
  index would select. ``emulated 8-bit 512`` (the preset's ``rerank x k``) is the control: it
  should match ``full_scan``'s recall.
  A 4-bit index reads half the int8 index's bytes (``index_read`` 0.5 plus the scales).

``index_read``: the fraction of the full scan's index bytes a selection reads: the block means
(1/16 of the index, read only when the row has more blocks than the budget) and the index rows
of the kept candidates, counted per row (the union over
KV heads). Each recall has a 95% interval (normal approximation over the step x layer x head
samples) and a per-layer breakdown.

Run: ``python -m bench.select_recall --tokens 4000 7900 --out bench/results/select_recall_cpu.json``
(about 2 min per length on a 2-core CPU). Past SmolLM2's 8,192 positions, with YaRN RoPE scaling
(``--yarn 4``: 32k positions; the model's quality there is its own, the keys and queries are
what a sparse step would select from): ``python -m bench.select_recall --yarn 4 --tokens 16000
30000 --steps 4 --out bench/results/select_recall_yarn4_cpu.json`` (prefill in chunks of 2,048
tokens; about 15 min).
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from bench.ceiling import QueryCapture, load_model
from dd_sglang.kernels import native
from dd_sglang.prefetch.index import QuantKeyIndex
from dd_sglang.prefetch.scoring import row_blocks
from harness.texts import available_texts, text

N_SINK, N_RECENT, BLOCK = 4, 128, 16
#: Prompt tokens per prefill forward (HF transformers, plain causal attention over the cache).
PREFILL_CHUNK = 2048


def _interval(xs: list[float]) -> dict:
    t = torch.tensor(xs, dtype=torch.float64)
    half = 1.96 * float(t.std()) / math.sqrt(len(xs)) if len(xs) > 1 else 0.0
    return {"mean": round(float(t.mean()), 4), "ci95": [round(float(t.mean()) - half, 4),
                                                         round(float(t.mean()) + half, 4)], "n": len(xs)}  # fmt: skip


def _exact_top(q: torch.Tensor, keys: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [Hkv, G, D]``, ``keys [C, Hkv, D]`` float32: the exact top-k candidate indices ``[Hkv, k]``
    and every candidate's score ``[Hkv, C]`` (max over the group of the log-probability)."""
    a = torch.einsum("hgd,chd->hgc", q, keys) * q.shape[-1] ** -0.5
    s = (a - a.logsumexp(-1, keepdim=True)).amax(1)
    return s.topk(k, -1).indices, s


def _bound_read(q: torch.Tensor, keys: torch.Tensor, score: torch.Tensor, m: int) -> float:
    """Fraction of whole 16-token blocks whose Quest bound reaches the m-th best score."""
    c, hkv, d = keys.shape
    nb = c // BLOCK
    kb = keys[: nb * BLOCK].view(nb, BLOCK, hkv, d)
    lo, hi = kb.amin(1), kb.amax(1)  # [nb, Hkv, D]
    a = torch.einsum("hgd,chd->hgc", q, keys) * d**-0.5
    z = a.logsumexp(-1, keepdim=True)  # [Hkv, G, 1]
    ub = torch.maximum(q[:, :, None] * lo.permute(1, 0, 2)[:, None], q[:, :, None] * hi.permute(1, 0, 2)[:, None])
    bound = (ub.sum(-1) * d**-0.5 - z).amax(1)  # [Hkv, nb]
    thr = score.topk(m, -1).values[:, -1:]
    return float((bound >= thr).float().mean())


def _read(q8: tuple[torch.Tensor, torch.Tensor], idx: QuantKeyIndex, layer: int, n: int, pages: int, d: int) -> float:
    """Index bytes the two-level selection reads, as a fraction of the full scan's: the block means
    (1/16, where the row has more blocks than ``pages``; the kernel reads none otherwise) and the
    candidates the first level keeps (the union over KV heads), recomputed in PyTorch."""
    lo, hi = N_SINK, n - N_RECENT
    blocks = torch.arange(lo // BLOCK, (hi - 1) // BLOCK + 1)
    if blocks.numel() <= pages:
        return 1.0
    means, scales = idx.block_means
    m8, ms = means[layer, blocks].float(), scales[layer, blocks]  # [B, Hkv, D], [B, Hkv]
    qq, qs = q8
    a = torch.einsum("hgd,bhd->hgb", qq, m8) * ms.T[:, None, :] * qs * d**-0.5
    bs = (a - a.logsumexp(-1, keepdim=True)).amax(1)
    keep = torch.zeros(blocks.numel(), dtype=torch.bool)
    for h in range(bs.shape[0]):
        keep[torch.sort(-bs[h], stable=True).indices[:pages]] = True
    pos = torch.arange(lo, hi)
    return (blocks.numel() + int(keep[pos // BLOCK - blocks[0]].sum())) / (hi - lo)


def _quantise(x: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., D]`` float32 as integers in ``[-top, top]`` (values, float32) and the scale of each
    vector ``[..., 1]``: absmax / ``top``, round half to even, as the kernel quantises keys and queries."""
    s = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / top
    return torch.round(x / s), s


def _emulated(qq: torch.Tensor, keys: torch.Tensor, bits: int, m: int, k: int) -> torch.Tensor:
    """The kernel's pipeline (``cpu_select.c`` header, steps 1-7) in plain PyTorch over a ``bits``-bit key
    index: ``qq [Hkv, G, D]``, ``keys [C, Hkv, D]`` float32 (the host tier's bf16 values); the chosen
    candidate indices ``[Hkv, k]``."""
    d = qq.shape[-1]
    scale = d**-0.5
    kq, ks = _quantise(keys, 2 ** (bits - 1) - 1)  # ks [C, Hkv, 1]
    qi, qs = _quantise(qq, 127)  # qs [Hkv, G, 1]
    a = torch.einsum("hgd,chd->hgc", qi, kq) * ks[:, :, 0].T[:, None, :] * qs * scale  # [Hkv, G, C]
    z = a.logsumexp(-1, keepdim=True)
    cand = (a - z).amax(1).topk(min(m, a.shape[-1]), -1).indices  # [Hkv, m]
    out = []
    for h in range(qq.shape[0]):
        c = cand[h]
        taken = (a[h][:, c] - z[h]).exp().sum(-1).clamp(max=1.0)  # [G]: approximate mass of the m
        e = qq[h] @ keys[c, h].T * scale  # [G, m] exact logits
        rest = torch.where(taken >= 1.0, torch.full_like(taken, -math.inf), z[h, :, 0] + torch.log1p(-taken))
        zz = torch.logaddexp(e.logsumexp(-1), rest)
        out.append(c[(e - zz[:, None]).amax(0).topk(k).indices])
    return torch.stack(out)


@torch.no_grad()
def run(n_tokens: int, k: int, rerank: float, budgets: list[int], steps: int, model, tok,
        emulate: list[tuple[int, int]] = ()) -> dict:  # fmt: skip
    """Recall per method at context ``n_tokens`` (module docstring)."""
    from transformers import DynamicCache

    ids = tok.encode(text(available_texts()[0]))
    if len(ids) < n_tokens + steps:
        raise ValueError(f"--tokens {n_tokens}: the text has only {len(ids)} tokens")
    cap = QueryCapture(model)
    cache = DynamicCache(config=model.config)
    for c0 in range(0, n_tokens, PREFILL_CHUNK):  # chunks bound the attention's memory at long contexts
        model(torch.tensor([ids[c0 : min(n_tokens, c0 + PREFILL_CHUNK)]]), past_key_values=cache, use_cache=True)
    n_layers, hkv = len(model.model.layers), model.config.num_key_value_heads
    d = model.config.hidden_size // model.config.num_attention_heads
    m = int(math.ceil(rerank * k))
    recall: dict[str, list[list[float]]] = {}
    reads: dict[str, list[float]] = {}
    seconds: dict[str, list[float]] = {}
    bound_reads: list[float] = []
    for step in range(steps):
        pos = n_tokens + step
        model(torch.tensor([[ids[pos]]]), past_key_values=cache, use_cache=True, position_ids=torch.tensor([[pos]]))
        n = pos + 1
        total = -(-n // 64) * 64
        host_k = torch.zeros(n_layers, total, hkv, d, dtype=torch.bfloat16)
        for layer in range(n_layers):
            host_k[layer, :n] = cache.layers[layer].keys[0, :, :n].permute(1, 0, 2)
        slots = torch.arange(total)
        idx = QuantKeyIndex(host_k, native=True, block_means=True)
        idx.update(slots, 0, n)
        rows = row_blocks([slots], [N_SINK], [n - N_RECENT], [torch.arange(N_SINK)])
        q = torch.stack([cap.queries[layer] for layer in range(n_layers)]).view(n_layers, 1, -1, d)
        methods = {"full_scan": None, **{f"two_level {b}": b // BLOCK for b in budgets}}
        chosen = {}
        for name, pages in methods.items():
            arg = None if pages is None else (*idx.block_means, pages)
            t0 = time.perf_counter()
            chosen[name] = native.spec_host_select(q, *rows.tokens, idx.q8, idx.scale, host_k, k, m, d**-0.5,
                                                   None, arg)[0]  # fmt: skip
            seconds.setdefault(name, []).append(time.perf_counter() - t0)
        lo, hi = N_SINK, n - N_RECENT
        for layer in range(n_layers):
            keys = host_k[layer, lo:hi].float()
            qq = q[layer, 0].view(hkv, -1, d)
            ref, score = _exact_top(qq, keys, k)
            ref = ref + lo
            bound_reads.append(_bound_read(qq, keys, score, m))
            qint = _quantise(qq, 127)
            for bits, em in emulate:
                name = f"emulated {bits}-bit {em}"
                got = _emulated(qq, keys, bits, em, k) + lo
                per_layer = recall.setdefault(name, [[] for _ in range(n_layers)])[layer]
                for h in range(hkv):
                    per_layer.append(len(set(got[h].tolist()) & set(ref[h].tolist())) / k)
                reads.setdefault(name, []).append((bits / 8 * d + 4) / (d + 4))
            for name, pages in methods.items():
                got = chosen[name][layer, 0]
                per_layer = recall.setdefault(name, [[] for _ in range(n_layers)])[layer]
                for h in range(hkv):
                    per_layer.append(len(set(got[h].tolist()) & set(ref[h].tolist())) / k)
                reads.setdefault(name, []).append(1.0 if pages is None else _read(qint, idx, layer, n, pages, d))
    cap.close()
    out = {"tokens": n_tokens, "candidates": n_tokens - N_SINK - N_RECENT, "k": k, "rerank": rerank, "steps": steps,
           "exact_bound_scan_blocks_read": round(sum(bound_reads) / len(bound_reads), 4), "methods": {}}  # fmt: skip
    full = sum(sum(x) for x in recall["full_scan"]) / sum(len(x) for x in recall["full_scan"])
    for name, per_layer in recall.items():
        every = [v for x in per_layer for v in x]
        out["methods"][name] = {
            "recall_vs_exact": _interval(every),
            "of_full_scan": round(sum(every) / len(every) / full, 4),
            "worst_layer": min(range(n_layers), key=lambda i: sum(per_layer[i])),
            "per_layer": [round(sum(x) / len(x), 4) for x in per_layer],
            "index_read": round(sum(reads[name]) / len(reads[name]), 4),
        }
        if name in seconds:  # the kernel's arms (the emulated ones are plain PyTorch, not timed)
            out["methods"][name]["select_ms_all_layers"] = round(1000 * min(seconds[name]), 2)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4000, 7900])
    ap.add_argument("--k", type=int, default=256)
    ap.add_argument("--rerank", type=float, default=2.0)
    ap.add_argument("--budgets", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--yarn", type=float, default=None,
                    help="YaRN RoPE factor for contexts past SmolLM2's 8,192 (e.g. 2 for 16k, 4 for 32k)")
    ap.add_argument("--emulate", nargs="*", default=[], metavar="BITSxM",
                    help="emulated lower-bit index arms, e.g. 4x512 4x1024 8x512 (module docstring)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    try:
        emulate = [tuple(int(x) for x in e.split("x")) for e in args.emulate]
    except ValueError:
        emulate = [()]
    if any(len(e) != 2 or not 2 <= e[0] <= 8 or e[1] < args.k for e in emulate):
        ap.error(f"--emulate: each must be BITSxM with BITS in [2, 8] and M >= --k ({args.k}); got {args.emulate}")
    from bench.cli import check_ranges

    check_ranges(ap, args, (("k", 1, 4096), ("steps", 1, 1000), ("rerank", 1.0, 64.0)))
    if any(b < math.ceil(args.rerank * args.k) + 32 for b in args.budgets):
        ap.error(f"--budgets: each must be at least rerank x k + 32 = {math.ceil(args.rerank * args.k) + 32}")
    if not native.available():
        ap.error(f"the C selection kernel is not built here: {native.unavailable_reason()}")
    from transformers import AutoTokenizer

    from dd_sglang.models.smollm2 import prepare_model

    tok = AutoTokenizer.from_pretrained(prepare_model(progress=False))
    model = load_model(yarn=args.yarn)
    t0 = time.time()
    out = {"bench": "select_recall", "yarn": args.yarn,
           "runs": [run(n, args.k, args.rerank, args.budgets, args.steps, model, tok, emulate) for n in args.tokens]}  # fmt: skip
    out["seconds"] = round(time.time() - t0, 1)
    for r in out["runs"]:
        print(r["tokens"], "exact bound scan reads", r["exact_bound_scan_blocks_read"], "of the blocks")
        for name, v in r["methods"].items():
            print(f"  {name:16s} recall {v['recall_vs_exact']['mean']:.4f} ({v['of_full_scan']:.4f} of full) "
                  f"index read {v['index_read']:.3f}  {v.get('select_ms_all_layers', '-')} ms")  # fmt: skip
    if args.out:
        from bench.cli import write_result

        write_result(out, args.out, dtype="float32")  # the model (HF, float32); the host tier holds bfloat16
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
