"""The example's lean plain-PyTorch glue (``examples.gpt_oss.model``: ``rms_norm``,
``rope_inv_freq`` / ``rope_tables`` / ``apply_rope``) against the formulas it replaced
(transcribed below as they were) and against float64, on awkward shapes: odd token counts,
GQA head counts (q and k rotated together), head dims that are not a power of two, large
positions, rows of a fused qkv with their own stride; and its aten operator counts (on a
GPU too: the same checks on CUDA tensors, and the CUDA kernels each piece launches).
"""

from __future__ import annotations

import collections
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from examples.gpt_oss.model import apply_rope, rms_norm, rope_inv_freq, rope_tables

DTYPES = [torch.bfloat16, torch.float32]
IDS = ["bf16", "fp32"]
_NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA glue needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, _NO_CUDA])]
# (tokens, q heads, kv heads, head dim)
ROPE_SHAPES = [(1, 4, 2, 64), (7, 6, 2, 64), (33, 8, 1, 10), (5, 3, 3, 2)]
NORM_SHAPES = [(1, 2880), (7, 64), (33, 33), (5, 1)]
_ULP = {torch.bfloat16: 2.0**-7, torch.float32: 2.0**-23}  # spacing of values in [1, 2)


def _old_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The example's RMSNorm before the lean glue."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def _old_apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """The example's rotary embedding before the lean glue (tables rebuilt on every call)."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def _old_tables(positions: torch.Tensor, half: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The old formula's float32 ``cos``/``sin`` ``[T, D/2]`` (on positions' device)."""
    inv_freq = theta ** (-torch.arange(half, device=positions.device, dtype=torch.float32) / half)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def _within_rounding(got: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor, what: str) -> None:
    """``got`` (bf16 or fp32) is ``ref`` (float64) rounded once to got's dtype, up to float32
    rounding of the intermediate terms, whose magnitudes sum to ``scale``."""
    assert got.shape == ref.shape, what
    bound = _ULP[got.dtype] / 2 * ref.abs() + 8 * 2.0**-24 * scale + 1e-30
    err = (got.double() - ref).abs()
    worst = float((err / bound).max())
    assert worst <= 1.0, f"{what}: error {worst:.2f}x the rounding bound"


def _positions(t: int, gen: torch.Generator, device: str = "cpu") -> torch.Tensor:
    """int64 positions ``[t]`` on ``device``: 0 first, then up to 2^17 (large angles)."""
    pos = torch.randint(0, 1 << 17, (t,), generator=gen)
    pos[0] = 0
    return pos.to(device)


