"""Prefetch layer: speculators, selectors and the layer-aware transfer schedule. Uses kvcache only."""
