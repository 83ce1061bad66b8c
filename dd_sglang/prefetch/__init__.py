"""Prefetch layer: selectors (which KV entries a decode step needs). Uses kvcache only."""
