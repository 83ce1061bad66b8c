"""The ``dualdecoder`` backend's plan/run split on SGLang-shaped fakes, no server.

A real :class:`SparseRuntime` (host tier, offload, resident set) over the fakes
of ``tests/test_sparse_runtime.py``; the backend plans a decode step and runs
every layer; each output is compared with attention computed independently,
in float64, over the token set the design says the row must read: the whole
context when ``top_k`` covers it, else the resident set plus the exact top-k of
the query that chose the set (the current query for ``oracle``, the previous
step's speculated query for ``spec_host_exact``).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dd_sglang.attention.backend import BackendEvents, DualDecoderAttnBackend, finish_step
from dd_sglang.kernels import native as native_kernel
from dd_sglang.prefetch.params import PrefetchParams
from dd_sglang.prefetch.selectors import gqa_token_scores
from dd_sglang.prefetch.sources import InPlaceReads, RingCopies
from dd_sglang.prefetch.speculators import SpecState
from tests.test_sparse_runtime import HKV, LAYERS, PER_TOKEN, D, params, setup

HQ = 9
SCALE = D**-0.5
PROMPT = 300


class KVPool:
    """SGLang's ``token_to_kv_pool`` surface the backend uses, over the fake pool's buffers."""

    def __init__(self, pool):
        self.pool, self.start_layer = pool, 0

    def get_key_buffer(self, layer_id):
        return self.pool.k_buffer[layer_id]

    def get_value_buffer(self, layer_id):
        return self.pool.v_buffer[layer_id]

    def set_kv_buffer(self, layer, loc, k, v):
        self.pool.k_buffer[layer.layer_id][loc.loc] = k
        self.pool.v_buffer[layer.layer_id][loc.loc] = v


class DenseFake:
    """The dense delegate: never asked to attend for a sparse-only batch."""

    def init_forward_metadata(self, fb):
        pass

    def forward_decode(self, *a, **kw):  # pragma: no cover - a sparse-only batch has no dense rows
        raise AssertionError("dense delegate called for a sparse row")


class Events(BackendEvents):
    def __init__(self):
        self.cold_n, self.rows, self.steps, self.copied_bytes, self.exact, self.repaired = 0, 0, [], 0, 0, 0
        self.hits_lookups = [0, 0]

    def verified(self, selector, speculator, hits, lookups):
        self.hits_lookups[0] += hits
        self.hits_lookups[1] += lookups

    def miss(self, policy, n, repaired_tokens):
        self.repaired += repaired_tokens

    def exact_rows(self, n):
        self.exact += n

    def cold(self, selector, n):
        self.cold_n += n

    def sparse_rows(self, n):
        self.rows += n

    def step(self, kind, seconds):
        self.steps.append(kind)

    def copied(self, nbytes):
        self.copied_bytes += nbytes


def _layer(i):
    return SimpleNamespace(tp_q_head_num=HQ, qk_head_dim=D, v_head_dim=D, tp_k_head_num=HKV, layer_id=i,
                           scaling=SCALE, is_cross_attention=False)  # fmt: skip


def _decode_mode():
    return SimpleNamespace(is_decode=lambda: True, is_extend=lambda: False)


def _attend(q, keys, values):
    """float64 GQA attention of one query ``[HQ, D]`` over ``[n, HKV, D]``."""
    out = torch.zeros(HQ, D, dtype=torch.float64)
    for h in range(HQ):
        w = torch.softmax(keys[:, h // 3].double() @ q[h].double() * SCALE, 0)
        out[h] = w @ values[:, h // 3].double()
    return out


def _attend_sets(q, k_all, v_all, sets):
    """Per KV head its own position set (``sets[kv]``: a list of positions into ``k_all``)."""
    out = torch.zeros(HQ, D, dtype=torch.float64)
    for h in range(HQ):
        p = torch.tensor(sorted(sets[h // 3]))
        w = torch.softmax(k_all[p, h // 3].double() @ q[h].double() * SCALE, 0)
        out[h] = w @ v_all[p, h // 3].double()
    return out


class Harness:
    """One request offloaded to the host tier, decoded step by step through the backend."""

    def __init__(self, prefetch: PrefetchParams | None = None, q_heads: int | None = HQ, **overrides):
        p = params(page_size=16, n_keep=0, host_tier_bytes=2000 * PER_TOKEN, **overrides)
        self.rt, self.pool, self.alloc, self.r2t, self.req, self.tree, ok, ov = setup(p, PROMPT, 0)
        row = self.r2t[2, :PROMPT].long().clone()
        self.k_all = [ok[i][row].clone() for i in range(LAYERS)]  # position -> K, every layer
        self.v_all = [ov[i][row].clone() for i in range(LAYERS)]
        self.rt.after_extend(SimpleNamespace(reqs=[self.req]), self.tree)
        self.st = self.rt.requests["r1"]
        self.events = Events()
        self.backend = DualDecoderAttnBackend(
            DenseFake(), KVPool(self.pool), self.r2t, p, self.rt,
            prefetch or PrefetchParams(hit_rate_sample=0.0), self.events, q_heads=q_heads,
        )  # fmt: skip
        self.gen = torch.Generator().manual_seed(11)

    def step(self, tok: int | None = None, dense_row: tuple[int, int] | None = None):
        """Decode one token: returns (fb, q per layer [tokens, HQ, D], outputs per layer). ``dense_row``:
        ``(req_pool_idx, seq_len)`` of a second, dense request (not in the runtime) decoding beside it,
        batch row 1, its new K/V written to a slot of its own."""
        pos = self.req.kv.kv_committed_len
        slot = self.alloc.alloc(1)
        self.r2t[2, pos] = slot.int()
        if tok is None:
            tok = 5 + pos % 4  # the prompt repeats 5 6 7 8: prompt lookup proposes the next
        rows = [(2, pos + 1, tok)] + ([(dense_row[0], dense_row[1], 3)] if dense_row else [])
        fb = SimpleNamespace(
            forward_mode=_decode_mode(), batch_size=len(rows), input_ids=torch.tensor([t for _, _, t in rows]),
            positions=torch.tensor([n - 1 for _, n, _ in rows]), seq_lens=torch.tensor([n for _, n, _ in rows]),
            req_pool_indices=torch.tensor([r for r, _, _ in rows]),
            out_cache_loc=torch.cat([slot] + ([self.alloc.alloc(1)] if dense_row else [])),
            seq_lens_cpu=torch.tensor([n for _, n, _ in rows]), encoder_lens=None,
        )  # fmt: skip
        self.backend.init_forward_metadata(fb)
        n_tok = fb.input_ids.numel()
        qs, outs = [], []
        for i in range(LAYERS):
            # Views of one fused projection, strided as SGLang's ``qkv.split`` gives them.
            qkv = torch.randn(n_tok, (HQ + 2 * HKV) * D, generator=self.gen)
            q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
            self.k_all[i] = torch.cat([self.k_all[i], k[:1].view(1, HKV, D)])
            self.v_all[i] = torch.cat([self.v_all[i], v[:1].view(1, HKV, D)])
            out = self.backend.forward_decode(q, k, v, _layer(i), fb)
            qs.append((q.view(n_tok, HQ, D), k.view(n_tok, HKV, D), v.view(n_tok, HKV, D)))
            outs.append(out.view(n_tok, HQ, D))
        logits = SimpleNamespace(next_token_logits=torch.randn(n_tok, 50, generator=self.gen), hidden_states=None)
        finish_step(logits, fb)
        assert logits.next_token_logits.shape[0] == fb.batch_size  # speculated rows cut before sampling
        self.req.kv.kv_committed_len += 1
        self.req.output_ids.append(tok)
        self.rt.after_decode(SimpleNamespace(reqs=[self.req]), self.tree)
        return fb, qs, outs


def _sglang_dense_decode(q, k_ctx, v_ctx):
    """SGLang's own ``torch_native`` decode of one request over its context (``[n, HKV, D]``, position
    order), through ``TorchNativeAttnBackend._run_sdpa_forward_decode``: ``[HQ, D]``."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    n = k_ctx.shape[0]
    out = torch.empty(1, HQ, D, dtype=q.dtype)
    TorchNativeAttnBackend._run_sdpa_forward_decode(
        None, q.unsqueeze(0), out, k_ctx, v_ctx, torch.arange(n).view(1, n), torch.tensor([0]),
        torch.tensor([n]), scaling=SCALE, enable_gqa=True,
    )  # fmt: skip
    return out[0]


