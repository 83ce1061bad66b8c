"""Coupled sampling (:mod:`dd_sglang.attention.coupling`), no server.

These check what the coupling relies on: each draw is an exact sample of the distribution SGLang
would sample (temperature, top-p, top-k, min-p), two draws with the same seed and position from
nearly the same distribution agree, and the sampler hook replaces exactly the stashed rows' tokens.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dd_sglang.attention import coupling


def _info(bs: int, temperature: float = 0.8, top_p: float = 1.0, top_k: int = 1 << 30):
    return SimpleNamespace(
        temperatures=torch.full((bs, 1), temperature), top_ps=torch.full((bs,), top_p),
        top_ks=torch.full((bs,), top_k, dtype=torch.int32), min_ps=torch.zeros(bs),
        need_top_p_sampling=top_p < 1.0, need_top_k_sampling=top_k < (1 << 30), need_min_p_sampling=False,
        is_all_greedy=False, sampling_seed=None, grammars=None, has_custom_logit_processor=False,
        sampling_mask_batch_indices=None,
    )  # fmt: skip


@pytest.mark.parametrize("top_p", [1.0, 0.95])
def test_seeded_draw_is_an_exact_sample_of_the_tempered_distribution(top_p):
    """Over 4,000 seeds at one position, each token's frequency is its tempered (top-p) probability."""
    logits = torch.tensor([2.0, 1.5, 0.5, 0.0, -1.0, -3.0])
    n = 4000
    info = _info(n, 0.8, top_p)
    seeds = torch.arange(n, dtype=torch.int64) * 7919 + 11
    ids = coupling.draw(logits.expand(n, -1), info, torch.arange(n), seeds.tolist(), [4321] * n)
    p = torch.softmax(logits / 0.8, dim=-1)
    if top_p < 1.0:  # SGLang's rule: keep the sorted prefix whose mass before each token is <= top_p
        order = p.argsort(descending=True)
        before = torch.cumsum(p[order], 0) - p[order]
        keep = torch.zeros_like(p, dtype=torch.bool)
        keep[order[before <= top_p]] = True
        p = torch.where(keep, p, 0.0)
        p = p / p.sum()
    freq = torch.bincount(ids, minlength=6).double() / n
    sd = (p.double() * (1 - p.double()) / n).sqrt()
    assert torch.all((freq - p.double()).abs() <= 4 * sd + 1e-9), (freq, p)
    if top_p < 1.0:
        assert freq[p == 0].sum() == 0


def test_same_seed_and_position_couple_nearby_distributions():
    """The riding position's distribution differs from the real one's by its sparse attention:
    with the same seed and position the two draws agree in ~all cases, with independent seeds only
    as often as two independent samples do."""
    g = torch.Generator().manual_seed(0)
    m, vocab = 2000, 200
    real = torch.randn(m, vocab, generator=g) * 3
    riding = real + 0.02 * torch.randn(m, vocab, generator=g)
    info, rows = _info(m, 0.8, 0.95), torch.arange(m)
    seeds, pos = torch.randint(0, 2**62, (m,), generator=g), torch.arange(m) + 1000
    a = coupling.draw(real, info, rows, seeds.tolist(), pos.tolist())
    b = coupling.draw(riding, info, rows, seeds.tolist(), pos.tolist())
    c = coupling.draw(riding, info, rows, (seeds + 1).tolist(), pos.tolist())
    d = coupling.draw(riding, info, rows, seeds.tolist(), (pos + 1).tolist())
    assert (a == b).double().mean() > 0.97
    assert (a == c).double().mean() < 0.6 and (a == d).double().mean() < 0.6
    assert (a == real.argmax(-1)).double().mean() < 0.9  # the draws are samples, not argmaxes


@pytest.mark.parametrize("widths", [(1024,), (2,), (1, 2)])
def test_kept_tokens_follow_sglangs_top_k_top_p_min_p(widths):
    """top_k keeps the k most likely tokens, min_p those at least min_p x the largest probability,
    top_p those whose preceding mass is at most top_p; with narrow ``widths`` the kept prefix runs past
    the sorted part and a wider one (at last the whole vocabulary) is sorted."""
    probs = torch.tensor([[0.15, 0.5, 0.05, 0.3]])
    one, none = torch.ones(1), torch.zeros(1)

    def kept(top_k, top_p, min_p):
        p, ids = coupling.kept_sorted(probs, torch.tensor([top_k]), top_p, min_p, widths)
        return {int(i): round(float(v), 6) for i, v in zip(ids[0], p[0], strict=True) if v > 0}

    assert kept(2, one, none) == {1: 0.5, 3: 0.3}
    assert kept(99, one, torch.tensor([0.25])) == {1: 0.5, 3: 0.3, 0: 0.15}
    assert kept(99, torch.tensor([0.75]), none) == {1: 0.5, 3: 0.3}  # 0.8 before the third token > 0.75
    assert kept(99, one, none) == {1: 0.5, 3: 0.3, 0: 0.15, 2: 0.05}


