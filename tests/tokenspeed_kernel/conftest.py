"""Fixtures for core tests: temporary kernels that are unregistered afterwards."""

import pytest
import torch

from tokenspeed_kernel import config, platform, registry, selector


@pytest.fixture
def only_reference():
    """Only the reference backend's kernels are registered during the test."""
    with registry.isolated():
        yield


@pytest.fixture
def temp_kernels(only_reference):
    """Register kernels for one test; all are removed at the end.

    Usage: ``temp_kernels("attention.decode", name="x", priority=..., ...)`` returns the
    registered function (a stub recording its calls in ``fn.calls``). Only the reference
    backend's kernels stay registered meanwhile, so installed wheels do not change results.
    """

    def _register(op, *, name, **meta):
        meta.setdefault("solution", "test")

        def fn(args):
            fn.calls.append(args)

        fn.calls = []
        registry.register_kernel(op, name=name, **meta)(fn)
        return fn

    yield _register


@pytest.fixture
def env(monkeypatch):
    """Set tokenspeed env variables for one test; caches are refreshed on entry and exit."""

    def _set(name, value):
        monkeypatch.setenv(name, value)
        config.refresh()
        platform.refresh()
        selector.clear_cache()

    yield _set
    monkeypatch.undo()
    config.refresh()
    platform.refresh()
    selector.clear_cache()


BF16 = torch.bfloat16
