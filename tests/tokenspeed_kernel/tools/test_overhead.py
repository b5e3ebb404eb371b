"""The host-overhead microbenchmark: no-op kernels serve every call and never outlive it."""

import contextlib
import json

import pytest
import torch

from tokenspeed_kernel import registry
from tokenspeed_kernel.cli import main
from tokenspeed_kernel.tools import overhead
from tokenspeed_kernel.tools.common import PROVENANCE_KEYS

pytestmark = pytest.mark.usefixtures("only_reference")


def _noop_names():
    return [spec.name for spec in registry.kernels() if spec.name.startswith(overhead.NOOP_PREFIX)]


def test_every_case_is_served_by_the_noop_kernel_and_it_is_withdrawn():
    rows = overhead.run(number=20, repeats=1, profile=False)
    assert [r.name for r in rows] == [c.name for c in overhead.cases()]
    assert all(r.kernel == overhead.NOOP_PREFIX + r.op and r.median_us > 0 for r in rows)
    assert _noop_names() == []


def test_noop_kernels_are_withdrawn_on_error():
    with pytest.raises(RuntimeError, match="boom"), overhead.noop_kernels():
        assert len(_noop_names()) == len(overhead.OPERATORS)
        raise RuntimeError("boom")
    assert _noop_names() == []


def test_breakdown_adds_up_to_the_median():
    (row,) = overhead.run(["kvcache.store"], number=50, repeats=1)
    assert set(row.breakdown_us) == set(overhead.CATEGORIES)
    assert sum(row.breakdown_us.values()) == pytest.approx(row.median_us, rel=1e-6)
    assert row.breakdown_us["validation"] > 0 and row.breakdown_us["select"] > 0


def test_cli(tmp_path, capsys):
    path = tmp_path / "overhead.json"
    argv = ["overhead", "--op", "moe.topk", "--number", "20", "--repeats", "1", "--no-breakdown", "--json", str(path)]
    assert main(argv) == 0
    assert "moe_topk" in capsys.readouterr().out
    data = json.loads(path.read_text())
    assert [r["name"] for r in data["rows"]] == ["moe_topk"]
    assert data["device"] == "cpu" and set(PROVENANCE_KEYS) <= set(data)


def test_kernel_category_is_code_outside_the_core_torch_and_stdlib():
    import functools

    triton = pytest.importorskip("triton", reason="the check needs a compiler runtime installed")
    _launcher = pytest.importorskip(
        "tokenspeed_kernel_triton._launcher", reason="the check needs a backend wheel installed"
    )
    from tokenspeed_kernel import kit

    assert overhead._own_category(_launcher.jit_launch.__code__) == "kernel"  # a backend wheel
    assert overhead._own_category(kit.cdiv.__code__) == "kernel"  # the kit: core code run for a backend
    assert overhead._own_category(triton.runtime.jit.JITFunction.run.__code__) == "kernel"  # its compiler
    assert overhead._own_category(overhead.measure.__code__) != "kernel"  # the core
    assert overhead._own_category(functools.cached_property.__init__.__code__) != "kernel"  # the stdlib
    assert overhead._own_category(torch.nn.Module.__init__.__code__) != "kernel"  # torch


def test_the_standalone_command_rejects_a_bad_device_in_one_line(capsys):
    from tokenspeed_kernel.tools.overhead import main

    assert main(["--device", "tpu"]) == 2
    err = capsys.readouterr().err
    assert err == "tokenspeed-kernel overhead: error: unknown device 'tpu'; available here: cpu\n" or (
        torch.cuda.is_available() and err.startswith("tokenspeed-kernel overhead: error: unknown device 'tpu'")
    )


@contextlib.contextmanager
def _pretend_kernels(op: str, priorities: dict):
    """Kernels named as ``priorities``' keys registered for ``op`` at their priorities, each
    serving through the reference kernel (with its features), for the block only."""
    from tokenspeed_kernel.registry import Priority

    reference = next(s for s in registry.kernels(op) if s.priority == Priority.REFERENCE)
    for name, priority in priorities.items():
        registry.register_kernel(op, name=name, solution="test", features=reference.features, priority=priority)(
            reference.fn
        )
    try:
        yield
    finally:
        for name in priorities:
            registry.unregister_kernel(name)


def _extra_row(chosen) -> object:
    """The one row ``--device cuda`` adds for ``chosen`` on this host, after running it once."""
    from tokenspeed_kernel.tools.overhead_device import portable_cases

    (extra,) = portable_cases(chosen, torch.device("cpu"))
    extra.make(torch.device("cpu"))()
    return extra


def test_device_mode_adds_a_row_served_by_the_portable_kernel():
    """``--device cuda`` adds ``NAME (portable)`` rows where the pick is not the portable
    kernel (the runner caches of the portable Triton kernels are measured on an sm_90 host
    too): here a pretend performant kernel wins, and the added row forces the portable one."""
    from tokenspeed_kernel.ops._dispatch import last_kernel
    from tokenspeed_kernel.registry import Priority

    with _pretend_kernels(
        "attention.decode", {"test_portable_decode": Priority.PORTABLE, "test_performant_decode": Priority.PERFORMANT}
    ):
        extra = _extra_row([c for c in overhead.cases() if c.name in ("mha_decode_with_kvcache", "DecodePlan.run")])
        assert extra.name == "mha_decode_with_kvcache (portable)" and extra.op == "attention.decode"
        assert last_kernel() == "test_portable_decode"


def test_device_mode_adds_a_row_per_accepted_opt_in_kernel():
    """An opt-in kernel that accepts a functional call (here a pretend one, below a pretend
    portable pick) gets its own row, ``NAME (KERNEL)``, served by it through ``override=``;
    the pick gets none."""
    from tokenspeed_kernel.ops._dispatch import last_kernel
    from tokenspeed_kernel.registry import Priority

    with _pretend_kernels(
        "attention.extend", {"test_opt_in_extend": Priority.OPT_IN, "test_portable_extend": Priority.PORTABLE}
    ):
        extra = _extra_row([c for c in overhead.cases() if c.op == "attention.extend"])
        assert extra.name == "mha_extend_with_kvcache (test_opt_in_extend)" and extra.op == "attention.extend"
        assert last_kernel() == "test_opt_in_extend"