class _Ops(TorchDispatchMode):
    """The aten operators that do work (views and bare allocations left out)."""

    _NO_WORK = (torch.ops.aten.empty_like.default, torch.ops.aten.empty.memory_format)

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if not func.is_view and func not in self._NO_WORK:
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("theta", [10000.0, 150000.0])
@pytest.mark.parametrize("d", [2, 10, 64])
def test_rope_tables_are_the_old_formulas_float32_tables(d, theta, device):
    """cos in both halves and the sign-folded sin are the old formula's float32 values: bit for
    bit on the CPU; on CUDA within one float32 unit (``cos(-a)``, ``sin(-a)`` of the negated
    first half need not be bitwise symmetric there)."""
    pos = _positions(19, torch.Generator().manual_seed(d), device)
    cos, sin = rope_tables(pos, rope_inv_freq(d, theta, device))
    assert cos.shape == sin.shape == (19, 1, d) and cos.dtype == sin.dtype == torch.float32
    old_cos, old_sin = _old_tables(pos, d // 2, theta)
    want = (torch.cat([old_cos, old_cos], -1), torch.cat([-old_sin, old_sin], -1))
    for got, ref in zip((cos[:, 0], sin[:, 0]), want):
        if device == "cpu":
            assert torch.equal(got, ref)
        else:
            assert bool(((got - ref).abs() <= 2.0**-23 * ref.abs() + 2.0**-126).all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("shape", ROPE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_rope_of_fused_qk_in_place_matches_float64_and_the_old_formula(shape, dtype, device):
    """q and k rotated together, in place in a fused qkv's rows (row stride of q + 2 kv heads),
    against the old formula evaluated in float64 from its float32 tables, and against the old
    formula itself (at most one unit in the last place apart, where the two round differently);
    the v columns are untouched."""
    t, hq, hkv, d = shape
    theta = 150000.0
    gen = torch.Generator().manual_seed(t * 131 + d)
    pos = _positions(t, gen, device)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to(device, dtype)
    before = qkv.clone()
    qk = qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d)
    assert t == 1 or not qk.is_contiguous()
    tables = rope_tables(pos, rope_inv_freq(d, theta, device))
    out = apply_rope(qk, *tables, out=qk)
    assert out.data_ptr() == qkv.data_ptr()
    assert torch.equal(qkv[:, (hq + hkv) * d :], before[:, (hq + hkv) * d :]), "v columns changed"

    x = before[:, : (hq + hkv) * d].view(t, hq + hkv, d)
    cos, sin = (c.double()[..., d // 2 :] for c in tables)  # the old float32 tables (the test above)
    x1, x2 = x[..., : d // 2].double(), x[..., d // 2 :].double()
    ref = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    scale = torch.cat([(x1 * cos).abs() + (x2 * sin).abs()] * 2, dim=-1)
    _within_rounding(qk, ref, scale, f"rope {shape} {dtype}")

    old = _old_apply_rope(x, pos, theta)
    apart = (qk.double() - old.double()).abs()
    assert bool((apart <= _ULP[dtype] * old.double().abs() + 8 * 2.0**-24 * scale).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_rope_into_a_new_tensor_leaves_x_and_equals_in_place(dtype):
    gen = torch.Generator().manual_seed(5)
    pos = _positions(9, gen)
    x = torch.randn(9, 5, 64, generator=gen).to(dtype)
    tables = rope_tables(pos, rope_inv_freq(64, 10000.0, "cpu"))
    keep = x.clone()
    y = apply_rope(x, *tables)
    assert torch.equal(x, keep) and y.dtype == dtype and y.shape == x.shape
    assert torch.equal(apply_rope(x, *tables, out=x), y)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_rms_norm_matches_float64_and_the_old_formula(shape, dtype, device):
    t, h = shape
    gen = torch.Generator().manual_seed(t + h)
    x = (torch.randn(t, h, generator=gen) * 3).to(device, dtype)
    x[0, 0] = 0.0
    w = (1.0 + 0.1 * torch.randn(h, generator=gen)).to(device, dtype)
    eps = 1e-5
    got = rms_norm(x, w, eps)
    assert got.dtype == dtype and got.shape == x.shape
    x64, w64 = x.double(), w.double()
    ref = x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + eps) * w64
    scale = ref.abs() * (1 + math.log2(h))  # float32 sums of h squares (any order, e.g. CUDA's fused kernel)
    _within_rounding(got, ref, scale, f"rms_norm {shape} {dtype}")
    old = _old_rms_norm(x, w, eps)
    apart = (got.double() - old.double()).abs()
    assert bool((apart <= _ULP[dtype] * old.double().abs() + 8 * 2.0**-24 * scale).all())


def test_the_glue_launches_few_aten_ops():
    """Per forward pass 3 ops of rotary tables; per layer 3 ops to rotate q and k together in
    place (the old formula: 18 per call, twice per layer); RMSNorm no more than the old 9 (on
    CUDA ``F.rms_norm`` is one fused kernel; here torch's composite)."""
    gen = torch.Generator().manual_seed(0)
    pos = _positions(3, gen)
    qk = torch.randn(3, 6, 64, generator=gen).to(torch.bfloat16)
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    w = torch.ones(64, dtype=torch.bfloat16)
    inv_freq = rope_inv_freq(64, 10000.0, "cpu")
    with _Ops() as tables:
        cos, sin = rope_tables(pos, inv_freq)
    with _Ops() as rope:
        apply_rope(qk, cos, sin, out=qk)
    with _Ops() as old_rope:
        _old_apply_rope(qk, pos, 10000.0)
    with _Ops() as norm:
        rms_norm(x, w, 1e-5)
    with _Ops() as old_norm:
        _old_rms_norm(x, w, 1e-5)
    assert sum(tables.ops.values()) == 3, tables.ops
    assert sum(rope.ops.values()) == 3, rope.ops
    assert sum(old_rope.ops.values()) == 18, old_rope.ops
    assert sum(norm.ops.values()) <= sum(old_norm.ops.values()) == 9, (norm.ops, old_norm.ops)


@pytest.mark.gpu
@_NO_CUDA
def test_on_cuda_the_glue_launches_one_kernel_per_rms_norm_and_three_per_rotation():
    """CUDA kernels (torch.profiler) at GPT-OSS widths, B = 1: ``F.rms_norm`` is torch's fused
    RMSNorm (one kernel; two where the row cannot be vectorized), the rotary tables and the
    rotation of q and k three each."""
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2880, generator=gen).to("cuda", torch.bfloat16)
    w = torch.ones(2880, dtype=torch.bfloat16, device="cuda")
    qkv = torch.randn(1, 80 * 64, generator=gen).to("cuda", torch.bfloat16)
    qk = qkv[:, : 72 * 64].view(1, 72, 64)
    pos = _positions(1, gen, "cuda")
    inv_freq = rope_inv_freq(64, 150000.0, "cuda")
    cos, sin = rope_tables(pos, inv_freq)

    def kernels(fn) -> list[str]:  # type: ignore[no-untyped-def]
        fn()  # warm-up
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]

    norm = kernels(lambda: rms_norm(x, w, 1e-5))
    assert 1 <= len(norm) <= 2, norm
    assert len(kernels(lambda: rope_tables(pos, inv_freq))) == 3
    assert len(kernels(lambda: apply_rope(qk, cos, sin, out=qk))) == 3
