"""Offline prediction ceiling: what a perfect speculator would give, computed with HF transformers.

DESIGN.md ("Measuring the prefetch hit rate honestly"): at decode step t the
critical set is the exact top-k of the real query ``q_l(x_t)`` over the
candidate keys (per layer and KV head, GQA max over the group's softmax
probabilities). A one-step-ahead predictor fixes it during step t-1 from a
speculated token. The best any speculator can do without seeing ``x_t`` is the
argmax after the true context, ``a_t = argmax p(. | x_<t)``; the **ceiling** is
the recall / mass coverage of ``top_k(q_l(a_t))`` against ``top_k(q_l(x_t))``.
Beside it, the zero-state baseline **recency**: ``top_k(q_l(x_{t-1}))`` (the
previous step's exact set).

The model runs in HF transformers (full attention, so queries are the dense
path's), one token per step with a KV cache: the speculated token ``a_t`` is
run at position t and removed from the cache (``DynamicCache.crop(-1)``),
then the real ``x_t``. Queries are captured after RoPE by a pre-hook on each
attention module; keys are the cache's (post-RoPE). Candidates mirror the
server's host-tier candidates: every position except the first ``n_sink`` and
the last ``n_recent`` (the resident set; the server's window is 128-192 tokens
as it slides by pages, here a fixed 128). Scoring reuses
:func:`dd_sglang.prefetch.selectors.gqa_token_scores`.

Regimes (the sequence ``x``): ``greedy`` (``x_t = a_t``, so the ceiling is 1 by
construction and only recency is informative), ``sample_t0.8`` (temperature
0.8, top-p 0.95, seeded), ``teacher_forced`` (the text's own next tokens).
"""

from __future__ import annotations

import torch

from dd_sglang.prefetch.selectors import gqa_token_scores


def set_scores(true_scores: torch.Tensor, chosen: torch.Tensor, k: int) -> tuple[float, float]:
    """Recall and attention-mass coverage of a chosen set against the exact top-k.

    Args:
        true_scores: ``[num_kv_heads, C]`` float, the real query's GQA scores over the candidates
            (:func:`gqa_token_scores`).
        chosen: ``[num_kv_heads, k]`` int64 candidate indices chosen by a predictor.
        k: set size (``<= C``).

    Returns:
        ``(recall, mass)``: ``|chosen ∩ top_k| / (num_kv_heads x k)`` and the real query's
        probability mass on ``chosen`` over its mass on the exact top-k (summed over KV heads,
        as the server's ``dd_prefetch_mass_*_total`` counters).
    """
    top = true_scores.topk(k, dim=-1)
    hits = sum(int(torch.isin(chosen[h], top.indices[h]).sum()) for h in range(true_scores.shape[0]))
    mass = float(true_scores.gather(1, chosen).sum()) / float(top.values.sum())
    return hits / (true_scores.shape[0] * k), mass


