"""The reliability server's geometry (see conftest.py) and a metrics sampler, shared by its tests."""

import threading
import time

from harness.server import scrape

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


class Sampler:
    """Scrapes the sidecar every 0.2 s in a thread while a block runs."""

    def __init__(self, srv, prefix: str | tuple[str, ...] = "dd_"):
        self.srv, self.prefix, self.samples, self._done = srv, prefix, [], threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._done.is_set():
            self.samples.append(scrape(self.srv.metrics_url, self.prefix))
            time.sleep(0.2)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        self._t.join()
