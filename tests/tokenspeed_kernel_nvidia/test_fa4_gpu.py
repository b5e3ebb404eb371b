"""GPU numerics of ``fa4_prefill_sm90`` (FlashAttention-4's CuTe DSL Hopper forward) against float64.

Runs only on an sm_90 GPU with a route to FA4 (skips with the reason otherwise): the
``cutedsl`` extra, or an AOT bundle from ``ci/device/cutedsl_bundle.sh`` (its ``check`` set
covers every case here). Ragged lengths 1..1025 with an empty sequence, keys before queries
(bottom-right causal), GQA groups 8/4/1, D 64 and 128, bf16 and fp16, causal and not,
windows 127/63/0, sinks drawn ``2·N(0, 1)`` (a case first checks that dropping them would
fail it), LSE; outputs poisoned with NaN. Then CUDA-graph capture and replay with new
inputs (the registration claims ``graph_safe``). The reference is
``tokenspeed_kernel.tools.cases.attention.reference`` (the torch reference kernels on
float64 copies).
"""

import pytest
import torch
from support.gpu import sharpen_sinks

from tokenspeed_kernel.tools.cases import attention as cases

KERNEL = "fa4_prefill_sm90"
TOL = 2e-2  # relative Frobenius error of the output; LSE atol/rtol


def _skip_reason() -> str | None:
    from tokenspeed_kernel_nvidia.ops.attention._fa4 import fa4_missing

    if not torch.cuda.is_available():
        return "no CUDA device: FA4's sm_90 kernel runs only on a GPU (CPU tests: test_fa4_host.py, test_aot_fa4.py)"
    capability = torch.cuda.get_device_capability()
    if capability != (9, 0):
        return f"sm_{capability[0]}{capability[1]} device: the kernel is built for sm_90a only"
    return fa4_missing()


def _case(lens_q, lens_k, hq, hkv, d, **kw):
    base = {"sinks": True, "return_lse": True}
    return cases.AttentionCase("attention.prefill", tuple(lens_q), tuple(lens_k), hq, hkv, d, **(base | kw))


RAGGED = [1, 37, 129, 300, 1025]
CASES = {
    "gpt-oss causal": _case(RAGGED, RAGGED, 64, 8, 64),
    "gpt-oss window127": _case(RAGGED, RAGGED, 64, 8, 64, window_left=127),
    "gpt-oss window127 no sinks no lse": _case(
        RAGGED, RAGGED, 64, 8, 64, window_left=127, sinks=False, return_lse=False
    ),
    "g8 window0": _case(RAGGED, RAGGED, 16, 2, 64, window_left=0, sinks=False),
    "g4 d128 fp16 non-causal": _case(RAGGED, RAGGED, 16, 4, 128, causal=False, dtype=torch.float16),
    "mha d128 non-causal window63": _case(
        RAGGED, RAGGED, 8, 8, 128, causal=False, window_left=63, sinks=False, return_lse=False
    ),
    "g4 bottom-right": _case([5, 33, 0, 200], [20, 70, 9, 900], 32, 8, 64),
    "g4 empty keys": _case([0, 6, 3], [0, 0, 11], 8, 2, 64, causal=False),
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm())


def _assert_matches_float64(case, inputs, out, lse, label) -> None:
    """``out`` (and ``lse`` unless None) within TOL of the float64 reference, no NaN left."""
    ref_out, ref_lse = cases.reference(case, inputs)
    assert not torch.isnan(out).any(), f"{label}: unwritten rows"
    err = _rel(out, ref_out)
    assert err < TOL, f"{label}: rel err {err:.3g}"
    if lse is not None:
        torch.testing.assert_close(lse.double(), ref_lse, atol=TOL, rtol=TOL)


def _skip_unless_runnable() -> None:
    reason = _skip_reason()
    if reason:
        print(f"SKIP {KERNEL}: {reason}")
        pytest.skip(reason)


@pytest.mark.parametrize("label", list(CASES))
def test_fa4_prefill_numerics(label):
    _skip_unless_runnable()
    case = CASES[label]
    inputs = cases.make_inputs(case, "cuda", seed=len(label))
    if case.sinks:
        sharpen_sinks(case, inputs, TOL)
    q = inputs["q"]
    out = torch.full((*q.shape[:-1], case.dv), float("nan"), dtype=q.dtype, device=q.device)
    result = cases.call(case, inputs, override=KERNEL, out=out)
    torch.cuda.synchronize()
    _assert_matches_float64(case, inputs, *(result if case.return_lse else (result, None)), label)


def test_fa4_prefill_graph_replay():
    """Warm up eagerly, capture one call, refill q/k/v in place, replay, compare with float64."""
    _skip_unless_runnable()
    case = CASES["gpt-oss window127"]
    inputs = cases.make_inputs(case, "cuda", seed=3)
    out = torch.empty_like(inputs["q"])
    cases.call(case, inputs, override=KERNEL, out=out)  # loads (AOT) or compiles (JIT) the variant
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, lse = cases.call(case, inputs, override=KERNEL, out=out)
    for seed in (4, 5):
        fresh = cases.make_inputs(case, "cuda", seed=seed)
        for name in ("q", "k", "v", "sinks"):
            inputs[name].copy_(fresh[name])
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _assert_matches_float64(case, inputs, out, lse, f"replay {seed}")
