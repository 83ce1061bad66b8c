"""dd_sglang: long-context decoding on SGLang with a host-tier KV cache.

The package is layered; imports go one way only (see DESIGN.md):

    attention -> prefetch, kernels, kvcache
    prefetch  -> kvcache
    kvcache, kernels -> no other dd_sglang layer

``platform`` and ``plugin`` are SGLang entry points (pyproject.toml);
``patches`` (a top-level package beside this one) holds every hook into SGLang.
"""

__version__ = "0.1.0"
