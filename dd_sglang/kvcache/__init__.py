"""KV-cache layer: the DualPath state machine, the host tier, the sparse runtime and the
``dualdecoder`` radix cache (SGLang's unified radix cache plus host-tier prefixes).

Imports no other dd_sglang layer.
"""
