"""Attention kernels for the sparse decode path. Imports no other dd_sglang layer.

``dispatch.SparseAttention`` is the one entry point (plan per step, run per layer);
``flashinfer_decode`` maps a step onto FlashInfer's paged decode kernel (CUDA);
``sparse_decode`` is the PyTorch reference used everywhere else.
"""