@pytest.mark.parametrize("selector", ["spec_host", "oracle"])
def test_top_k_covering_the_context_is_sglang_dense_decode_bit_for_bit_and_no_token_rides(selector):
    """A row whose critical set is its whole context needs no prediction: no token rides (the batch has
    dense's shape), and every layer's output equals SGLang's own dense decode of the same context to
    the bit, although the context comes from the host tier and the resident set."""
    h = Harness(top_k=1000, selector=selector)
    h.req.origin_input_ids = [5, 6, 7, 8] * (PROMPT // 4)  # prompt lookup would propose a token
    for _ in range(3):
        fb, qs, outs = h.step()
        assert fb.input_ids.numel() == 1
        n = h.req.kv.kv_committed_len  # positions 0..n-1 have K/V now
        for i in range(LAYERS):
            q = qs[i][0][0]
            assert torch.equal(outs[i][0], _sglang_dense_decode(q, h.k_all[i][:n], h.v_all[i][:n]))
    assert h.events.steps == ["sparse"] * 3 and h.events.rows == h.events.exact == 3 * LAYERS
    assert h.events.cold_n == 0  # every candidate fits: no selection at all
    assert h.backend.runner.store.get("r1").spec.proposed == 0


def _kernel_params(kernel: str, **kw) -> PrefetchParams:
    """Prefetch params for ``experimental.kernel`` = ``kernel`` (``native``: skipped where it cannot be built)."""
    if kernel == "native" and not native_kernel.available():
        pytest.skip(f"no CPU selection kernel here: {native_kernel.unavailable_reason()}")
    return PrefetchParams(hit_rate_sample=0.0, kernel=kernel, **kw)


@pytest.mark.parametrize("kernel", ["torch", "native"])
def test_the_speculated_position_reads_the_rows_set_and_its_own_kv(kernel):
    """Below full coverage a token rides; its query reads the row's resident and critical set (the
    verified one: the real query's exact top-k, rerank 100) plus its own K/V column. ``native``: the
    per-layer moves are the C row copies and single indexed copies (``prefetch/layer_rows.py``)."""
    h = Harness(_kernel_params(kernel, rerank=100), top_k=24, selector="spec_host_exact")
    h.req.origin_input_ids = [5, 6, 7, 8] * (PROMPT // 4)
    h.step()
    resident = set(h.st.device_positions(h.req.kv.kv_committed_len + 1).tolist())
    cand = h.st.host_candidates()
    fb, qs, outs = h.step()
    assert fb.input_ids.numel() == 2
    assert h.backend.runner.profile.attender == ("fused_c" if kernel == "native" else "torch")
    n = h.req.kv.kv_committed_len
    for i in range(LAYERS):
        q, k, v = qs[i]
        sets = [s | resident for s in _topk_sets(q[0], h.k_all[i], cand, 24)]
        ks, vs = torch.cat([h.k_all[i][:n], k[1:2]]), torch.cat([h.v_all[i][:n], v[1:2]])
        own = [s | {n} for s in sets]
        torch.testing.assert_close(outs[i][1].double(), _attend_sets(q[1], ks, vs, own), atol=1e-4, rtol=1e-4)


def _topk_sets(q, k_all, cand, k):
    s = gqa_token_scores(q, k_all[cand], SCALE)
    return [set(cand[s[kv].topk(k).indices].tolist()) for kv in range(HKV)]


def test_oracle_reads_the_resident_set_and_the_exact_top_k_of_the_current_query():
    h = Harness(top_k=24, selector="oracle")
    for _ in range(2):
        assert h.events.exact == 0
        cand = h.st.host_candidates()
        resident = h.st.device_positions(h.req.kv.kv_committed_len + 1).tolist()
        fb, qs, outs = h.step()
        assert fb.input_ids.numel() == 1  # oracle reads no speculated position
        for i in range(LAYERS):
            q = qs[i][0][0]
            top = _topk_sets(q, h.k_all[i], cand, 24)
            sets = [top[kv] | set(resident) for kv in range(HKV)]
            torch.testing.assert_close(outs[i][0].double(), _attend_sets(q, h.k_all[i], h.v_all[i], sets),
                                       atol=1e-4, rtol=1e-4)  # fmt: skip


@pytest.mark.parametrize("kernel,transfer", [("torch", "auto"), ("native", "inline"), ("native", "in_place")])
def test_host_sync_reads_the_host_index_selection_of_the_current_query(kernel, transfer):
    """``host_sync``: no token rides; each layer's set is ``spec_host``'s scoring (int8 host index,
    exact re-ranking of the best 2 x k) of the *current* query, chosen at attention time, and the
    output is attention over it and the resident set. The set is close to the exact top-k."""
    from dd_sglang.prefetch.selectors import SpecHostSelector

    h = Harness(_kernel_params(kernel, transfer=transfer), top_k=24, selector="host_sync")
    h.req.origin_input_ids = [5, 6, 7, 8] * (PROMPT // 4)  # prompt lookup would propose a token
    plans = []
    for _ in range(2):
        cand = h.st.host_candidates()
        resident = set(h.st.device_positions(h.req.kv.kv_committed_len + 1).tolist())
        runner = h.backend._runner_for(h.rt)
        real_plan = runner.plan
        runner.plan = lambda fb, rt, real_plan=real_plan: plans.append(real_plan(fb, rt)) or plans[-1]
        fb, qs, outs = h.step()
        runner.plan = real_plan
        plan = plans[-1]
        assert fb.input_ids.numel() == 1 and not plan.selection.ahead and len(plan.selection.sync) == 1
        assert plan.checks.verify_rows.numel() == 0 and h.events.cold_n == 0
        g = plan.selection.sync[0]
        ref = SpecHostSelector(2.0, native=kernel == "native")
        overlap = []
        for i in range(LAYERS):
            q = qs[i][0][0]
            pos, _ = ref.select(q[None].float(), g.blocks, runner.host.k[i], 24, SCALE, runner.key_index("host"), i)
            chosen = [set(pos[0, kv].tolist()) for kv in range(HKV)]
            sets = [c | resident for c in chosen]
            torch.testing.assert_close(outs[i][0].double(), _attend_sets(q, h.k_all[i], h.v_all[i], sets),
                                       atol=1e-4, rtol=1e-4)  # fmt: skip
            top = _topk_sets(q, h.k_all[i], cand, 24)
            overlap += [len(c & t) / 24 for c, t in zip(chosen, top, strict=True)]
        assert sum(overlap) / len(overlap) >= 0.9, overlap
    assert isinstance(h.backend.runner.step_source, InPlaceReads) == (transfer == "in_place")


@pytest.mark.parametrize("kernel,transfer", [("torch", "auto"), ("native", "inline"), ("native", "in_place")])
@pytest.mark.parametrize("select,chunk", [("inline", 10), ("inline", 1), ("worker", 10)])
def test_spec_host_exact_reads_the_set_its_speculated_query_chose_one_step_earlier(select, chunk, kernel, transfer,
                                                                                   monkeypatch):  # fmt: skip
    """Inline, the next step's sets are chosen in chunks of layers (all at once, one at a time); on
    the worker, per layer: every way gives each layer the set its own speculated query chose, copied
    into the ring (``inline``) or read in place from the host tier (``in_place``, the C path). What
    verification counts shows it: the verified hits are the real query's top-k tokens that set held,
    and each layer attends the real query's top-k (rerank 100: exact)."""
    from dd_sglang.prefetch import ahead_selection

    monkeypatch.setattr(ahead_selection, "SELECT_CHUNK_LAYERS", chunk)
    h = Harness(_kernel_params(kernel, select=select, transfer=transfer, rerank=100), top_k=24,
                selector="spec_host_exact")  # fmt: skip
    h.req.origin_input_ids = [5, 6, 7, 8] * (PROMPT // 4)
    cand_prev = h.st.host_candidates()  # the candidates when the next step's sets are chosen
    fb, qs_prev, _ = h.step()  # cold: selects from the current query, queues next step's sets
    assert h.events.cold_n == LAYERS
    resident = h.st.device_positions(h.req.kv.kv_committed_len + 1).tolist()
    cand = h.st.host_candidates()
    fb, qs, outs = h.step()
    assert h.events.cold_n == LAYERS  # not cold any more
    missed = _assert_verified(h, qs_prev, cand_prev, qs, outs, cand, resident)
    assert h.events.hits_lookups == [LAYERS * HKV * 24 - missed, LAYERS * HKV * 24]
    assert (h.backend.runner.profile.source == "in_place") == (transfer == "in_place")
    assert isinstance(h.backend.runner.step_source, InPlaceReads) == (transfer == "in_place")
    # Bytes brought from the host tier (copied into the ring, or read in place): 24 tokens x 3 KV
    # heads x D x 4 B, K and V, per layer.
    assert h.events.copied_bytes >= LAYERS * 2 * 24 * HKV * D * 4


@pytest.mark.parametrize("transfer,rows,reads", [("auto", 1, False), ("auto", 2, True), ("in_place", 1, True),
                                                  ("inline", 2, False)])  # fmt: skip
def test_auto_transfer_reads_in_place_from_six_row_kv_head_pairs(transfer, rows, reads):
    """``transfer: auto`` on a CPU reads in place only a step of at least 6 (row, KV head) pairs (the
    fused attention's threaded size): 2 rows of 3 KV heads, not 1; ``in_place`` always."""
    h = Harness(_kernel_params("native", transfer=transfer), top_k=24, selector="spec_host_exact")
    h.step()  # builds the runner
    runner = h.backend.runner
    assert HKV * 2 >= native_kernel.ATTEND_PARALLEL_TASKS > HKV
    assert (runner.profile.source == "in_place" and runner.source.reads(SimpleNamespace(num_rows=rows))) is reads


def test_a_model_the_fused_attention_does_not_take_runs_the_gathered_attention_on_ring_copies():
    """Query heads unknown (so the GQA group is): the CPU profile falls back to the PyTorch attention over
    sets copied into the ring, chosen once for the runner, and each layer still attends the verified set."""
    h = Harness(_kernel_params("native", transfer="in_place", rerank=100), q_heads=None, top_k=24,
                selector="spec_host_exact")  # fmt: skip
    h.req.origin_input_ids = [5, 6, 7, 8] * (PROMPT // 4)
    cand_prev = h.st.host_candidates()
    _, qs_prev, _ = h.step()
    profile = h.backend.runner.profile
    assert (profile.name, profile.source, profile.attender) == ("cpu+attender=torch", "copy_inline", "torch")
    resident = h.st.device_positions(h.req.kv.kv_committed_len + 1).tolist()
    cand = h.st.host_candidates()
    copied = h.events.copied_bytes
    _, qs, outs = h.step(tok=99)  # rejected
    assert isinstance(h.backend.runner.step_source, RingCopies)
    assert h.events.copied_bytes - copied >= LAYERS * 2 * 24 * HKV * D * 4
    _assert_verified(h, qs_prev, cand_prev, qs, outs, cand, resident)


@pytest.mark.parametrize("kernel,transfer", [("torch", "auto"), ("native", "inline"), ("native", "in_place")])
@pytest.mark.parametrize("accepted", [True, False])
def test_verify_attends_the_real_querys_top_k_whatever_was_prefetched(kernel, transfer, accepted):
    """Verification (every ahead row): after a rejected speculation and after an accepted one
    alike, each layer's real query attends the resident set and its own exact top-k (host_sync's set:
    with rerank 100 every candidate is re-ranked exactly), not the set its previous speculated query
    chose; the tokens fetched synchronously are exactly the real top-k's tokens that set missed (copied
    into the ring, or read in place), and the verified hits are the rest."""
    if kernel == "native" and not native_kernel.available():
        pytest.skip(f"no CPU selection kernel here: {native_kernel.unavailable_reason()}")
    h = Harness(PrefetchParams(hit_rate_sample=0.0, rerank=100, kernel=kernel, transfer=transfer), top_k=24,
                selector="spec_host_exact")  # fmt: skip
    h.req.origin_input_ids = [5, 6, 7, 8] * (PROMPT // 4)
    cand_prev = h.st.host_candidates()
    _, qs_prev, _ = h.step()
    resident = h.st.device_positions(h.req.kv.kv_committed_len + 1).tolist()
    cand = h.st.host_candidates()
    riding = h.backend.runner.store.get("r1").spec.riding[0]
    _, qs, outs = h.step(tok=riding if accepted else 99)  # after 99 no token rides; the set was fixed ahead
    missed = _assert_verified(h, qs_prev, cand_prev, qs, outs, cand, resident)
    assert missed > 0  # the speculated query's sets differ from the real one's: something was fetched
    assert h.events.repaired == missed
    assert h.events.hits_lookups == [LAYERS * HKV * 24 - missed, LAYERS * HKV * 24]


def _assert_verified(h, qs_prev, cand_prev, qs, outs, cand, resident, k=24) -> int:
    """Each layer's real query attended to the resident set and its own exact top-``k`` among ``cand``;
    returns how many of those (layer, KV head, token)s its previous speculated query's sets (the
    prefetched ones, chosen among ``cand_prev``) did not hold."""
    missed = 0
    for i in range(LAYERS):
        chosen = _topk_sets(qs_prev[i][0][1], h.k_all[i], cand_prev, k)
        q = qs[i][0][0]
        top = _topk_sets(q, h.k_all[i], cand, k)
        missed += sum(len(t - c) for t, c in zip(top, chosen, strict=True))
        sets = [t | set(resident) for t in top]
        torch.testing.assert_close(outs[i][0].double(), _attend_sets(q, h.k_all[i], h.v_all[i], sets),
                                   atol=1e-4, rtol=1e-4)  # fmt: skip
    return missed


@pytest.mark.parametrize("kernel", ["torch", "native"])
def test_split_selection_gives_the_inline_outputs_with_one_forward_thread_in_sparse_steps(kernel):
    """experimental.select split: the next step's sets come from the select worker (its own core) and
    every layer's output equals the inline selection's to the bit; during a sparse step the forward
    thread runs its own operations on one intra-op thread, and a step with no plan (a prefill)
    gets its thread count back."""
    threads = torch.get_num_threads()
    outs = {}
    try:
        for select in ("inline", "split"):
            h = Harness(_kernel_params(kernel, select=select), top_k=24, selector="spec_host")
            h.req.origin_input_ids = [5, 6, 7, 8] * (PROMPT // 4)
            outs[select] = [h.step()[2] for _ in range(4)]
            assert torch.get_num_threads() == (1 if select == "split" else threads)
            prefill = SimpleNamespace(forward_mode=SimpleNamespace(is_decode=lambda: False, is_extend=lambda: True))
            h.backend.init_forward_metadata(prefill)
            assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(threads)
    assert h.events.steps == ["sparse"] * 4
    for step_inline, step_split in zip(outs["inline"], outs["split"], strict=True):
        for a, b in zip(step_inline, step_split, strict=True):
            assert torch.equal(a, b)


def test_auto_selection_splits_a_step_from_split_min_rows(monkeypatch):
    """experimental.select auto on a CPU: a step with fewer than SPLIT_MIN_ROWS rows selecting ahead
    selects inline on the forward thread's threads; from that many rows (1 here) it splits."""
    from dd_sglang.prefetch import runner as runner_mod

    threads = torch.get_num_threads()
    if threads < 2:
        pytest.skip("one intra-op thread: no step splits")
    assert runner_mod.SPLIT_MIN_ROWS > 1
    try:
        for min_rows, split in ((runner_mod.SPLIT_MIN_ROWS, False), (1, True)):
            monkeypatch.setattr(runner_mod, "SPLIT_MIN_ROWS", min_rows)
            h = Harness(_kernel_params("native"), top_k=24, selector="spec_host")  # select: auto
            h.req.origin_input_ids = [5, 6, 7, 8] * (PROMPT // 4)
            for _ in range(3):
                h.step()
                assert h.backend.runner.schedule.select_inline is not split
                assert torch.get_num_threads() == (1 if split else threads)
    finally:
        torch.set_num_threads(threads)


def test_finish_step_cuts_speculated_rows_and_records_their_argmax():
    h = Harness(top_k=24, selector="spec_host")
    h.req.origin_input_ids = [5, 6, 7, 8] * (PROMPT // 4)
    fb = SimpleNamespace(
        forward_mode=_decode_mode(), batch_size=1, input_ids=torch.tensor([5]), positions=torch.tensor([PROMPT]),
        seq_lens=torch.tensor([PROMPT + 1]), req_pool_indices=torch.tensor([2]), out_cache_loc=torch.tensor([1]),
    )  # fmt: skip
    h.backend.init_forward_metadata(fb)
    plan = fb.dd_step.plan
    assert len(plan.spec.states) == 1 and isinstance(plan.spec.states[0][0], SpecState)
    logits = torch.randn(2, 11)
    hidden = torch.randn(2, 7)
    out = SimpleNamespace(next_token_logits=logits, hidden_states=hidden)
    h.backend.runner.end_step()
    finish_step(out, fb)
    assert torch.equal(out.next_token_logits, logits[:1]) and torch.equal(out.hidden_states, hidden[:1])
    top = torch.softmax(logits[1], -1).topk(2)
    state, i = plan.spec.states[0]
    assert state.top[i][0] == int(top.indices[0]) and state.top[i][2] == int(top.indices[1])
    assert abs(state.top[i][1] - float(top.values[0])) < 1e-6
    assert fb.dd_step is None
    finish_step(out, fb)  # a second logits call of the same batch is left alone
    assert out.next_token_logits.shape[0] == 1



def test_the_radix_cache_factory_hands_the_runtime_to_every_dualdecoder_backend():
    """``dualdecoder_backends`` finds the backends SGLang's model runner holds (directly or inside a
    hybrid / two-batch-overlap wrapper), so the factory can hand the runtime over once."""
    from dd_sglang.attention.backend import dualdecoder_backends

    a, b = Harness(), Harness()
    prefill_only = SimpleNamespace(prefill_backend=DenseFake(), decode_backend=b.backend)
    runner = SimpleNamespace(attn_backend=a.backend, decode_attn_backend=prefill_only)
    assert dualdecoder_backends(runner) == [a.backend, b.backend]
    tbo = SimpleNamespace(primary=a.backend, children=[a.backend, b.backend])
    assert dualdecoder_backends(SimpleNamespace(attn_backend=tbo)) == [a.backend, b.backend]
    assert dualdecoder_backends(None) == [] and dualdecoder_backends(SimpleNamespace(attn_backend=DenseFake())) == []
    a.backend.attach_runtime(b.rt)
    assert a.backend.runtime is b.rt
