"""FlashInfer's CUTLASS fused MoE (TensorRT-LLM's ``CutlassMoeFCRunner``) for ``moe.apply``.

What FlashInfer 0.7.2.post1's source says (``flashinfer/fused_moe/core.py``
``cutlass_fused_moe``; ``data/csrc/fused_moe/cutlass_backend/``), and what this module does
with it:

- **Architectures.** ``get_cutlass_fused_moe_module`` JIT-builds one module per compute
  capability and raises ``ValueError("Invalid backend")`` for any other: sm_89, sm_90
  (sm90a flags), sm_100/sm_107/sm_110 (the "100" module), sm_103, sm_120/sm_121. No sm_80
  or sm_86 module exists (:data:`FLASHINFER_ARCHS`: the named ones; sm_107 has no name in
  the core's platform table). We register only sm_90 (:data:`ARCHS`), the one architecture
  we have tried to build it for (the H100); the others wait for a GPU of theirs.
- **Weights.** Only plain weights in x's dtype (bf16 x bf16, fp16 x fp16) are registered.
  The runner's other modes need layouts this module does not produce: MXFP4 x bf16
  ("W4A16", ``use_w4_group_scaling``) wants FlashInfer's interleaved weight/scale layout
  (sm_90 only); fp8 needs fp8 activations with per-tensor dequant scales (our
  ``activation_quant="fp8"`` is per token); MXFP4 x MXFP8 is sm_100 only with swizzled
  scales. The metadata refuses them (weight dtype, features); the first docstring line of
  the kernel, printed by ``tokenspeed-kernel list``, says why.
- **w13 order.** The gated activation kernel (``doActivationKernel``,
  ``doGatedActivationKernel``) reads the *linear* (up) value at ``[0, I)`` and the *gate*
  at ``gated_off = I``: FlashInfer's fc1 is ``[up; gate]``, ours is ``[gate; up]``. The
  halves of ``w13`` and ``w13_bias`` are swapped: once in :func:`prepare` (``moe_plan``),
  per call on the functional path (a copy of w13 per call: use a plan).
- **Activations.** ``silu`` -> ``ActivationType.Swiglu`` (``GLUAdaptor<SiLu>``:
  ``silu(gate) * up``); ``gelu`` -> ``Geglu`` (``GLUAdaptor<GELU>``, CUTLASS's erf GELU;
  ``GegluTanh`` is the tanh one); ``swiglu_oai`` -> ``SwigluBias``
  (``SwigluBiasAdaptor``: ``g = min(gate, limit)``, ``u = clamp(up, -limit, limit)``,
  ``g * sigmoid(alpha * g) * (u + beta)``) with per-local-expert float32
  ``swiglu_alpha = 1.702``, ``swiglu_beta = 1.0``, ``swiglu_limit = 7.0``: exactly our
  definition.
- **Biases.** The binding requires both biases when either is given and both in the output
  dtype (``CHECK_INPUT_TYPE(..., mOutputDtype)``): a missing one is zeros, a float32 one is
  rounded to x's dtype (a small deviation from the float32-bias contract).
- **Expert map.** FlashInfer takes ``ep_size``/``ep_rank`` (a contiguous slice of the global
  experts) only, but every kernel skips an id outside ``[start_expert, end_expert)``
  (``setLocalExperts``, the routing sort, ``finalizeMoeRoutingKernel``; the fused-finalize
  GEMM2 epilogue zeroes the output first). So an arbitrary ``expert_map`` is expressed on
  the device: ``local = expert_map[topk_ids]``, ``-1`` -> ``E_local`` (out of range), with
  ``ep_size = 1``. No host sync.
- **Alignment.** TMA needs 128-bit rows: ``H % 8 == 0`` and ``I % 8 == 0`` for 16-bit
  types (``min_alignment`` in the binding); the activation kernel also needs ``I % 8``.
- **Graph safety.** No ``.item()``/``.cpu()`` on the call path, but without a
  ``workspace_buffer`` the op allocates and frees its workspace on every call, and the
  autotuner may profile on first use: registered ``graph_safe=False`` until a device run
  shows capture works.
- **Determinism.** ``use_fused_finalize=True`` (FlashInfer's default) reduces the top-k
  outputs with atomics in the GEMM2 epilogue: results may differ run to run in the last bits.

- **Tactics.** FlashInfer picks the CUTLASS GEMM tactic by profiling only inside
  ``flashinfer.autotune()``; outside it a default tactic runs, 4.5-5x slower than
  ``triton_fused_moe`` at GPT-OSS shapes on the H100 (T = 8: 2.66 ms vs 0.52). So the first
  :meth:`~tokenspeed_kernel.MoEPlan.apply` of a plan runs under ``autotune(True)`` (FlashInfer
  then profiles every token bucket for these shapes: 78 s on the H100, once per process and
  shape set; later plans with the same shapes hit its cache), unless
  :data:`NO_AUTOTUNE_ENV` is set. The functional ``moe_apply`` path (no plan) never tunes.

Status: **verified on the H100** (2026-11-24, docs/history.md "FlashInfer CUTLASS MoE"):
``test_flashinfer_moe_gpu.py`` 27/27 (bf16 and fp16, every activation, biases, expert map,
plan and functional paths) and ``tokenspeed-kernel check moe.apply --preset awkward`` 22 passed,
0 failed, with FlashInfer's own module built off the device for sm_90
(``ci/device/flashinfer_moe_prebuild.py``: FlashInfer JIT-builds ~250 CUDA files on first
use, which did not finish in four calls on the 16-core device). Autotuned it is 18% slower
than ``triton_fused_moe`` at T = 1, 2-4% slower at T = 8-512 and 2% faster at T = 4096 (the
public bench; FlashInfer timed eagerly, Triton by graph replay), so it stays ``Priority.OPT_IN``.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from typing import Any

import torch

from tokenspeed_kernel import config
from tokenspeed_kernel.ops.moe.args import MoEApplyArgs
from tokenspeed_kernel.quant import FP8Weight, MXFP4Weight
from tokenspeed_kernel.registry import Priority, Request, register_kernel
from tokenspeed_kernel_nvidia.ops.attention._flashinfer import flashinfer_missing

__all__ = [
    "ACTIVATION_TYPES",
    "ARCHS",
    "FEATURES",
    "FLASHINFER_ARCHS",
    "NO_AUTOTUNE_ENV",
    "SWIGLU_OAI",
    "FlashInferCutlassWeights",
    "available",
    "flashinfer_cutlass_moe",
    "predicate",
    "prepare",
]

NAME = "flashinfer_cutlass_moe"
# Compute capabilities get_cutlass_fused_moe_module builds a module for (sm_107 -> "100"),
# and the one of them this kernel is registered for: the only one we have tried (H100).
FLASHINFER_ARCHS = ("sm_89", "sm_90", "sm_100", "sm_103", "sm_110", "sm_120", "sm_121")
ARCHS = ("sm_90",)
ACT_DTYPES = (torch.bfloat16, torch.float16)
FEATURES = ("silu", "gelu", "swiglu_oai", "bias", "expert_map")
# Our activation -> the name of FlashInfer's ``ActivationType`` member (tllm_enums.py).
ACTIVATION_TYPES = {"silu": "Swiglu", "gelu": "Geglu", "swiglu_oai": "SwigluBias"}
# SwigluBias parameters of our swiglu_oai (per local expert, float32).
SWIGLU_OAI = {"swiglu_alpha": 1.702, "swiglu_beta": 1.0, "swiglu_limit": 7.0}
ALIGNMENT = 8  # 128-bit TMA rows of 16-bit values
# Set to 1 to skip the autotuning of a plan's first call (FlashInfer's default tactic then runs).
NO_AUTOTUNE_ENV = "TOKENSPEED_KERNEL_FLASHINFER_NO_AUTOTUNE"


def available() -> str | None:
    """``available`` hook: flashinfer-python importable."""
    return flashinfer_missing()


def predicate(request: Request) -> str | None:
    """``H % 8 == I % 8 == 0``. Quantized formats (and with them activation_quant) are
    refused by the metadata (weight dtypes and features); the kernel's docstring says why."""
    for key in ("hidden", "intermediate"):
        size = request.shape(key)
        if size is not None and size % ALIGNMENT:
            return f"{key}={size} is not a multiple of {ALIGNMENT} (FlashInfer's CUTLASS MoE TMA alignment)"
    return None


