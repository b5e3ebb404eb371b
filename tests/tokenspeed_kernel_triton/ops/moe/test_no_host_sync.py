"""The Triton MoE (router top-k, permutation, grouped GEMMs, combine; the two-launch GEMV
MoEs) never reads a device value on the host, so a whole ``moe_topk`` + ``moe_apply`` can be captured in a CUDA graph.

Without a GPU: the Triton launches are replaced by recorders and every host read of a tensor
(``item``, ``tolist``, ``bool``/``int``/``float``/``index``, ``cpu``, ``numpy``) raises while the
public calls run; the launches (kernels, grids, scalar arguments, constexprs) must then be
the same for two different routings of the same shapes — a function of shapes only. With a
GPU, the calls are captured in a CUDA graph and replayed against eager results.
"""

import pytest
import torch
from support.launch_recorder import isolate_runners
from support.moe_checks import capture

from tokenspeed_kernel import config
from tokenspeed_kernel.ops.moe import moe_apply, moe_plan, moe_topk
from tokenspeed_kernel.ops.moe.args import MoEApplyArgs
from tokenspeed_kernel.tools import cases
from tokenspeed_kernel_triton.ops.moe import (
    _driver,
    _routing,
    fused,
    fused_mx,
    fused_mx_swap,
    fused_mx_swap_persistent,
    gemv,
    topk,
)

HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")
LAUNCHES = (
    (topk, "topk_kernel"),
    (_routing, "align_kernel"),
    (fused, "moe_gemm_kernel"),
    (_driver, "combine_kernel"),
    (gemv, "gemv_w13_kernel"),
    (gemv, "gemv_w2_kernel"),
)


class _Recorder:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            scalars = tuple(a for a in args if not isinstance(a, torch.Tensor))
            shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
            self.log.append((self.name, tuple(grid), scalars, shapes, tuple(sorted(kwargs.items()))))

        return launch


def _forbid_host_reads(monkeypatch):
    def make(name):
        def refuse(self, *a, **k):
            raise AssertionError(f"host read of a device value: Tensor.{name}")

        return refuse

    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, make(name))


def _inputs(fmt, tokens, skewed):
    case = cases.MoECase(
        "moe.apply",
        tokens,
        256 if fmt == "fp8_block" else 64,
        32,
        8,
        2,
        weight_format=fmt,
        activation="swiglu_oai",
        bias=True,
        expert_map=True,
    )
    inputs = cases.make_inputs(case, "cpu", seed=1)
    logits = torch.randn(tokens, case.num_experts, generator=torch.Generator().manual_seed(2))
    if skewed:  # every token to the same two experts: a very different permutation
        logits[:, :2] += 100.0
    return inputs, logits


def _launches(monkeypatch, fmt, tokens, skewed, planned, kernel="triton_fused_moe"):
    inputs, logits = _inputs(fmt, tokens, skewed)
    plan = None
    if planned:
        weights = {k: inputs[k] for k in ("w13", "w2", "w13_bias", "w2_bias", "expert_map")}
        plan = moe_plan(**weights, x_dtype=inputs["x"].dtype, top_k=2, activation="swiglu_oai", override=kernel)
    log = []
    with monkeypatch.context() as m:
        # A functional call's runner keeps the kernels it was bound with: bind with the
        # recorders, and drop those runners afterwards.
        isolate_runners(m)
        for module, name in LAUNCHES:
            m.setattr(module, name, _Recorder(name, log))
        _forbid_host_reads(m)
        weights_, ids = moe_topk(logits, 2)
        if plan is None:
            moe_apply(
                inputs["x"],
                inputs["w13"],
                inputs["w2"],
                weights_,
                ids,
                activation="swiglu_oai",
                w13_bias=inputs["w13_bias"],
                w2_bias=inputs["w2_bias"],
                expert_map=inputs["expert_map"],
                override=kernel,
            )
        else:
            plan.apply(inputs["x"], weights_, ids)
    return log


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU form; the GPU form captures a real graph")
@pytest.mark.parametrize("planned", [False, True], ids=["functional", "plan"])
@pytest.mark.parametrize("tokens", [1, 33])
@pytest.mark.parametrize("fmt", ["plain", "fp8_per_channel", "fp8_block", "mxfp4"])
def test_launches_depend_on_shapes_only(monkeypatch, fmt, tokens, planned):
    assert not config.debug(), "debug mode checks values on the host by design"
    uniform = _launches(monkeypatch, fmt, tokens, skewed=False, planned=planned)
    skewed = _launches(monkeypatch, fmt, tokens, skewed=True, planned=planned)
    names = [entry[0] for entry in uniform]
    assert names == ["topk_kernel", "align_kernel", "moe_gemm_kernel", "moe_gemm_kernel", "combine_kernel"], names
    assert uniform == skewed


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU form; the GPU form captures a real graph")
@pytest.mark.parametrize("planned", [False, True], ids=["functional", "plan"])
@pytest.mark.parametrize("tokens", [1, 6])
@pytest.mark.parametrize("kernel, fmt", [("triton_moe_gemv", "plain"), ("triton_moe_gemv_mx", "mxfp4")])
def test_gemv_launches_depend_on_shapes_only(monkeypatch, kernel, fmt, tokens, planned):
    """The two-launch GEMV MoEs (T <= 8), functional (runner cache) and planned (bound)."""
    assert not config.debug(), "debug mode checks values on the host by design"
    uniform = _launches(monkeypatch, fmt, tokens, skewed=False, planned=planned, kernel=kernel)
    skewed = _launches(monkeypatch, fmt, tokens, skewed=True, planned=planned, kernel=kernel)
    assert [entry[0] for entry in uniform] == ["topk_kernel", "gemv_w13_kernel", "gemv_w2_kernel"], uniform
    assert uniform == skewed


