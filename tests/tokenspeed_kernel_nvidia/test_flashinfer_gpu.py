"""GPU numerics of the FlashInfer kernels against float64 ground truth, sinks included.

Runs only with a CUDA device and flashinfer-python (skips with the reason otherwise). The
cases mirror the ones that failed on an H100 on 2026-11-23 (rel. err 0.3-1.1) because the
standard FA2/FA3 wrappers ignored ``sinks``: decode sinks + LSE, window 100 + sinks, fp8 KV
+ sinks, speculative decode + sinks, prefill causal / window 127 with sinks, extend with
sinks at page 16, plus sink-free controls. Sinks are drawn ``2·N(0, 1)`` and every sink case
first checks that the reference without sinks differs from the one with them by more than
three times the tolerance, so a kernel that drops the sinks cannot pass. Outputs are poisoned with
NaN. The reference is ``tokenspeed_kernel.tools.cases.attention.reference`` (the torch
reference kernels on float64 copies).

One sink wrapper per (q dtype, window on/off, backend) may exist per process (FlashInfer
0.7.2 names its JIT module without the KV dtype or head dims; see ``make_sink_wrapper``):
the sink cases use D=64, and the fp8-cache case uses an fp16 q so that it never shares a
module name with a bf16 case on any architecture.
"""

import importlib.util

import pytest
import torch
from support.gpu import check_against_float64, replay_with_grown_lengths

from tokenspeed_kernel.tools.cases import attention as cases

FP8 = torch.float8_e4m3fn
TOL = 2e-2  # relative Frobenius error of the output; LSE atol/rtol


def _skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device: FlashInfer kernels run only on a GPU (CPU routing tests: test_flashinfer_host.py)"
    if importlib.util.find_spec("flashinfer") is None:
        return "flashinfer-python not installed"
    return None


def _case(op, lens_q, lens_k, **kw):
    base = {"num_q_heads": 16, "num_kv_heads": 2, "head_dim": 64, "return_lse": True}
    return cases.AttentionCase(op, tuple(lens_q), tuple(lens_k), **(base | kw))


RAGGED = [1, 37, 129, 300, 1025]
CASES = {
    "decode sinks lse": _case("attention.decode", [1] * 5, RAGGED, sinks=True),
    "decode window100 sinks": _case("attention.decode", [1] * 5, RAGGED, sinks=True, window_left=100),
    "decode fp8 kv sinks": _case("attention.decode", [1] * 5, RAGGED, sinks=True, kv_dtype=FP8, dtype=torch.float16),
    "decode spec q_len 3 sinks": _case("attention.decode", [3] * 3, [3, 64, 700], sinks=True, page_size=64),
    "decode page 1 sinks": _case("attention.decode", [1] * 3, [5, 1, 77], sinks=True, page_size=1),
    "decode no sinks": _case("attention.decode", [1] * 5, RAGGED),
    "decode no sinks cap": _case("attention.decode", [1] * 3, [9, 100, 300], logit_cap=30.0),
    "prefill causal sinks": _case("attention.prefill", [50, 129, 1], [50, 129, 1], sinks=True),
    "prefill window127 sinks": _case("attention.prefill", [300, 77], [300, 77], sinks=True, window_left=127),
    "prefill non-causal sinks": _case("attention.prefill", [20, 33], [40, 33], sinks=True, causal=False),
    "prefill no sinks": _case("attention.prefill", [50, 129, 1], [50, 129, 1]),
    "extend sinks p16": _case("attention.extend", [1, 37, 100], [40, 37, 333], sinks=True),
    "extend window64 sinks p16": _case("attention.extend", [1, 37, 100], [40, 37, 333], sinks=True, window_left=64),
    "extend fp8 kv sinks": _case("attention.extend", [5, 60], [90, 60], sinks=True, kv_dtype=FP8, dtype=torch.float16),
    "extend no sinks": _case("attention.extend", [1, 37, 100], [40, 37, 333]),
}


@pytest.mark.parametrize("label", list(CASES))
def test_flashinfer_numerics(label):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    case = CASES[label]
    check_against_float64(case, "flashinfer_" + case.op.split(".")[1], label, TOL)


def test_flashinfer_decode_sinks_graph_replay():
    """The sink route under CUDA graphs: plan outside, capture ``plan.run``, grow the
    lengths in place, ``plan.update()``, replay, compare with float64."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    from tokenspeed_kernel import mha_decode_plan

    case = _case("attention.decode", [1] * 4, [30, 200, 513, 64], sinks=True)
    inputs = cases.make_inputs(case, "cuda", seed=7)
    inputs["cache_seqlens"].sub_(2)  # room to grow within the allocated pages
    plan = mha_decode_plan(
        inputs["k_cache"],
        inputs["v_cache"],
        inputs["page_table"],
        inputs["cache_seqlens"],
        513,
        num_q_heads=16,
        sinks=inputs["sinks"],
        return_lse=True,
        capturable=True,
        override="flashinfer_decode",
    )
    out = torch.empty(4, 16, 64, dtype=torch.bfloat16, device="cuda")
    plan.run(inputs["q"], out=out)  # warm-up outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, lse = plan.run(inputs["q"], out=out)
    replay_with_grown_lengths(case, inputs, plan, graph, out, lse, TOL)
