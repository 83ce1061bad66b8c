"""An extend after a cached prefix: the same output bits as SGLang's ``torch_native`` extend, fewer query rows.

SGLang's own ``TorchNativeAttnBackend`` (its ``_run_sdpa_forward_extend`` and its whole
``forward_extend`` over a fake KV pool) is the reference, compared with ``torch.equal``; an
independent float64 softmax checks what the rows mean.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from dd_sglang.attention.backend import BackendEvents, DualDecoderAttnBackend
from dd_sglang.attention.extend import skips_prefix_queries
from dd_sglang.kernels.extend import aligned_query_start, prefix_extend_attention

HQ, HKV, D = 9, 3, 64  # SmolLM2's head layout
SCALE = D**-0.5
#: (cached prefix, new tokens) per request: one-token extends (a repeated prompt's last token) whose
#: row SGLang computes in a 1-4 row trailing block, a multi-turn follow-up, prefixes too short to skip.
CASES = [(3993, 1), (3840, 1), (3841, 1), (3842, 2), (3000, 700), (256, 600), (1024, 5), (5000, 3), (511, 1),
         (200, 100)]  # fmt: skip


def test_aligned_query_start_by_hand():
    assert aligned_query_start(3993, 3994) == 3072  # 922 rows: 3072 = 12 x 256, the last start with >= 768
    assert aligned_query_start(1000, 2000) == 768  # 1000 // 256 x 256; 1232 rows left
    assert aligned_query_start(1900, 2000) == 1024  # 976 rows (1280 would leave 720 < 768)
    assert aligned_query_start(0, 5000) == 0  # a fresh prefill
    assert aligned_query_start(600, 700) == 0  # shorter than 768: SGLang's whole-sequence call
    assert aligned_query_start(255, 1100) == 0
    with pytest.raises(ValueError, match=r"prefix_len must be in \[0, seq_len=10\), got 10"):
        aligned_query_start(10, 10)
    with pytest.raises(ValueError, match="prefix_len must be"):
        aligned_query_start(-1, 10)


def _pool(total, dtype, g):
    k = (torch.randn(total, HKV, D, generator=g) * 2).to(dtype)
    v = torch.randn(total, HKV, D, generator=g).to(dtype)
    return k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefix_extend_is_sglangs_torch_native_extend_bit_for_bit(dtype):
    """The whole batch through SGLang's ``_run_sdpa_forward_extend`` (every request's sequence
    scattered over a shuffled pool) against each request through ``prefix_extend_attention``."""
    g = torch.Generator().manual_seed(7)
    seqs = [p + e for p, e in CASES]
    total = sum(seqs) + 64
    k_pool, v_pool = _pool(total, dtype, g)
    slots = torch.randperm(total, generator=g)
    r2t = torch.zeros(len(CASES) + 1, max(seqs) + 8, dtype=torch.int64)
    at = 0
    for i, s in enumerate(seqs):
        r2t[i + 1, :s] = slots[at : at + s]
        at += s
    n_new = sum(e for _, e in CASES)
    q = torch.randn(n_new, HQ, D, generator=g).to(dtype)
    want = torch.empty_like(q)
    TorchNativeAttnBackend._run_sdpa_forward_extend(
        None, q, want, k_pool, v_pool, r2t, torch.arange(1, len(CASES) + 1), torch.tensor(seqs),
        torch.tensor([p for p, _ in CASES]), torch.tensor([e for _, e in CASES]),
        scaling=SCALE, enable_gqa=True, causal=True,
    )  # fmt: skip
    start = 0
    for i, (p, e) in enumerate(CASES):
        tokens = r2t[i + 1, : p + e]
        got = prefix_extend_attention(q[start : start + e], k_pool[tokens], v_pool[tokens], p, SCALE)
        assert got.dtype == dtype and got.shape == (e, HQ, D)
        assert torch.equal(got, want[start : start + e]), (p, e)
        start += e


def test_prefix_extend_rows_are_causal_softmax_over_their_prefix():
    """Row i of the new tokens attends to positions [0, p + i] (float64 reference, per head)."""
    g = torch.Generator().manual_seed(3)
    p, e = 1500, 40
    keys = torch.randn(p + e, HKV, D, generator=g)
    values = torch.randn(p + e, HKV, D, generator=g)
    q = torch.randn(e, HQ, D, generator=g)
    got = prefix_extend_attention(q, keys, values, p, SCALE)
    for i in (0, 17, e - 1):
        for h in (0, 4, 8):
            kv = h // (HQ // HKV)
            w = torch.softmax(keys[: p + i + 1, kv].double() @ q[i, h].double() * SCALE, dim=0)
            ref = w @ values[: p + i + 1, kv].double()
            assert torch.allclose(got[i, h].double(), ref, atol=1e-5), (i, h)


def test_prefix_extend_refuses_shapes_that_do_not_match():
    k = torch.zeros(10, HKV, D)
    with pytest.raises(ValueError, match="must be"):
        prefix_extend_attention(torch.zeros(HQ, D), k, k, 9, 1.0)
    with pytest.raises(ValueError, match="do not match"):
        prefix_extend_attention(torch.zeros(1, HQ + 1, D), k, k, 9, 1.0)
    with pytest.raises(ValueError, match="prefix_len 8 \\+ 1 new tokens must equal the 10 keys"):
        prefix_extend_attention(torch.zeros(1, HQ, D), k, k, 8, 1.0)


class KVPool:
    """SGLang's ``token_to_kv_pool`` surface both backends use."""

    def __init__(self, k, v):
        self.k, self.v, self.start_layer = [k], [v], 0

    def get_key_buffer(self, layer_id):
        return self.k[layer_id]

    def get_value_buffer(self, layer_id):
        return self.v[layer_id]

    def set_kv_buffer(self, layer, loc, k, v):
        self.k[layer.layer_id][loc.loc] = k.view(-1, HKV, D)
        self.v[layer.layer_id][loc.loc] = v.view(-1, HKV, D)


