"""Attention kernels for the sparse decode path. Imports no other dd_sglang layer."""
