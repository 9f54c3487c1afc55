"""The e2e tests share the session-wide server of ``tests/conftest.py``."""
