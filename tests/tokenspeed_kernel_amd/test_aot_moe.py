"""The Gluon MXFP4 MoE kernels compile ahead of time for gfx942 and gfx950 at the GPT-OSS-120B
shapes (H = I = 2880, top-4, swiglu_oai, biases, expert map), both byte orders: grouped GEMMs
on MFMA, warp-decode GEMVs on the vector ALUs; no spills, budgets kept. For
``activation_quant="mxfp8"``: the quantize-dequantize variants on both archs and, on gfx950,
the MXFP8 x MXFP4 grouped GEMMs on the scaled MFMA (``v_mfma_scale_f32_16x16x128_f8f6f4``)."""

from __future__ import annotations

import pytest
from tokenspeed_kernel_dev.aot_amd import SCALED_MFMA, CompileReport, run_sweep

ARCHS = ("gfx942", "gfx950")
# 7 kernels without activation quantization + 3 quantize-dequantize variants; gfx950 adds the
# e4m3 quantizer and the two scaled-MFMA GEMMs.
COUNTS = {"gfx942": 10, "gfx950": 13}


def assert_within_budget(report: CompileReport) -> None:
    assert report.ok, f"{report.kernel} on {report.arch} did not compile: {report.error}"
    assert not report.problems(), report.problems()
    assert report.vgprs > 0, f"{report.kernel}: no .vgpr_count in the AMDGCN metadata"
    print(
        f"{report.arch} {report.kernel}: mfma={report.mfma} lds={report.lds_bytes} vgprs={report.vgprs} agprs={report.agprs}"
    )


def assert_mfma(report: CompileReport) -> None:
    assert not report.mfma_problems(), report.mfma_problems()


@pytest.fixture(scope="module")
def reports():
    """Compiled once per module, in a subprocess without TRITON_INTERPRET."""
    reports = run_sweep(list(ARCHS), ("moe",))
    return {arch: {r.kernel: r for r in reports if r.arch == arch} for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_every_moe_kernel_compiles_within_budget(reports, arch):
    assert len(reports[arch]) == COUNTS[arch], sorted(reports[arch])
    for report in reports[arch].values():
        assert_within_budget(report)


@pytest.mark.parametrize("arch", ARCHS)
def test_grouped_gemm_runs_on_mfma(reports, arch):
    gemms = [r for name, r in reports[arch].items() if name.startswith("moe_gemm[")]
    assert len(gemms) == 4
    for report in gemms:
        assert_mfma(report)
        # w13 has two accumulators (gate, up): twice the MFMAs of w2 per K step
    w13 = reports[arch]["moe_gemm[w13 bf16 halves]"]
    w2 = reports[arch]["moe_gemm[w2 bf16 halves]"]
    assert w13.mfma_count == 2 * w2.mfma_count


@pytest.mark.parametrize("arch", ARCHS)
def test_warp_decode_gemvs_need_no_lds_or_mfma(reports, arch):
    """The tiny-batch GEMVs are memory bound: vector ALU only, no LDS round trip."""
    gemvs = [r for name, r in reports[arch].items() if name.startswith("moe_gemv")]
    assert len(gemvs) == 5
    for report in gemvs:
        assert not report.mfma, report.mfma
        # the mxfp8 variant reduces |a| over its 32 columns across warps: a few bytes of LDS
        assert report.lds_bytes <= (64 if "mxfp8" in report.kernel else 0), report.lds_bytes


@pytest.mark.parametrize("arch", ARCHS)
def test_mxfp8_quantize_dequantize_path_keeps_the_16bit_mfma(reports, arch):
    """activation_quant='mxfp8' on amd_gluon_moe_mxfp4 (both archs): same MFMAs as without it."""
    quant = reports[arch]["moe_gemm[w13 bf16 halves mxfp8]"]
    plain = reports[arch]["moe_gemm[w13 bf16 halves]"]
    assert quant.mfma == plain.mfma
    assert not reports[arch]["mxfp8_quant[bf16 fake]"].mfma


def test_scaled_mfma_gemm_on_gfx950(reports):
    """The MXFP8 x MXFP4 grouped GEMMs issue only scaled MFMAs: per 128-deep K step a warp's
    16 x 32 share of the 32 x 64 tile is 2 instructions per accumulator (w13: gate + up)."""
    w13 = reports["gfx950"]["moe_scaled_gemm[w13 e4m3 x e2m1]"]
    w2 = reports["gfx950"]["moe_scaled_gemm[w2 e4m3 x e2m1]"]
    for report in (w13, w2):
        assert_within_budget(report)
        assert not report.scaled_mfma_problems(), report.scaled_mfma_problems()
        assert report.scaled_mfma_count == report.mfma_count > 0
        assert report.lds_bytes <= 16 * 1024  # operand layout conversions only
    assert SCALED_MFMA == "v_mfma_scale_f32_16x16x128_f8f6f4"
    assert w13.mfma_count == 2 * w2.mfma_count == 4
    assert not any(name.startswith("moe_scaled") for name in reports["gfx942"])  # no scaled MFMA on CDNA3