class Events(BackendEvents):
    def __init__(self):
        self.skipped = 0

    def extend_rows_skipped(self, n: int) -> None:
        self.skipped += n


def _layer(**over):
    return SimpleNamespace(**{"layer_id": 0, "tp_q_head_num": HQ, "tp_k_head_num": HKV, "qk_head_dim": D,
                              "v_head_dim": D, "scaling": SCALE, "is_cross_attention": False,
                              "attn_type": AttentionType.DECODER, "sliding_window_size": -1, **over})  # fmt: skip


def _batch(cases, r2t, out_loc, mode=ForwardMode.EXTEND):
    return SimpleNamespace(
        forward_mode=mode, req_pool_indices=torch.arange(1, len(cases) + 1),
        seq_lens=torch.tensor([p + e for p, e in cases]), out_cache_loc=out_loc,
        extend_prefix_lens=torch.tensor([p for p, _ in cases]), extend_seq_lens=torch.tensor([e for _, e in cases]),
        extend_prefix_lens_cpu=[p for p, _ in cases], extend_seq_lens_cpu=[e for _, e in cases], encoder_lens=None,
    )  # fmt: skip


def _backends(pool_k, pool_v, r2t):
    """SGLang's torch_native backend and a dualdecoder backend delegating to another one, each over its
    own copy of the pool."""
    ref_pool = KVPool(pool_k.clone(), pool_v.clone())
    runner = SimpleNamespace(device="cpu", req_to_token_pool=SimpleNamespace(req_to_token=r2t), token_to_kv_pool=ref_pool)
    ref = TorchNativeAttnBackend(runner)
    ours_pool = KVPool(pool_k.clone(), pool_v.clone())
    dense = TorchNativeAttnBackend(SimpleNamespace(device="cpu", req_to_token_pool=runner.req_to_token_pool,
                                                   token_to_kv_pool=ours_pool))  # fmt: skip
    events = Events()
    ours = DualDecoderAttnBackend(dense, ours_pool, r2t, None, None, events=events)
    return ref, ref_pool, ours, ours_pool, events


def _extend_case(cases, seed: int):
    """A bfloat16 pool and an extend batch of ``cases`` (``(prefix, new)`` per request, rows 1..n) at
    random slots (never SGLang's padding slot 0): ``(pool_k, pool_v, req_to_token, batch, new slots per
    request, q, k, v)``."""
    g = torch.Generator().manual_seed(seed)
    seqs = [p + e for p, e in cases]
    total = sum(seqs) + 32
    pool_k, pool_v = _pool(total, torch.bfloat16, g)
    slots = torch.randperm(total - 1, generator=g) + 1
    r2t = torch.zeros(len(cases) + 1, max(seqs) + 4, dtype=torch.int32)
    new_loc, at = [], 0
    for i, (p, e) in enumerate(cases):
        r2t[i + 1, : p + e] = slots[at : at + p + e].int()
        new_loc.append(slots[at + p : at + p + e])
        at += p + e
    n_new = sum(e for _, e in cases)
    q = torch.randn(n_new, HQ * D, generator=g).bfloat16()
    k = torch.randn(n_new, HKV * D, generator=g).bfloat16()
    v = torch.randn(n_new, HKV * D, generator=g).bfloat16()
    return pool_k, pool_v, r2t, _batch(cases, r2t, torch.cat(new_loc)), new_loc, q, k, v