class QueryCapture:
    """Pre-hooks on every decoder layer's attention module recording the last position's query after RoPE.

    ``queries[l]``: ``[num_q_heads, head_dim]`` float of the last forward's last position.
    """

    def __init__(self, model):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        self._rope = apply_rotary_pos_emb
        self.queries: dict[int, torch.Tensor] = {}
        self._handles = []
        for i, layer in enumerate(model.model.layers):
            self._handles.append(layer.self_attn.register_forward_pre_hook(self._hook(i), with_kwargs=True))

    def _hook(self, i):
        def hook(module, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            cos, sin = kwargs["position_embeddings"]
            q = module.q_proj(h[:, -1:]).view(1, 1, -1, module.head_dim).transpose(1, 2)
            q, _ = self._rope(q, q, cos[:, -1:], sin[:, -1:])
            self.queries[i] = q[0, :, 0, :].detach().float()

        return hook

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def load_model(dtype: torch.dtype = torch.float32, yarn: float | None = None):
    """The embedded model in HF transformers (converted dir of ``prepare_model()``), eval mode.

    ``yarn``: extend its context by this factor with YaRN RoPE scaling (original 8,192 positions;
    transformers' ``rope_type: yarn``), as SGLang's ``--json-model-override-args`` does for a server.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from dd_sglang.models.smollm2 import prepare_model

    path = prepare_model(progress=False)
    config = AutoConfig.from_pretrained(path)
    if yarn is not None:
        original = config.max_position_embeddings
        config.rope_parameters = {**config.rope_parameters, "rope_type": "yarn", "factor": float(yarn),
                                  "original_max_position_embeddings": original}  # fmt: skip
        config.max_position_embeddings = int(original * yarn)
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def _next(regime: str, logits: torch.Tensor, forced: int | None, gen: torch.Generator) -> int:
    if regime == "greedy":
        return int(logits.argmax())
    if regime == "teacher_forced":
        return int(forced)
    probs = torch.softmax(logits.float() / 0.8, dim=-1)  # sample_t0.8: temperature 0.8, top-p 0.95
    sp, si = probs.sort(descending=True)
    keep = sp.cumsum(0) - sp < 0.95
    sp = sp * keep
    return int(si[torch.multinomial(sp / sp.sum(), 1, generator=gen)])


@torch.no_grad()
def ceiling_run(model, prompt: list[int], continuation: list[int], steps: int, regime: str,
                ks: list[int], n_sink: int = 4, n_recent: int = 128, seed: int = 0) -> dict:  # fmt: skip
    """One request's ceiling and recency figures (module docstring).

    Args:
        model: :func:`load_model`'s model.
        prompt: context token ids.
        continuation: the text's next tokens (``teacher_forced``; at least ``steps + 1``).
        steps: scored decode steps (the first output token comes from the prefill; step
            ``j = 1..steps`` inputs ``x_j``).
        regime: ``greedy``, ``sample_t0.8`` or ``teacher_forced``.
        ks: set sizes to score (each ``< context - n_sink - n_recent``).

    Returns:
        ``{k: {"ceiling_recall", "ceiling_mass", "recency_recall", "recency_mass": per-layer lists
        (mean over steps), "spec_equals_real": fraction of steps with a_t == x_t}}``.

    Raises:
        ValueError: unknown regime, or a ``k`` not below the candidate count.
    """
    if regime not in ("greedy", "sample_t0.8", "teacher_forced"):
        raise ValueError(f"regime must be greedy, sample_t0.8 or teacher_forced, got {regime!r}")
    if regime == "teacher_forced" and len(continuation) < steps + 1:
        raise ValueError(f"continuation has {len(continuation)} tokens, need {steps + 1}")
    if max(ks) >= len(prompt) - n_sink - n_recent:
        raise ValueError(f"k {max(ks)} must be below the {len(prompt) - n_sink - n_recent} candidates")
    from transformers import DynamicCache

    cap = QueryCapture(model)
    layers = len(model.model.layers)
    cfg = model.config
    scale = (cfg.hidden_size // cfg.num_attention_heads) ** -0.5
    gen = torch.Generator().manual_seed(seed)
    acc = {k: {m: torch.zeros(layers, dtype=torch.float64) for m in ("cr", "cm", "rr", "rm")} for k in ks}
    same = 0
    try:
        cache = DynamicCache(config=cfg)
        out = model(torch.tensor([prompt]), past_key_values=cache, use_cache=True)
        logits = out.logits[0, -1]
        x = _next(regime, logits, continuation[0] if continuation else None, gen)
        q_prev = None
        pos = len(prompt)
        for j in range(steps + 1):
            a = int(logits.argmax())
            q_spec = None
            if j >= 1 and a != x:
                model(torch.tensor([[a]]), past_key_values=cache, use_cache=True,
                      position_ids=torch.tensor([[pos]]))  # fmt: skip
                q_spec = dict(cap.queries)
                cache.crop(-1)
            out = model(torch.tensor([[x]]), past_key_values=cache, use_cache=True,
                        position_ids=torch.tensor([[pos]]))  # fmt: skip
            q_true = dict(cap.queries)
            if j >= 1:
                same += a == x
                hi = pos + 1 - n_recent
                for layer in range(layers):
                    keys = cache.layers[layer].keys[0, :, n_sink:hi, :].permute(1, 0, 2).float()  # [C, Hkv, D]
                    true = gqa_token_scores(q_true[layer], keys, scale)
                    spec = true if q_spec is None else gqa_token_scores(q_spec[layer], keys, scale)
                    prev = gqa_token_scores(q_prev[layer], keys, scale)
                    for k in ks:
                        r, m = set_scores(true, spec.topk(k, dim=-1).indices, k)
                        acc[k]["cr"][layer] += r
                        acc[k]["cm"][layer] += m
                        r, m = set_scores(true, prev.topk(k, dim=-1).indices, k)
                        acc[k]["rr"][layer] += r
                        acc[k]["rm"][layer] += m
            q_prev = q_true
            logits = out.logits[0, -1]
            pos += 1
            if j < steps:
                x = _next(regime, logits, continuation[j + 1] if regime == "teacher_forced" else None, gen)
    finally:
        cap.close()
    names = {"cr": "ceiling_recall", "cm": "ceiling_mass", "rr": "recency_recall", "rm": "recency_mass"}
    return {k: {names[m]: [round(float(v) / steps, 5) for v in t] for m, t in d.items()}
            | {"spec_equals_real": round(same / steps, 4)} for k, d in acc.items()}  # fmt: skip