# The MXFP4 grouped GEMMs: (module, GEMM kernel name, prepare hook, run, bind hook, K splits forced
# at T = 1): split-K at T = 1 except for the persistent GEMM, which never splits.
MX_KERNELS = {
    "dot_scaled": (fused_mx, "moe_mx_gemm_kernel", fused_mx.prepare_moe_mx, fused_mx.fused_moe_mx,
                   fused_mx.bind_fused_moe_mx, 2),
    "swap": (fused_mx_swap, "moe_mx_swap_gemm_kernel", fused_mx_swap.prepare_moe_mx_swap,
             fused_mx_swap.fused_moe_mx_swap, fused_mx_swap.bind_fused_moe_mx_swap, 2),
    "persistent": (fused_mx_swap_persistent, "moe_mx_swap_persistent_kernel", fused_mx_swap.prepare_moe_mx_swap,
                   fused_mx_swap_persistent.fused_moe_mx_swap_persistent,
                   fused_mx_swap_persistent.bind_fused_moe_mx_swap_persistent, None),
}  # fmt: skip


def _mx_launches(monkeypatch, kernel, tokens, skewed, planned):
    """An MXFP4 grouped GEMM's host path (split-K rule, finish kernel, the swapped kernel's
    per-call repack) with its launches recorded: it cannot run under the interpreter (or is
    not selected there), but its host code can. No host read, and no tensor built from host
    data (a host-to-device copy, which CUDA-graph capture refuses). ``planned="bound"``: the
    prepared weights through the bind hook's runner (bound and run under the guards)."""
    module, gemm, prepare, run, bind, split_at_1 = MX_KERNELS[kernel]
    inputs, logits = _inputs("mxfp4", tokens, skewed)
    weights_, ids = (t.contiguous() for t in torch.topk(torch.softmax(logits, -1), 2))
    prepared = prepare(w13=inputs["w13"], w2=inputs["w2"]) if planned else None
    log = []
    with monkeypatch.context() as m:
        for owner, name in (*LAUNCHES[1:], (module, gemm), (fused_mx, "split_finish_kernel")):
            m.setattr(owner, name, _Recorder(name, log))
        _forbid_host_reads(m)
        for name in ("tensor", "as_tensor", "from_numpy"):
            m.setattr(torch, name, lambda *a, _name=name, **k: pytest.fail(f"torch.{_name} in the call path"))
        args = MoEApplyArgs(
            x=inputs["x"],
            w13=inputs["w13"],
            w2=inputs["w2"],
            topk_weights=weights_.float(),
            topk_ids=ids.int(),
            activation="swiglu_oai",
            w13_bias=inputs["w13_bias"],
            w2_bias=inputs["w2_bias"],
            expert_map=inputs["expert_map"],
            out=torch.empty_like(inputs["x"]),
            prepared=prepared,
        )
        splits = None if tokens > 1 else split_at_1
        if planned == "bound":
            bind(args, splits=splits)(args)
        else:
            run(args, splits=splits)
    return log


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU form; the GPU form captures a real graph")
@pytest.mark.parametrize("planned", [False, True, "bound"], ids=["functional", "plan", "bound"])
@pytest.mark.parametrize("tokens", [1, 33])
@pytest.mark.parametrize("kernel", list(MX_KERNELS))
def test_mxfp4_gemm_launches_depend_on_shapes_only(monkeypatch, kernel, tokens, planned):
    uniform = _mx_launches(monkeypatch, kernel, tokens, skewed=False, planned=planned)
    skewed = _mx_launches(monkeypatch, kernel, tokens, skewed=True, planned=planned)
    names = [entry[0] for entry in uniform]
    assert names[0] == "align_kernel" and names[-1] == "combine_kernel" and names.count(MX_KERNELS[kernel][1]) == 2
    assert ("split_finish_kernel" in names) == (tokens == 1 and MX_KERNELS[kernel][5] is not None), names
    assert uniform == skewed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (graph capture)")
@pytest.mark.parametrize("fmt", ["plain", "fp8_per_channel", "fp8_block", "mxfp4"])
def test_cuda_graph_capture_matches_eager(fmt):
    case = cases.MoECase(
        "moe.apply", 33, 256, 128, 8, 2, weight_format=fmt, activation="swiglu_oai", bias=True, expert_map=True
    )
    inputs = cases.make_inputs(case, "cuda", seed=1)
    logits = torch.randn(33, 8, device="cuda")
    extra = {k: inputs[k] for k in ("w13_bias", "w2_bias", "expert_map")}

    def step():
        w, ids = moe_topk(logits, 2)
        return moe_apply(inputs["x"], inputs["w13"], inputs["w2"], w, ids, activation="swiglu_oai", **extra)

    eager = step()
    graph, captured = capture(step)
    logits.copy_(logits.flip(0))
    graph.replay()
    torch.cuda.synchronize()
    w, ids = moe_topk(logits, 2)
    again = moe_apply(inputs["x"], inputs["w13"], inputs["w2"], w, ids, activation="swiglu_oai", **extra)
    torch.testing.assert_close(captured, again, atol=0, rtol=0)
    assert not torch.equal(captured, eager)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU form")
def test_the_host_read_guard_fires(monkeypatch):
    """Control: debug mode's value checks (``int(topk_ids.min())``) are caught by the guard."""
    monkeypatch.setenv(config.DEBUG_ENV, "1")
    config.refresh()
    try:
        with pytest.raises(AssertionError, match="host read of a device value"):
            _launches(monkeypatch, "plain", 5, skewed=False, planned=False)
    finally:
        monkeypatch.delenv(config.DEBUG_ENV)
        config.refresh()