@pytest.mark.parametrize("cases", [[(3993, 1), (1024, 5), (0, 300), (3000, 700)], [(0, 900), (200, 100)]])
def test_the_backends_extend_is_torch_natives_with_fewer_query_rows(cases):
    """A mixed extend batch through ``DualDecoderAttnBackend.forward`` and through SGLang's own
    ``TorchNativeAttnBackend.forward``: the same output and KV-pool writes, bit for bit (bfloat16); the
    skipped query rows are counted. A batch with nothing to skip goes to the delegate untouched."""
    pool_k, pool_v, r2t, fb, new_loc, q, k, v = _extend_case(cases, 11)
    ref, ref_pool, ours, ours_pool, events = _backends(pool_k, pool_v, r2t)
    layer = _layer()
    want = ref.forward(q, k, v, layer, fb)
    got = ours.forward(q, k, v, layer, fb)
    assert torch.equal(got, want)
    assert torch.equal(ours_pool.k[0], ref_pool.k[0]) and torch.equal(ours_pool.v[0], ref_pool.v[0])
    assert events.skipped == sum(aligned_query_start(p, p + e) for p, e in cases)
    assert (events.skipped > 0) == skips_prefix_queries(layer, fb)


def test_only_plain_causal_extends_are_taken_from_the_delegate():
    fb = _batch([(3993, 1)], None, None)
    assert skips_prefix_queries(_layer(), fb)
    assert not skips_prefix_queries(_layer(sliding_window_size=4096), fb)
    assert not skips_prefix_queries(_layer(is_cross_attention=True), fb)
    assert not skips_prefix_queries(_layer(attn_type=AttentionType.ENCODER_ONLY), fb)
    assert not skips_prefix_queries(_layer(), _batch([(3993, 1)], None, None, ForwardMode.MIXED))
    assert not skips_prefix_queries(_layer(), _batch([(0, 3994), (600, 10)], None, None))


def test_a_chunk_after_a_prefix_in_the_host_tier_attends_it_exactly():
    """A later chunk of a prompt prefilled through the host tier: positions ``[4, p)`` have no device
    slot (its row points at padding slot 0) and their K/V are read from the host tier. The output and
    pool writes equal SGLang's torch_native extend over the whole prefix on the device, bit for bit;
    another request of the batch (device prefix) is unaffected."""
    from dd_sglang.kvcache.dualpath import PathState

    cases = [(3000, 700), (1024, 5)]
    pool_k, pool_v, r2t, fb, new_loc, q, k, v = _extend_case(cases, 5)
    ref, ref_pool, ours, ours_pool, _ = _backends(pool_k, pool_v, r2t)
    ours.req_to_token = r2t.clone()  # its own row table: the reference keeps the whole prefix on the device
    # Request 1's positions [4, 3000) move to a host tier (its own order: reversed slots) and leave the device.
    p = cases[0][0]
    dev_slots = r2t[1, 4:p].long()
    host_slots = torch.arange(p - 4 - 1, -1, -1) + 4
    hk = torch.zeros(p, HKV, D, dtype=torch.bfloat16)
    hv = torch.zeros(p, HKV, D, dtype=torch.bfloat16)
    hk[host_slots], hv[host_slots] = pool_k[dev_slots], pool_v[dev_slots]
    ours.req_to_token[1, 4:p] = 0
    ours_pool.k[0][dev_slots] = 0  # the freed slots now hold other data
    all_host = torch.cat([torch.zeros(4, dtype=torch.int64), host_slots])
    st = SimpleNamespace(released=True, path=SimpleNamespace(state=PathState.PREFILL_FULL), host_len=p,
                         keep_pos=torch.arange(4), host_slots=all_host)  # fmt: skip
    ours.runtime = SimpleNamespace(by_pool={1: st}, host=SimpleNamespace(gather=lambda layer, s: (hk[s], hv[s])))
    layer = _layer()
    want = ref.forward(q, k, v, layer, fb)
    got = ours.forward(q, k, v, layer, fb)
    assert torch.equal(got, want)
    written = torch.cat(new_loc)
    assert torch.equal(ours_pool.k[0][written], ref_pool.k[0][written])
