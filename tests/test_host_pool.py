"""HostSparseKVPool: byte accounting, page-granular allocation, gathers, device round trips."""

from __future__ import annotations

import pytest
import torch

from dd_sglang.kvcache.host_pool import HostSparseKVPool

L, H, D = 30, 3, 64  # SmolLM2-135M
PER_TOKEN = L * 2 * H * D * 2  # bf16: 23,040 bytes


def _pool(tokens=64, page=16):
    return HostSparseKVPool(
        num_layers=L, num_kv_heads=H, head_dim=D, dtype=torch.bfloat16,
        capacity_bytes=(tokens + page) * PER_TOKEN, page_size=page,
    )  # fmt: skip


def test_byte_accounting_to_the_byte():
    p = _pool(64, 16)
    assert p.get_size_per_token() == PER_TOKEN == 23040
    assert p.usable_tokens == 64 and p.available_size() == 64
    assert p.capacity_bytes == (64 + 16) * PER_TOKEN  # K+V of 80 slots, padding page included
    assert p.used_bytes == 0
    a = p.alloc_tokens(20)  # rounds up to 2 pages
    assert len(a) == 32 and p.used_bytes == 32 * PER_TOKEN
    p.free(a)
    assert p.used_bytes == 0 and p.available_size() == 64


def test_capacity_rounds_down_to_whole_pages():
    p = HostSparseKVPool(num_layers=L, num_kv_heads=H, head_dim=D, dtype=torch.bfloat16,
                         capacity_bytes=(64 + 16) * PER_TOKEN + PER_TOKEN * 15, page_size=16)  # fmt: skip
    assert p.usable_tokens == 64


def test_alloc_returns_a_copy_not_a_view_of_the_free_list():
    p = _pool()
    a = p.alloc(16)
    before = p.free_slots.clone()
    a.fill_(-1)
    assert torch.equal(p.free_slots, before)
    assert a.data_ptr() != p.free_slots.data_ptr()


def test_exhaustion_returns_none_and_loses_nothing():
    p = _pool(32, 16)
    a, b = p.alloc_tokens(16), p.alloc_tokens(16)
    assert p.alloc_tokens(1) is None
    assert p.available_size() == 0
    p.free(torch.cat([a, b]))
    assert p.available_size() == 32
    assert set(torch.cat([p.alloc_tokens(32)]).tolist()) == set(torch.cat([a, b]).tolist())


def test_padding_page_is_never_handed_out():
    p = _pool(32, 16)
    for _ in range(2):  # also after SGLang's clear()
        got = torch.cat([p.alloc_tokens(16), p.alloc_tokens(16)])
        assert int(got.max()) < 32 and p.alloc_tokens(1) is None
        p.clear()


def test_gather_of_any_subset_returns_what_was_written():
    p = _pool()
    slots = p.alloc_tokens(48)
    g = torch.Generator().manual_seed(0)
    ks = [torch.randn(48, H, D, generator=g).bfloat16() for _ in range(L)]
    vs = [torch.randn(48, H, D, generator=g).bfloat16() for _ in range(L)]
    for layer in range(L):
        p.write(layer, slots, ks[layer], vs[layer])
    pick = torch.tensor([47, 3, 3, 20, 0])
    for layer in (0, 17, L - 1):
        k, v = p.gather(layer, slots[pick])
        assert torch.equal(k, ks[layer][pick]) and torch.equal(v, vs[layer][pick])


def test_device_pool_round_trip():
    """Offload from an SGLang-shaped device pool and load back one layer at a time."""

    class DevicePool:  # the attributes SGLang's MHATokenToKVPool exposes: per-layer [slots, H, D]
        def __init__(self, slots):
            g = torch.Generator().manual_seed(1)
            self.k_buffer = [torch.randn(slots, H, D, generator=g).bfloat16() for _ in range(L)]
            self.v_buffer = [torch.randn(slots, H, D, generator=g).bfloat16() for _ in range(L)]

    src, dst = DevicePool(100), DevicePool(100)
    p = _pool()
    dev_idx = torch.tensor([5, 9, 50, 77, 99])
    host_idx = p.alloc_tokens(5)[:5]
    p.backup_from_device_all_layer(src, host_idx, dev_idx, io_backend=None)
    back = torch.tensor([1, 2, 3, 4, 6])
    for layer in range(L):
        p.load_to_device_per_layer(dst, host_idx, back, layer, io_backend=None)
        assert torch.equal(dst.k_buffer[layer][back], src.k_buffer[layer][dev_idx])
        assert torch.equal(dst.v_buffer[layer][back], src.v_buffer[layer][dev_idx])


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"capacity_bytes": PER_TOKEN}, "host_tier_bytes must be >="),
        ({"page_size": 0}, "page_size must be >= 1"),
    ],
)
def test_bad_configuration_names_the_field(kwargs, needle):
    args = {"num_layers": L, "num_kv_heads": H, "head_dim": D, "dtype": torch.bfloat16,
            "capacity_bytes": 10**8, "page_size": 16, **kwargs}  # fmt: skip
    with pytest.raises(ValueError, match=needle):
        HostSparseKVPool(**args)


