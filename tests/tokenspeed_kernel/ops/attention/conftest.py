"""Fixtures of the attention operator tests."""

import pytest

from tokenspeed_kernel import config


@pytest.fixture
def debug(monkeypatch):
    """``TOKENSPEED_KERNEL_DEBUG=1`` for one test (the synchronizing value checks)."""
    monkeypatch.setenv(config.DEBUG_ENV, "1")
    config.refresh()
    yield
    monkeypatch.delenv(config.DEBUG_ENV)
    config.refresh()
