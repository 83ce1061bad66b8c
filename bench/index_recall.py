"""Host-index recall: how much of the exact top-k each index finds, for the same query.

``spec_host`` never reads every key: it scores the candidates with an index and
re-ranks the best ``rerank x k`` with the exact keys. This bench isolates that
approximation from prediction: per decode step, layer and KV head, the query
is the real one, and the reference is ``spec_host_exact`` (every key, same
query). Methods:

* ``spec_host rerank=R``: the int8 key index (:class:`~dd_sglang.prefetch.index.QuantKeyIndex`,
  the default, ``R`` = 2), exactly as the server selects.
* ``int4 rerank=R``: the same with 4-bit keys (absmax / 7 per token and KV head, one
  signed level in 15), emulated in the int8 index's arithmetic: what halving the
  index's bytes would cost in recall (no kernel reads 4-bit keys).
* ``minmax_blocks rerank=R``: Quest's min/max summaries of 16-token blocks
  (:class:`~dd_sglang.prefetch.index.KeyBlockIndex`): the best blocks covering
  ``R x k`` tokens are read and re-ranked exactly (the index ``spec_host`` used
  before the int8 index).
* ``quest_device``: the best blocks' tokens, no key read (Quest).

``key_bytes_read`` is the fraction of the exact selector's key bytes a selection reads (index
and exact keys, at the model's KV dtype ``--kv-bytes``).

The model runs in HF transformers on the CPU (``bench.ceiling.load_model``), one text from
``harness.texts`` as context, ``--steps`` decode steps teacher-forced from the text.

Run: ``python -m bench.index_recall --tokens 4000 7900 --k 256 --out bench/results/index_recall_cpu.json``
(about 1 min per context length on a 2-core CPU).
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from bench.ceiling import QueryCapture, load_model
from dd_sglang.prefetch.index import KeyBlockIndex, QuantKeyIndex
from dd_sglang.prefetch.scoring import (
    BLOCK_TOKENS,
    block_scores,
    block_tokens,
    row_blocks,
    token_log_scores,
)
from dd_sglang.prefetch.selectors import make_selector
from harness.texts import available_texts, text

N_SINK, N_RECENT = 4, 128


class _Int4KeyIndex(QuantKeyIndex):
    """:class:`QuantKeyIndex` holding 4-bit levels (``round(k / scale)`` in [-7, 7], ``scale = max |k| / 7``)
    in its int8 tensor: scored by the same arithmetic, so the recall is that of 4-bit keys."""

    def update(self, host_slots: torch.Tensor, start: int, end: int) -> None:
        dst = host_slots[start:end]
        keys = self.host_k[:, dst].float()
        s = keys.abs().amax(dim=-1).clamp_(min=1e-12).div_(7.0)
        self.q8[:, dst] = keys.div_(s.unsqueeze(-1)).round_().clamp_(-7, 7).to(torch.int8)
        self.scale[:, dst] = s


def _minmax_rerank(q, rows, host_k, k, scale, index, layer, rerank):
    """The best min/max blocks covering ``rerank x k`` tokens, re-ranked exactly: ``[R, Hkv, k]`` positions."""
    m = min(rows.blocks.shape[1], -(-(int(rerank * k) + rows.holes) // BLOCK_TOKENS))
    chosen = block_scores(q, rows, index.mins[layer], index.maxs[layer], scale).topk(m, dim=-1).indices
    pos, slots, ok = block_tokens(rows, chosen)
    score = token_log_scores(q, host_k, slots, ok, scale)
    return pos.gather(-1, score.topk(k, dim=-1).indices)


def _recall(sel: torch.Tensor, ref: torch.Tensor) -> float:
    hkv, k = ref.shape[1], ref.shape[2]
    return sum(len(set(sel[0, h].tolist()) & set(ref[0, h].tolist())) for h in range(hkv)) / (hkv * k)


@torch.no_grad()
def run(n_tokens: int, k: int, steps: int, kv_bytes: int, model, tok) -> dict:
    """Mean recall per method over ``steps`` steps x every layer, at context ``n_tokens``."""
    from transformers import DynamicCache

    ids = tok.encode(text(available_texts()[0]))
    if len(ids) < n_tokens + steps:
        raise ValueError(f"--tokens {n_tokens}: the text has only {len(ids)} tokens")
    cap = QueryCapture(model)
    cache = DynamicCache(config=model.config)
    model(torch.tensor([ids[:n_tokens]]), past_key_values=cache, use_cache=True)
    n_layers = len(model.model.layers)
    hkv = model.config.num_key_value_heads
    d = model.config.hidden_size // model.config.num_attention_heads
    scale = d**-0.5
    exact = make_selector("spec_host_exact")
    quest = make_selector("quest_device")
    recall: dict[str, list[float]] = {}
    reads: dict[str, float] = {}
    for step in range(steps):
        pos = n_tokens + step
        model(torch.tensor([[ids[pos]]]), past_key_values=cache, use_cache=True, position_ids=torch.tensor([[pos]]))
        n = pos + 1
        slots_total = -(-n // 64) * 64
        host_k = torch.zeros(n_layers, slots_total, hkv, d)
        for layer in range(n_layers):
            host_k[layer, :n] = cache.layers[layer].keys[0, :, :n].permute(1, 0, 2).float()
        slots = torch.arange(slots_total)
        blocks, quant, quant4 = KeyBlockIndex(host_k), QuantKeyIndex(host_k), _Int4KeyIndex(host_k)
        blocks.update(slots, 0, n)
        quant.update(slots, 0, n)
        quant4.update(slots, 0, n)
        hi = n - N_RECENT
        rows = row_blocks([slots], [N_SINK], [hi], [torch.arange(N_SINK)])
        cand = hi - N_SINK
        for layer in range(n_layers):
            q = cap.queries[layer].view(1, -1, d)
            ref = exact.select(q, rows, host_k[layer], k, scale)[0]
            for r in (1, 2, 4):
                name = f"spec_host rerank={r}"
                sel = make_selector("spec_host", r).select(q, rows, host_k[layer], k, scale, quant, layer)[0]
                recall.setdefault(name, []).append(_recall(sel, ref))
                reads[name] = ((d + 4) / (d * kv_bytes) * cand + min(r * k, cand)) / cand
            for r in (2, 4):
                name = f"int4 rerank={r}"
                sel = make_selector("spec_host", r).select(q, rows, host_k[layer], k, scale, quant4, layer)[0]
                recall.setdefault(name, []).append(_recall(sel, ref))
                reads[name] = ((d / 2 + 4) / (d * kv_bytes) * cand + min(r * k, cand)) / cand
            for r in (2, 4, 8):
                name = f"minmax_blocks rerank={r}"
                sel = _minmax_rerank(q, rows, host_k[layer], k, scale, blocks, layer, r)
                recall.setdefault(name, []).append(_recall(sel, ref))
                reads[name] = (2 * cand / BLOCK_TOKENS + min(r * k + BLOCK_TOKENS, cand)) / cand
            sel = quest.select(q, rows, host_k[layer], k, scale, blocks, layer)[0]
            recall.setdefault("quest_device", []).append(_recall(sel, ref))
            reads["quest_device"] = 2 / BLOCK_TOKENS
    cap.close()
    return {
        "tokens": n_tokens,
        "k": k,
        "steps": steps,
        "methods": {
            m: {"recall_vs_exact": round(sum(v) / len(v), 4), "samples": len(v),
                "key_bytes_read": round(reads[m], 3)}  # fmt: skip
            for m, v in recall.items()
        },
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4000, 7900])
    ap.add_argument("--k", type=int, default=256)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--kv-bytes", type=int, default=2, help="KV element size the read fractions assume (2: bf16)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.k < 1 or args.steps < 1:
        ap.error("--k and --steps must be >= 1")
    from transformers import AutoTokenizer

    from dd_sglang.models.smollm2 import prepare_model

    torch.set_num_threads(max(1, torch.get_num_threads()))
    tok = AutoTokenizer.from_pretrained(prepare_model(progress=False))
    model = load_model()
    t0 = time.time()
    out = {
        "bench": "index_recall",
        "command": "python -m bench.index_recall " + " ".join(argv if argv is not None else __import__("sys").argv[1:]),
        "machine": platform.processor() or platform.machine(),
        "runs": [run(n, args.k, args.steps, args.kv_bytes, model, tok) for n in args.tokens],
    }
    out["seconds"] = round(time.time() - t0, 1)
    print(json.dumps(out, indent=1))
    if args.out:
        from bench.cli import write_result

        write_result(out, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
