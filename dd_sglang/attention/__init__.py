"""The ``dualdecoder`` SGLang attention backend. Uses prefetch, kernels and kvcache."""
