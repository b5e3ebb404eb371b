"""Triton's CPU interpreter as a platform capability: what the Triton wheel registers does not
depend on ``TRITON_INTERPRET``; the CPU platform reports ``triton_interpreter`` while it is on;
the ``INTERPRET`` constexpr follows the launch's device."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import pytest
import torch

from tokenspeed_kernel.platform import INTERPRETER_CAPABILITY
from tokenspeed_kernel.registry import kernels
from tokenspeed_kernel_triton import _interpreter

NO_GPU = not torch.cuda.is_available()


def _fresh(args: list[str], value: str | None) -> subprocess.CompletedProcess:
    """``python -m tokenspeed_kernel ARGS`` in a fresh process with ``TRITON_INTERPRET`` set to
    ``value`` (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if value is not None:
        env["TRITON_INTERPRET"] = value
    run = subprocess.run([sys.executable, "-m", "tokenspeed_kernel", *args], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr
    return run


@pytest.mark.slow
def test_what_is_registered_does_not_depend_on_triton_interpret(tmp_path):
    listed = {}
    for value in (None, "0", "1"):
        path = tmp_path / f"list-{value}.json"
        _fresh(["list", "--json", str(path)], value)
        data = json.loads(path.read_text())
        listed[value] = data["operators"]
        caps = data["platform"]["capabilities"]
        assert (INTERPRETER_CAPABILITY in caps) == (value == "1" and NO_GPU), (value, caps)
    assert listed[None] == listed["0"] == listed["1"]
    triton = {s["name"]: s for op in listed[None].values() for s in op["kernels"] if s["backend"] == "triton"}
    gpu_only = {"triton_fused_moe_mx", "triton_fused_moe_mx_swap", "triton_fused_moe_mx_swap_persistent"}
    assert len(triton) == 13 and gpu_only < set(triton)  # tl.dot_scaled / inline PTX
    for name, spec in triton.items():
        if name in gpu_only:
            assert "cpu" not in spec["vendors"] and spec["vendor_capabilities"] == {}, name
        else:
            assert spec["vendors"] == ["cpu", "cuda", "rocm"], name
            assert spec["vendor_capabilities"] == {"cpu": [INTERPRETER_CAPABILITY]}, name


@pytest.mark.slow
def test_explain_on_a_cpu_without_the_interpreter_says_what_is_missing():
    out = _fresh(["explain", "attention.decode", "--case", "0", "--platform", "cpu"], None).stdout
    line = next(line for line in out.splitlines() if "triton_decode" in line)
    assert "REJECTED" in line and line.endswith("platform lacks capabilities {triton_interpreter}"), line
    assert "=> torch_decode" in out
    out = _fresh(["explain", "attention.decode", "--case", "0", "--platform", "cpu"], "1").stdout
    assert "=> triton_decode" in out


def test_registrations_in_this_process_match():
    for spec in kernels():
        if spec.backend == "triton" and "cpu" in spec.vendors:
            assert spec.capabilities_on("cpu") >= {INTERPRETER_CAPABILITY}, spec.name
            assert INTERPRETER_CAPABILITY not in spec.capabilities_on("cuda") | spec.capabilities_on("rocm")


def test_the_interpret_constexpr_follows_the_device():
    """``interpreted(device)`` (store, MoE launches); the attention launches' ``kernel_config``
    is checked per vendor in ops/attention/test_tiles.py."""
    assert _interpreter.interpreted(torch.device("cpu"))
    for device in (torch.device("cuda", 0), torch.device("meta")):
        assert not _interpreter.interpreted(device)


# Run in a fresh process on a GPU host: the Triton decode (and then, first launched after the
# flip in "late", the KV store) on CUDA tensors against float64. "late": TRITON_INTERPRET=1 is
# set mid-process after the backends loaded (what a CPU code path of a tool did in a GPU test
# worker): the kernels stay compiled and INTERPRET stays off. "early": it was set before they
# loaded, so Triton made them interpreted ones: a GPU launch is refused.
_GPU_PROGRAM = """
import os, sys, torch
from tokenspeed_kernel import platform
from tokenspeed_kernel.tools.cases import attention as cases
def rel_err(op, kernel):
    case = cases.awkward_cases(op)[0]
    inputs = cases.make_inputs(case, "cuda", seed=1)
    want = cases.reference(case, inputs)[0]
    got = cases.call(case, inputs, override=kernel)
    got = got[0] if isinstance(got, tuple) else got
    return float((got.double() - want.double()).norm() / max(float(want.double().norm()), 1e-30))
assert rel_err("attention.decode", "triton_decode") < 2e-2
if sys.argv[1] == "late":
    os.environ["TRITON_INTERPRET"] = "1"
    platform.refresh()
    assert platform.INTERPRETER_CAPABILITY in platform.platform_for(torch.device("cpu")).capabilities
    assert platform.INTERPRETER_CAPABILITY not in platform.current_platform().capabilities
    assert rel_err("attention.decode", "triton_decode") < 2e-2
    assert rel_err("kvcache.store", "triton_store_kvcache") == 0.0
print("ok")
"""


@pytest.mark.slow
@pytest.mark.skipif(NO_GPU, reason="needs a CUDA device: what TRITON_INTERPRET does on a GPU host")
def test_on_a_gpu_host_the_interpreter_never_runs_gpu_tensors():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    late = subprocess.run([sys.executable, "-c", _GPU_PROGRAM, "late"], env=env, capture_output=True, text=True)
    assert late.returncode == 0 and late.stdout.strip() == "ok", late.stderr[-3000:]
    early = subprocess.run(
        [sys.executable, "-c", _GPU_PROGRAM, "early"],
        env={**env, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
    )
    assert early.returncode != 0 and "defined while TRITON_INTERPRET was on" in early.stderr, early.stderr[-3000:]


_SCALAR_RANGE = """
import sys, warnings
import torch, triton, triton.language as tl
if sys.argv[1] == "mend":
    import tokenspeed_kernel_triton._interpreter  # noqa: F401  (mends while TRITON_INTERPRET is on)
# NumPy >= 2.4 raises where 1.25-2.3 warn: the warning as an error stands for the newer NumPy.
warnings.filterwarnings("error", message="Conversion of an array with ndim > 0", category=DeprecationWarning)

@triton.jit
def total(X, Out, n, BLOCK: tl.constexpr):
    acc = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(X + offs, mask=offs < n, other=0.0)
    tl.store(Out, tl.sum(acc))

x = torch.randn(37)
out = torch.full((1,), float("nan"))
total[(1,)](x, out, 37, BLOCK=8)
torch.testing.assert_close(out[0], x.sum())
print("summed")
"""


@pytest.mark.parametrize("mend", [True, False])
def test_a_runtime_scalar_bounds_a_loop_under_newer_numpy(mend):
    """A kernel looping to a runtime scalar (``range(0, n, BLOCK)``) runs under the interpreter
    where NumPy refuses ``int()`` of a one-element array, once this wheel is imported; the
    unmended interpreter fails there (triton-lang/triton#9171), which shows the check bites."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run(
        [sys.executable, "-c", _SCALAR_RANGE, "mend" if mend else "plain"], capture_output=True, text=True, env=env
    )
    from triton.runtime import interpreter

    unmended = inspect.getsource(interpreter)
    fixed_upstream = "int(self.handle.data)" not in unmended  # a Triton after 3.6
    if mend or fixed_upstream:
        assert run.returncode == 0 and "summed" in run.stdout, run.stderr
    else:
        # NumPy 2.4+ raises a TypeError (the GPU image's); older ones warn, made an error above.
        refused = ("ndim > 0" in run.stderr) or ("only 0-dimensional arrays" in run.stderr)
        assert run.returncode != 0 and refused, run.stdout + run.stderr
