"""Embedded models. ``python -m dd_sglang.models prepare`` converts the default one."""