def test_race_uniforms_are_splitmix64_outputs():
    """The vectorised stream equals the reference SplitMix64 (unsigned 64-bit arithmetic) output
    for output ``token + 1`` from the state of ``(seed, position)``, for seeds across the int64 range."""
    mask = (1 << 64) - 1

    def splitmix(state, i):
        z = (state + i * 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    for seed, pos in [(0, 0), (42, 4096), ((1 << 63) - 1, 7), (-5 & mask, 123456)]:
        state = coupling.stream_base(seed, pos)
        base = torch.tensor([[coupling._i64(state)]])
        tokens = torch.tensor([[0, 1, 2, 49151, 123456]])
        got = coupling.race_uniforms(base, tokens)[0].tolist()
        want = [((splitmix(state, t + 1) >> 11) + 0.5) / (1 << 53) for t in tokens[0].tolist()]
        assert got == want


def test_sampler_hook_replaces_exactly_the_stashed_rows():
    """``sample`` runs SGLang's sampler, then puts the coupled draws (computed from the logits as they
    were before the sampler scaled them in place) into the stashed rows; other calls, and a stash on
    a call returning logprobs, pass through."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 40, generator=g)
    info = _info(3, 0.7)
    want = coupling.draw(logits[[0, 2]], info, torch.tensor([0, 2]), [5, 9], [100, 200])

    def original(sampler, out, info, return_logprob, top_nums, ids_logprobs, positions, **kw):
        out.next_token_logits.div_(0.7)  # SGLang scales in place
        return torch.tensor([-1, -2, -3], dtype=torch.int32)

    out = SimpleNamespace(next_token_logits=logits.clone(), dd_coupled=(torch.tensor([0, 2]), [5, 9], [100, 200]))
    ids = coupling.sample(original, None, out, info, False, [], [], torch.tensor([100, 150, 200]))
    assert ids.tolist() == [int(want[0]), -2, int(want[1])] and out.dd_coupled is None
    assert coupling.sample(original, None, out, info, False, [], [], None).tolist() == [-1, -2, -3]
    out.dd_coupled = (torch.tensor([0]), [5], [100])  # a step returning logprobs keeps SGLang's tokens
    assert coupling.sample(original, None, out, info, True, [], [], None).tolist() == [-1, -2, -3]


def test_coupled_guesses_stash_the_sampled_sparse_rows_and_draw_the_riding_ones():
    """Sparse rows 1, 2 and 3 of a 4-row batch; row 2 is greedy (SGLang's top_k 1) and keeps SGLang's
    argmax. Rows 1 and 3 ride one token each: the guesses are the draws of the riding logits at the
    riding positions with their requests' seeds, the same draw the sampler makes next step."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 50, generator=g) * 2
    out = SimpleNamespace(next_token_logits=logits)
    info = _info(4, 0.8, 0.95)
    info.top_ks[2] = 1
    fb = SimpleNamespace(sampling_info=info, positions=torch.tensor([10, 20, 30, 40, 21, 41]), return_logprob=False)
    plan = SimpleNamespace(requests=SimpleNamespace(seeds=(111, 222, 333)), rows=torch.tensor([1, 2, 3]),
                           spec=SimpleNamespace(rows=torch.tensor([0, 2])))  # fmt: skip
    guesses = coupling.coupled_guesses(out, plan, fb, 4)
    rows, seeds, positions = out.dd_coupled
    assert rows.tolist() == [1, 3] and seeds == [111, 333] and positions == [20, 40]
    want = coupling.draw(logits[4:], info, torch.tensor([1, 3]), [111, 333], [21, 41])
    assert guesses == want.tolist()
    # next step, row 1's real token at position 21 with the same logits: the same draw
    assert coupling.draw(logits[4:5], info, torch.tensor([1]), [111], [21]).tolist() == want[:1].tolist()
    for field, value in [("is_all_greedy", True), ("grammars", [None]), ("sampling_seed", torch.zeros(4))]:
        setattr(info, field, value)
        assert coupling.coupled_guesses(SimpleNamespace(next_token_logits=logits), plan, fb, 4) is None
        setattr(info, field, _info(1).__dict__[field])
    fb.return_logprob = True
    assert coupling.coupled_guesses(SimpleNamespace(next_token_logits=logits), plan, fb, 4) is None


def test_each_request_gets_its_own_seed_and_keeps_it():
    """The ``n`` samples of one request share a sampling_seed but not a request id: their seeds differ
    (independent draws); a request keeps the seed of its first sparse step."""
    from dd_sglang.prefetch.plan import row_seed as _seed
    from dd_sglang.prefetch.speculators import SpecState

    def row(rid, seed):
        req = SimpleNamespace(sampling_params=SimpleNamespace(sampling_seed=seed))
        return SimpleNamespace(pred=SimpleNamespace(spec=SpecState()), st=SimpleNamespace(rid=rid, req=req))

    a, b, c = row("r-1", 7), row("r-2", 7), row("r-1", 7)
    seeds = [_seed(a), _seed(b), _seed(c)]
    assert seeds[0] != seeds[1] and seeds[0] == seeds[2] and all(0 <= x < 2**63 for x in seeds)
    assert _seed(row("r-1", 8)) != seeds[0] and _seed(row("r-1", None)) != seeds[0]
    a.st.req.sampling_params.sampling_seed = 99  # fixed at the first sparse step
    assert _seed(a) == seeds[0]