def test_double_free_is_caught():
    p = _pool()
    a = p.alloc_tokens(16)
    p.free(a)
    with pytest.raises(AssertionError, match="Double-free"):
        p.free(a)


def test_host_memory_check_replaces_sglangs_hicache_reserve(monkeypatch):
    """SGLang's HostKVCache keeps 10 GiB free; the host tier checks its own size against a 512 MiB margin."""
    from sglang.srt.mem_cache.pool_host.base import HostKVCache

    import dd_sglang.kvcache.host_pool as hp

    assert hasattr(HostKVCache, "_allocate_host_buffer")  # the method the pool overrides
    monkeypatch.setattr(hp, "host_memory_available_bytes", lambda: 10**6)
    with pytest.raises(ValueError, match="sparse.host_tier_bytes"):
        hp.HostSparseKVPool(num_layers=2, num_kv_heads=3, head_dim=4, dtype=torch.float32,
                            capacity_bytes=4 * 10**6, page_size=8)  # fmt: skip
    monkeypatch.setattr(hp, "host_memory_available_bytes", lambda: 10**7)
    pool = hp.HostSparseKVPool(num_layers=2, num_kv_heads=3, head_dim=4, dtype=torch.float32,
                               capacity_bytes=4 * 10**6, page_size=8)  # fmt: skip
    assert pool.capacity_bytes <= 4 * 10**6


def _vma_field(addr: int, field: str) -> str | None:
    """``field`` of the /proc/self/smaps mapping that holds ``addr`` (None: no such line)."""
    found = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                found = lo <= addr < hi
            elif found and line.startswith(field + ":"):
                return line.split(":", 1)[1].strip()
    return None


def test_host_buffers_are_zeros_on_a_huge_page_boundary_and_advised():
    from dd_sglang.kvcache.host_memory import HUGE_PAGE_BYTES, host_zeros, transparent_huge_pages

    t = host_zeros((2, 4096, H, D), torch.bfloat16)  # 3 MiB
    assert t.shape == (2, 4096, H, D) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE_BYTES == 0 and not t.any()
    small = host_zeros((3, 5), torch.float32)  # under a huge page: no padding, still zeros
    assert small.tolist() == [[0.0] * 5] * 3
    view = t[1, 7]
    t.fill_(1.5)
    addr = t.data_ptr()
    del t  # the view keeps the mapping alive
    assert view.float().eq(1.5).all()
    if transparent_huge_pages() in ("always", "madvise"):
        assert _vma_field(addr, "THPeligible") in ("1", None)  # None: a kernel without the line
    with pytest.raises(ValueError, match=r"shape\[1\] must be >= 0"):
        host_zeros((2, -1), torch.int8)


def test_huge_pages_switch_off_and_bad_value(monkeypatch):
    from dd_sglang.kvcache.host_memory import HUGE_PAGES_ENV, host_zeros, transparent_huge_pages

    monkeypatch.setenv(HUGE_PAGES_ENV, "0")
    t = host_zeros((2, 4096, H, D), torch.bfloat16)  # same buffer, 4 KiB pages
    assert not t.any() and t.is_contiguous()
    if transparent_huge_pages() == "madvise":  # only the advice makes it eligible there
        assert _vma_field(t.data_ptr(), "THPeligible") in ("0", None)
    monkeypatch.setenv(HUGE_PAGES_ENV, "yes")
    with pytest.raises(ValueError, match=f"{HUGE_PAGES_ENV} must be 0 or 1, got 'yes'"):
        host_zeros((4, 4), torch.int8)


def test_pool_and_index_buffers_are_host_zeros():
    from dd_sglang.kvcache.host_memory import HUGE_PAGE_BYTES
    from dd_sglang.prefetch.index import QuantKeyIndex

    p = _pool(tokens=512, page=16)  # K and V of 528 slots: 5.8 MiB each
    assert p.k.data_ptr() % HUGE_PAGE_BYTES == 0 and p.v.data_ptr() % HUGE_PAGE_BYTES == 0
    assert not p.k.any() and not p.v.any()
    idx = QuantKeyIndex(p.k)
    assert idx.q8.data_ptr() % HUGE_PAGE_BYTES == 0 and not idx.q8.any()
    assert idx.nbytes == L * 528 * H * (D + 4)
