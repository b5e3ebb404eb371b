"""The Gluon attention kernels compile ahead of time for gfx942 and gfx950 (no GPU needed)
over the configurations the launch code can choose; the AMDGCN has the MFMA instructions of
each arch, no spills or scratch, LDS within the arch's limit and VGPRs within budget."""

from __future__ import annotations

import pytest
from tokenspeed_kernel_dev.aot_amd import CompileReport, run_sweep
from tokenspeed_kernel_dev.aot_amd_attention import AOT_CONFIGS

ARCHS = ("gfx942", "gfx950")


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
    """Every (arch, config) compiled once per module, in a subprocess without TRITON_INTERPRET."""
    by_name = {(r.arch, r.kernel): r for r in run_sweep(list(ARCHS), ("attention",))}
    return {(arch, cfg): by_name[(arch, cfg.name)] for arch in ARCHS for cfg in AOT_CONFIGS} | {
        (arch, "combine"): next(r for (a, name), r in by_name.items() if a == arch and name.startswith("combine"))
        for arch in ARCHS
    }


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cfg", AOT_CONFIGS, ids=lambda c: c.name)
def test_attention_compiles_within_budget(reports, arch, cfg):
    report = reports[(arch, cfg)]
    assert_within_budget(report)
    assert_mfma(report)
    dtype = "f16" if "float16" in cfg.name.split()[2] and "bfloat16" not in cfg.name else "bf16"
    assert all(name.endswith("_" + dtype) for name in report.mfma), report.mfma


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_uses_more_matrix_work_than_decode(reports, arch):
    """Prefill tiles (128 rows x 64 keys) issue more MFMAs per key tile than decode (16 rows)."""
    decode = reports[(arch, AOT_CONFIGS[0])]
    prefill = next(reports[(arch, c)] for c in AOT_CONFIGS if c.regime == "prefill" and c.head_dim == 64)
    assert prefill.mfma_count > decode.mfma_count


@pytest.mark.parametrize("arch", ARCHS)
def test_gfx950_lds_layout_differs(reports, arch):
    """LDS staging is per arch (swizzled on gfx942, padded on gfx950): padding costs bytes."""
    decode = reports[(arch, AOT_CONFIGS[0])]
    assert 0 < decode.lds_bytes <= (64 if arch == "gfx942" else 160) * 1024


@pytest.mark.parametrize("arch", ARCHS)
def test_combine_compiles(reports, arch):
    report = reports[(arch, "combine")]
    assert_within_budget(report)
    assert not report.mfma  # a reduction over splits: no matrix work
