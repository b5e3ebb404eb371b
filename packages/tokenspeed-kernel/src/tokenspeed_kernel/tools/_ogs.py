"""The ``matmul_ogs`` baselines of ``moe.apply``: OpenAI's ``triton_kernels`` MoE GEMMs, the
peer vLLM runs for GPT-OSS MXFP4 experts on Hopper, timed on the same MXFP4 weights.

A peer library, never a dependency: used when importable, resolved as ``import
triton_kernels`` if that works, else from vLLM's vendored copy
(``vllm/third_party/triton_kernels``, found with ``importlib.util.find_spec("vllm")``
without importing vLLM, and loaded as the top-level package ``triton_kernels``, which is how
that copy imports itself; its sibling packages are not put on ``sys.path``), else the
baseline's row says :data:`NOT_INSTALLED`. It is driven as vLLM 0.33.0 drives that copy (the
3.5.1-style API), MXFP4 weights with bf16 activations only:

- weights: our ``w13`` ``[E, 2I, H]`` holds gate rows ``n`` then up rows ``I + n``; the fused
  swiglu of ``matmul_ogs`` reads (gate, up) pairs of adjacent columns, so the rows (packed
  values, scales and ``w13_bias [E, 2I]``) are interleaved: gate ``n`` at ``2n``, up ``n`` at
  ``2n + 1``. Packed uint8 ``[E, N, K/2]`` and E8M0 scales ``[E, N, K/32]`` are viewed as
  ``[E, K, N]`` (the mx axis 1) and swizzled into the device's default layouts
  (``make_default_matmul_mxfp4_w_layout(mx_axis=1)`` and its scale layout, 8 warps). On
  sm_90 the scales' K is padded to a multiple of 4 and ``split_k`` is pinned to 1, as vLLM
  does there. Biases in float32.
- activation: ``FusedActivation(FnSpecs("swiglu", swiglu_fn, ("alpha", "limit")), (1.702,
  7.0), 2)``, our ``swiglu_oai``.
- GEMM 1 gathers each routed pair's row of ``x``, adds the bias and applies the activation
  (``[T·k, I]`` bf16); GEMM 2 adds the bias, scales each row by its routing weight (the
  gammas, bf16 as vLLM passes them) and sums each token's ``k`` rows into ``out [T, H]`` bf16.

Two rows, neither with the router's top-k (our kernel rows are given ``topk_ids`` and
``topk_weights`` too): ``matmul_ogs+sort`` builds its routing metadata (a bit matrix of the
ids, the per-expert histogram, expert-sorted gather/scatter indices and gammas) from our
``topk_ids``/``topk_weights`` inside the timed call, the work our kernels do inside theirs;
``matmul_ogs-presorted`` builds it once in ``prepare`` and times the two GEMMs and the
combine only.

``bench`` does not check baselines, so ``prepare`` runs each one once and compares the rows
of a few tokens with the float64 reference (:func:`.cases.reference` on those tokens and the
experts they hit): above :data:`MAX_REL_L2` the row gives that as its reason instead of a
time; otherwise the runner's ``note`` (shown on the row) gives the rel-l2.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from tokenspeed_kernel.quant import MXFP4Weight
from tokenspeed_kernel.tools import cases
from tokenspeed_kernel.tools.tolerances import Tolerance, compare

__all__ = ["MAX_REL_L2", "NOT_INSTALLED", "interleave_gate_up", "mx_weight", "prepare_presorted", "prepare_sorting"]

NOT_INSTALLED = "triton_kernels not installed (pip install triton_kernels, or vLLM's vendored copy)"
MAX_REL_L2 = 1e-2
_CHECK_TOKENS = 4  # tokens compared with the float64 reference (<= 4k experts dequantized to float64)
_SWIGLU_OAI = (1.702, 7.0)  # alpha, limit of reference.moe's swiglu_oai
_SCALE_WARPS = 8  # the warps the Hopper scale layout is swizzled for (vLLM's choice)

# (module, names) the baseline uses: all resolved up front, so a copy with another API is a
# reason on the row, not an error in the middle of a run.
_API = (
    ("triton_kernels.matmul_ogs", ("matmul_ogs", "FnSpecs", "FusedActivation", "PrecisionConfig")),
    ("triton_kernels.matmul_ogs_details.opt_flags", ("update_opt_flags_constraints",)),
    ("triton_kernels.swiglu", ("swiglu_fn",)),
    ("triton_kernels.routing", ("routing_from_bitmatrix",)),
    ("triton_kernels.tensor", ("Bitmatrix", "FP4", "convert_layout", "wrap_torch_tensor")),
    (
        "triton_kernels.tensor_details.layout",
        ("make_default_matmul_mxfp4_w_layout", "make_default_matmul_mxfp4_w_scale_layout"),
    ),
)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).splitlines()
    return f"{type(exc).__name__}: {lines[0][:80] if lines else ''}"


def _load_vendored() -> str | None:
    """Load vLLM's vendored copy as the top-level package ``triton_kernels`` (vLLM not
    imported); None when loaded, else why not."""
    spec = importlib.util.find_spec("vllm")
    for root in (spec.submodule_search_locations or []) if spec else []:
        package = Path(root) / "third_party" / "triton_kernels"
        if not (package / "__init__.py").is_file():
            continue
        found = importlib.util.spec_from_file_location(
            "triton_kernels", package / "__init__.py", submodule_search_locations=[str(package)]
        )
        if found is None or found.loader is None:  # a .py path always gets a spec with a loader
            continue
        module = importlib.util.module_from_spec(found)
        sys.modules["triton_kernels"] = module
        try:
            found.loader.exec_module(module)
        except Exception:
            del sys.modules["triton_kernels"]
            raise
        return None
    return NOT_INSTALLED


@functools.cache
def triton_kernels_api() -> SimpleNamespace | str:
    """The names of :data:`_API` from ``triton_kernels`` (resolved as the module docstring
    says), or a one-line reason why it cannot be used."""
    try:
        try:
            importlib.import_module("triton_kernels")
        except ImportError:
            why = _load_vendored()
            if why:
                return why
        names = {}
        for module_name, attrs in _API:
            module = importlib.import_module(module_name)
            names.update({attr: getattr(module, attr) for attr in attrs})
    except Exception as exc:  # an optional peer: any failure to import it is a row's reason
        where = getattr(sys.modules.get("triton_kernels"), "__file__", None) or "?"
        return f"triton_kernels ({where}) cannot serve this baseline (3.5.1-style API): {_first_line(exc)}"
    return SimpleNamespace(**names)


def interleave_gate_up(t: torch.Tensor) -> torch.Tensor:
    """``[E, 2I, ...]`` with gate rows ``0..I-1`` then up rows ``I..2I-1`` -> the same shape with
    gate ``n`` at row ``2n`` and up ``n`` at ``2n + 1`` (a new contiguous tensor)."""
    e, rows = t.shape[:2]
    return t.reshape(e, 2, rows // 2, *t.shape[2:]).transpose(1, 2).reshape(t.shape)


def mx_weight(
    tk: SimpleNamespace,
    w: MXFP4Weight,
    value_layout: tuple[type, dict[str, Any]],
    scale_layout: tuple[type, dict[str, Any]],
    *,
    interleave: bool,
    pad_scales: bool,
) -> tuple[Any, Any]:
    """``w`` (packed ``[E, N, K/2]``, scales ``[E, N, K/32]``) as ``matmul_ogs`` weights: the FP4
    value tensor of logical shape ``[E, K, N]`` and the scale tensor ``[E, K/32 (padded to a
    multiple of 4 when pad_scales), N]``, both quantized along axis 1 and converted to the
    given ``(layout class, kwargs)``. ``interleave``: gate/up rows interleaved first."""
    packed, scales = w.packed, w.scales
    if interleave:
        packed, scales = interleave_gate_up(packed), interleave_gate_up(scales)
    if pad_scales:
        scales = F.pad(scales, (0, -scales.shape[-1] % 4))
    value = tk.wrap_torch_tensor(packed.transpose(-2, -1), dtype=tk.FP4)
    scale = tk.wrap_torch_tensor(scales.transpose(-2, -1))
    return (
        tk.convert_layout(value, value_layout[0], **value_layout[1]),
        tk.convert_layout(scale, scale_layout[0], **scale_layout[1]),
    )


def _unsupported(case: cases.MoECase, inputs: dict[str, Any]) -> str | None:
    checks = (
        (inputs.get("expert_map") is not None, "no expert_map in this baseline"),
        (case.num_tokens == 0, "no tokens"),
        (case.weight_format != "mxfp4", "MXFP4 weights only (the format vLLM runs it with)"),
        (case.activation != "swiglu_oai", "swiglu_oai only"),
        (case.dtype != torch.bfloat16, "bf16 activations only"),
        (case.activation_quant is not None, "bf16 activations only (no activation quantization)"),
        (case.hidden % 64 or case.intermediate % 64, "needs H and I multiples of 64 (vLLM pads I to 64)"),
        (case.top_k & (case.top_k - 1), "top_k a power of two only (its routing kernel's tile)"),
    )
    return next((why for bad, why in checks if bad), None)


@dataclasses.dataclass(frozen=True)
class _Weights:
    w13: Any
    w2: Any
    pc13: Any  # PrecisionConfig with the w13 scales
    pc2: Any
    b13: torch.Tensor | None  # float32 [E, 2I], interleaved
    b2: torch.Tensor | None  # float32 [E, H]


def _weights(
    tk: SimpleNamespace,
    inputs: dict[str, Any],
    layouts: tuple[tuple[type, dict[str, Any]], tuple[type, dict[str, Any]]],
    pad_scales: bool,
) -> _Weights:
    """A case's MXFP4 weights and biases as ``matmul_ogs`` takes them (see :func:`mx_weight`);
    ``layouts``: the (value, scale) layouts as ``(class, kwargs)``."""
    w13, s13 = mx_weight(tk, inputs["w13"], *layouts, interleave=True, pad_scales=pad_scales)
    w2, s2 = mx_weight(tk, inputs["w2"], *layouts, interleave=False, pad_scales=pad_scales)
    b13, b2 = inputs.get("w13_bias"), inputs.get("w2_bias")
    return _Weights(
        w13,
        w2,
        tk.PrecisionConfig(weight_scale=s13),
        tk.PrecisionConfig(weight_scale=s2),
        None if b13 is None else interleave_gate_up(b13.float()),
        None if b2 is None else b2.float().contiguous(),
    )


def _device_weights(tk: SimpleNamespace, inputs: dict[str, Any], device: torch.device) -> _Weights:
    """:func:`_weights` in the device's default layouts; on sm_90 with the scales padded and
    ``split_k`` pinned to 1 (a process-wide constraint of ``triton_kernels``), as vLLM does."""
    hopper = torch.cuda.get_device_capability(device)[0] == 9
    if hopper:
        tk.update_opt_flags_constraints({"split_k": 1})
    layouts = (
        tk.make_default_matmul_mxfp4_w_layout(mx_axis=1),
        tk.make_default_matmul_mxfp4_w_scale_layout(mx_axis=1, num_warps=_SCALE_WARPS),
    )
    return _weights(tk, inputs, layouts, pad_scales=hopper)


def _routing(tk: SimpleNamespace, ids: torch.Tensor, weights: torch.Tensor, num_experts: int) -> tuple[Any, ...]:
    """``matmul_ogs``'s (RoutingData, GatherIndx, ScatterIndx) from our ``ids`` int32 ``[T, k]``
    and ``weights`` float32 ``[T, k]``: a bit matrix (one bit per (token, expert), uint32 words
    ``[T, ceil(E/32)]``) built with torch ops, then its ``routing_from_bitmatrix``. No host
    synchronization, so it can be captured in a CUDA graph."""
    t, k = ids.shape
    words = -(-num_experts // 32)
    ids64 = ids.long()
    bits = torch.zeros(t, words, dtype=torch.int64, device=ids.device)
    bits.scatter_add_(1, ids64 // 32, torch.ones_like(ids64) << (ids64 % 32))  # distinct ids: add == or
    bits = (bits - ((bits >> 31) << 32)).to(torch.int32).view(torch.uint32)  # the low 32 bits
    matrix = tk.Bitmatrix(bits, shape=[t, words * 32], shape_max=[t, None], scratchpad=None)
    return tk.routing_from_bitmatrix(matrix, weights.to(torch.bfloat16), ids.to(torch.int16), num_experts, k)


def _experts(
    tk: SimpleNamespace, w: _Weights, x: torch.Tensor, k: int, inter: int
) -> Callable[[tuple[Any, ...]], torch.Tensor]:
    """The two GEMMs on routing ``(RoutingData, GatherIndx, ScatterIndx)`` -> out ``[T, H]``."""
    t, h = x.shape
    act = tk.FusedActivation(tk.FnSpecs("swiglu", tk.swiglu_fn, ("alpha", "limit")), _SWIGLU_OAI, 2)
    mid = torch.empty(1, t * k, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(1, t, h, dtype=x.dtype, device=x.device)

    def run(routing: tuple[Any, ...]) -> torch.Tensor:
        data, gather, scatter = routing
        tk.matmul_ogs(x, w.w13, w.b13, data, gather_indx=gather, precision_config=w.pc13, fused_activation=act, y=mid)
        tk.matmul_ogs(
            mid.view(t * k, inter),
            w.w2,
            w.b2,
            data,
            scatter_indx=scatter,
            precision_config=w.pc2,
            gammas=data.gate_scal,
            y=out,
        )
        return out.view(t, h)

    return run


def _checked(case: cases.MoECase, inputs: dict[str, Any], run: Callable[[], torch.Tensor]) -> Callable[[], Any] | str:
    """``run`` with a ``note`` giving its rel-l2 against the float64 reference on a few
    tokens (first, last, evenly spaced between), or the reason it is not timed."""
    out = run()
    rows = torch.linspace(0, case.num_tokens - 1, min(case.num_tokens, _CHECK_TOKENS)).round().long().unique()
    rows = rows.to(inputs["x"].device)
    ids = inputs["topk_ids"][rows]
    hit = ids.unique()  # sorted
    w13, w2 = inputs["w13"], inputs["w2"]
    sub = {
        **inputs,
        "x": inputs["x"][rows],
        "w13": MXFP4Weight(w13.packed[hit], w13.scales[hit]),
        "w2": MXFP4Weight(w2.packed[hit], w2.scales[hit]),
        "topk_ids": torch.searchsorted(hit, ids).to(torch.int32),
        "topk_weights": inputs["topk_weights"][rows],
        "w13_bias": None if inputs.get("w13_bias") is None else inputs["w13_bias"][hit],
        "w2_bias": None if inputs.get("w2_bias") is None else inputs["w2_bias"][hit],
    }
    sub_case = dataclasses.replace(case, num_tokens=len(rows), num_experts=len(hit), top_k=ids.shape[1])
    ref, _ = cases.reference(sub_case, sub)
    got = compare(out[rows], ref, Tolerance(MAX_REL_L2, float("inf")))
    if not got.passed:
        return f"disagrees with float64 on {len(rows)} tokens: rel-l2 {got.rel_l2:.2e} > {MAX_REL_L2:g}, not timed"
    note = f"rel-l2 {got.rel_l2:.1e} vs float64 on {len(rows)} of {case.num_tokens} tokens"
    # A function attribute the bench reads (getattr(runner, "note", "")): a wrapper object
    # would add a Python call to the timed path of this baseline.
    run.note = note  # type: ignore[attr-defined]
    return run


def _prepare(
    presorted: bool, case: cases.MoECase, inputs: dict[str, Any], device: torch.device
) -> Callable[[], Any] | str:
    why = _unsupported(case, inputs)
    if why is not None:
        return why
    tk = triton_kernels_api()
    if isinstance(tk, str):
        return tk
    if device.type != "cuda":
        return "needs a CUDA device"
    x, ids, weights = inputs["x"], inputs["topk_ids"], inputs["topk_weights"]
    num_experts = case.num_local_experts
    try:
        experts = _experts(tk, _device_weights(tk, inputs, device), x.contiguous(), case.top_k, case.intermediate)
        if presorted:
            routing = _routing(tk, ids, weights, num_experts)

            def run():
                return experts(routing)
        else:

            def run():
                return experts(_routing(tk, ids, weights, num_experts))

        return _checked(case, inputs, run)
    except Exception as exc:  # a peer's failure is a row's reason, not the end of the run
        return f"matmul_ogs cannot run: {_first_line(exc)}"


prepare_sorting = functools.partial(_prepare, False)
prepare_presorted = functools.partial(_prepare, True)