@dataclass
class FlashInferCutlassWeights:
    """What :func:`prepare` makes of the public weights: FlashInfer's ``[up; gate]`` fc1,
    fc2 as is, both biases (or neither) in the weights' (= x's) dtype; ``tuned`` once the
    plan's first call has run under FlashInfer's autotuner."""

    fc1: torch.Tensor
    fc2: torch.Tensor
    fc1_bias: torch.Tensor | None
    fc2_bias: torch.Tensor | None
    tuned: bool = False


def _up_gate(t: torch.Tensor, inter: int, dim: int) -> torch.Tensor:
    """Our ``[gate; up]`` along ``dim`` as FlashInfer's ``[up; gate]`` (a new contiguous tensor)."""
    gate, up = t.narrow(dim, 0, inter), t.narrow(dim, inter, inter)
    return torch.cat((up, gate), dim=dim).contiguous()


def _convert(w13: Any, w2: Any, w13_bias: Any, w2_bias: Any) -> FlashInferCutlassWeights:
    if isinstance(w13, (MXFP4Weight, FP8Weight)) or isinstance(w2, (MXFP4Weight, FP8Weight)):
        raise TypeError(f"{NAME} takes plain bf16/fp16 weights only")
    inter = w2.shape[-1]
    dtype = w13.dtype
    fc1_bias = fc2_bias = None
    if w13_bias is not None or w2_bias is not None:
        num_experts, hidden = w2.shape[0], w2.shape[1]
        b13 = w13_bias if w13_bias is not None else w13.new_zeros((num_experts, 2 * inter))
        b2 = w2_bias if w2_bias is not None else w2.new_zeros((num_experts, hidden))
        fc1_bias = _up_gate(b13.to(dtype), inter, 1)
        fc2_bias = b2.to(dtype).contiguous()
    return FlashInferCutlassWeights(_up_gate(w13, inter, 1), w2.contiguous(), fc1_bias, fc2_bias)


