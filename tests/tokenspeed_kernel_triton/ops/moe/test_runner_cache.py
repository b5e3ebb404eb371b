"""The functional calls' runner cache of ``triton_fused_moe`` (``moe_apply`` without a plan).

Calls that share a key (three "layers": other weights, biases, maps, x, routing, out) run one
runner, bound once; each of its four launches gets that call's tensors (weights included: a
runner holds none) and the same scalars, grids and constexprs as the uncached call
(``fused_moe``) would launch (recorded, nothing run); the permutation buffers and layer
outputs are new per call. A changed key binds anew; a plan's call (``prepared``) never uses
the cache. Under the interpreter, calls through the cache match the float64 MoE.
"""

import dataclasses

import pytest
import torch
from support.launch_recorder import Recorder, assert_same_launches
from support.naive_moe import naive_moe

from tokenspeed_kernel import moe_apply
from tokenspeed_kernel.ops._dispatch import last_kernel
from tokenspeed_kernel.ops.moe.args import MoEApplyArgs
from tokenspeed_kernel.quant import FP8Weight, MXFP4Weight
from tokenspeed_kernel.tools import cases
from tokenspeed_kernel_triton.ops.moe import _driver, fused

DEVICE = "cpu"
# CPU tensors reach the Triton kernels only under the interpreter, which a GPU host's tests run
# without; there test_launcher_gpu.py runs every functional runner on the GPU, bitwise against
# the uncached call over three layers.
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="runner-cache tests run CPU tensors under Triton's interpreter; on a GPU: test_launcher_gpu.py",
)
_BY_NAME = {c.name: c for c in cases.awkward_cases("moe.apply", torch.bfloat16)}
NAMES = ("plain_t5", "bias", "expert_map", "fp8_per_channel", "fp8_block", "gpt_oss_like_t5", "mxfp4_odd_t7")


def _args(case, seed: int) -> MoEApplyArgs:
    inputs = cases.make_inputs(case, DEVICE, seed=seed)
    return MoEApplyArgs(**inputs, out=torch.full_like(inputs["x"], float("nan")), prepared=None)


def _tensors(args: MoEApplyArgs) -> list:
    found = []
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        if isinstance(value, (MXFP4Weight, FP8Weight)):
            found += [getattr(value, g.name) for g in dataclasses.fields(value)]
        elif isinstance(value, torch.Tensor):
            found.append(value)
    return found


@pytest.mark.parametrize("name", NAMES)
def test_runner_launches_what_the_uncached_call_launches(monkeypatch, name):
    case = _BY_NAME[name]
    rec = Recorder().install(monkeypatch)
    fused._RUNNERS.clear()
    binds = fused._RUNNERS.binds
    for layer in range(3):
        args = _args(case, seed=layer)
        start = len(rec.launches)
        fused.triton_fused_moe(args)
        cached = rec.since(start)
        fused.fused_moe(args)  # the reference: the uncached call
        fresh = rec.since(start + len(cached))
        assert len(cached) == 4, [c[0] for c in cached]
        assert_same_launches(cached, fresh, _tensors(args))
    assert fused._RUNNERS.binds == binds + 1, "three layers of one key: one bind"
    assert rec.bound == 4, "each of the four launches bound once"


def test_a_plan_call_and_activation_quant_take_the_uncached_path(monkeypatch):
    case = _BY_NAME["fp8_per_channel"]
    Recorder().install(monkeypatch)
    fused._RUNNERS.clear()
    args = _args(case, seed=0)
    fused.triton_fused_moe(dataclasses.replace(args, prepared=fused.prepare_moe(w13=args.w13, w2=args.w2)))
    fused.triton_fused_moe(dataclasses.replace(args, activation_quant="fp8"))
    assert not fused._RUNNERS.runners


def test_a_changed_key_binds_anew():
    key = _driver.runner_key
    plain = _args(_BY_NAME["plain_t5"], seed=0)
    base = key(plain)
    assert key(_args(_BY_NAME["plain_t5"], seed=1)) == base, "other weights and routing, one shape: one key"
    changed = [
        key(_args(dataclasses.replace(_BY_NAME["plain_t5"], dtype=torch.float16), seed=0)),
        key(_args(_BY_NAME["plain_t1"], seed=0)),  # token count (tile, grids, buffers)
        key(_args(_BY_NAME["bias"], seed=0)),
        key(_args(_BY_NAME["expert_map"], seed=0)),
        key(_args(_BY_NAME["gelu"], seed=0)),
        key(_args(_BY_NAME["fp8_per_tensor"], seed=0)),
        key(_args(_BY_NAME["fp8_per_channel"], seed=0)),
        key(dataclasses.replace(plain, w13=plain.w13.transpose(1, 2).contiguous().transpose(1, 2))),  # strides
    ]
    assert len({base, *changed}) == len(changed) + 1


@pytest.mark.parametrize("name", ["plain_t5", "bias", "gpt_oss_like_t5"])
def test_calls_through_the_cache_match_the_float64_moe(name):
    """Three calls of one key, each with its own weights and routing, through one runner."""
    case = _BY_NAME[name]
    fused._RUNNERS.clear()
    binds = fused._RUNNERS.binds
    for layer in range(3):
        inputs = cases.make_inputs(case, DEVICE, seed=20 + layer)
        expected = naive_moe(**inputs)
        out = moe_apply(**inputs, override="triton_fused_moe")
        assert last_kernel() == "triton_fused_moe"
        assert not torch.isnan(out).any()
        err = float((out.double() - expected).norm() / expected.norm())
        assert err < 2e-2, f"layer {layer}: relative error {err:.2e}"
    assert fused._RUNNERS.binds == binds + 1
