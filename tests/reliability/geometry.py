"""The reliability server's geometry (see conftest.py), shared by its tests."""

API_KEY = "dd-reliability-key"
CAP = 4096  # device pool tokens
PAGE = 16  # sparse.page_size
N_SINK, N_RECENT = 4, 32
RESIDENT_BOUND = N_SINK + N_RECENT + PAGE  # most device slots a sparse request holds (n_keep 0)
BYTES_PER_TOKEN = 23_040  # SmolLM2 bf16: 30 layers x 2 x 3 KV heads x 64 x 2 B
N_LAYERS = 30
#: (target tokens, depth, passkey, header) of the prompt whose decode growth fills the host tier.
GROWTH_PROMPT = (1300, 0.5, 80417, "Growth check 1. ")


def host_pages(n_tokens: int) -> int:
    """Host-tier pages holding ``n_tokens`` tokens."""
    return -(-n_tokens // PAGE)
