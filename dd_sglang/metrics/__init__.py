"""Metrics: definitions (one module), scheduler-side collection, the sidecar app."""
