"""The reliability server's geometry (see conftest.py), shared by its tests."""

API_KEY = "dd-reliability-key"
CAP = 4096  # device pool tokens
PAGE = 16  # sparse.page_size
N_SINK, N_RECENT = 4, 32
RESIDENT_BOUND = N_SINK + N_RECENT + PAGE  # most device slots a sparse request holds (n_keep 0)
N_LAYERS = 30
#: (target tokens, depth, passkey, header) of the prompt whose decode growth fills the host tier.
GROWTH_PROMPT = (1300, 0.5, 80417, "Growth check 1. ")


def host_pages(n_tokens: int) -> int:
    """Host-tier pages holding ``n_tokens`` tokens."""
    return -(-n_tokens // PAGE)


def kv_bytes_per_token(itemsize: int) -> int:
    """SmolLM2's KV bytes per token: 30 layers x (K, V) x 3 KV heads x head_dim 64 x ``itemsize``."""
    return N_LAYERS * 2 * 3 * 64 * itemsize