def prepare(*, w13: Any, w2: Any, w13_bias: Any, w2_bias: Any, expert_map: Any) -> FlashInferCutlassWeights:
    """``moe_plan`` hook: the ``[up; gate]`` fc1 and the biases in x's dtype, made once."""
    del expert_map  # remapped per call on the device (topk_ids change every step)
    return _convert(w13, w2, w13_bias, w2_bias)


_activation_params: dict[tuple[torch.device, int], dict[str, torch.Tensor]] = {}


def _swiglu_oai_params(device: torch.device, num_experts: int) -> dict[str, torch.Tensor]:
    """The per-local-expert SwigluBias tensors (alpha, beta, limit), one set per device and E."""
    key = (device, num_experts)
    params = _activation_params.get(key)
    if params is None:
        params = {
            name: torch.full((num_experts,), value, dtype=torch.float32, device=device)
            for name, value in SWIGLU_OAI.items()
        }
        _activation_params[key] = params
    return params


def local_ids(topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_local: int) -> torch.Tensor:
    """int32 ids FlashInfer reads with ``ep_size = 1``: the global ids without a map; with a
    map the local id, and ``num_local`` (outside ``[0, num_local)``: skipped) for ``-1``."""
    if expert_map is None:
        return topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    local = expert_map[topk_ids.long()]
    return torch.where(local < 0, torch.full_like(local, num_local), local).to(torch.int32).contiguous()


@register_kernel(
    "moe.apply",
    name=NAME,
    solution="flashinfer",
    vendors=("cuda",),
    archs=ARCHS,
    dtypes={"x": ACT_DTYPES, "weight": ACT_DTYPES},
    features=FEATURES,
    priority=Priority.OPT_IN,
    predicate=predicate,
    available=available,
    prepare=prepare,
    graph_safe=False,
)
def flashinfer_cutlass_moe(args: MoEApplyArgs) -> None:
    """Plain bf16/fp16 weights only (FlashInfer's MXFP4 W4A16 needs its interleaved layout; its fp8 paths want fp8 activations); a plan's first call autotunes.

    ``flashinfer.cutlass_fused_moe`` on our layouts (see the module docstring)."""
    prepared = args.prepared
    if prepared is None:
        prepared = _convert(args.w13, args.w2, args.w13_bias, args.w2_bias)
    fi = importlib.import_module("flashinfer")
    num_local = prepared.fc2.shape[0]
    ids = local_ids(args.topk_ids, args.expert_map, num_local)
    weights = args.topk_weights if args.topk_weights.is_contiguous() else args.topk_weights.contiguous()
    x = args.x if args.x.is_contiguous() else args.x.contiguous()
    out = args.out if args.out.is_contiguous() else torch.empty_like(x)
    extra = _swiglu_oai_params(x.device, num_local) if args.activation == "swiglu_oai" else {}
    tune = args.prepared is not None and not prepared.tuned and not config.env_flag(NO_AUTOTUNE_ENV)
    with fi.autotune(True) if tune else contextlib.nullcontext():
        _run(fi, x, ids, weights, prepared, out, args.activation, extra)
    if tune:
        prepared.tuned = True
    if out is not args.out:
        args.out.copy_(out)


def _run(
    fi: Any,
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    prepared: FlashInferCutlassWeights,
    out: torch.Tensor,
    activation: str,
    extra: dict[str, torch.Tensor],
) -> None:
    fi.cutlass_fused_moe(
        x,
        ids,
        weights,
        prepared.fc1,
        prepared.fc2,
        x.dtype,
        None,
        fc1_expert_biases=prepared.fc1_bias,
        fc2_expert_biases=prepared.fc2_bias,
        ep_size=1,
        ep_rank=0,
        output=out,
        activation_type=getattr(fi.ActivationType, ACTIVATION_TYPES[activation]),
        **extra,
    )
