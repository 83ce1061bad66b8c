"""What the SGLang processes run for dd_sglang besides the attention backend: the per-process runtime
(:mod:`~dd_sglang.plugin.runtime`: the preset, request limits, the scheduler's metrics), the request
checks (:mod:`~dd_sglang.plugin.requests`) and the HTTP body limit
(:mod:`~dd_sglang.plugin.http_limits`). The hooks that call them, and SGLang's general-plugin entry
point that registers those hooks, are in the top-level ``patches`` package (``patches.load``).
"""
