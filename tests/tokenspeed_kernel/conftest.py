"""Fixtures for core tests: temporary kernels that are unregistered afterwards."""

import pytest
import torch

from tokenspeed_kernel import config, platform, registry, selector
from tokenspeed_kernel.ops._checks import clear_call_tables


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


@pytest.fixture
def cold_and_warm():
    """``check(valid, bad, exc, match)``: ``bad()`` raises ``exc`` matching ``match`` both cold
    (no call remembered) and warm (right after ``valid()``, a good call with the same
    shapes, was remembered by the op's call-key table), with the same message."""

    def check(valid, bad, exc, match):
        messages = []
        for warm in (False, True):
            clear_call_tables()
            if warm:
                valid()
            with pytest.raises(exc, match=match) as info:
                bad()
            messages.append(str(info.value))
        assert messages[0] == messages[1]

    yield check
    clear_call_tables()


BF16 = torch.bfloat16
