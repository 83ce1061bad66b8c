"""End-to-end tests against one shared ``dualdecoder`` server (``conftest.py``)."""
