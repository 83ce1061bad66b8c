"""KV-cache layer: the DualPath state machine (host tier and layer buffers follow).

Imports no other dd_sglang layer.
"""
