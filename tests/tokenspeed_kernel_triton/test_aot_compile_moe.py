"""The MoE kernels compile ahead of time for sm_90, gfx942 and gfx950 (no GPU needed) over
the tiles the launch table can choose and every weight format; the grouped GEMMs use the
matrix units (``mma``/``wgmma`` in PTX, Hopper's ``wgmma`` at the prefill tile; ``v_mfma``
in AMDGCN), fit shared memory and do not spill. The ``tl.dot_scaled`` GEMM of
``triton_fused_moe_mx`` (which the interpreter cannot run) builds at every tile of its
table, split-K and public-scale variants included, on all three targets. Runs
``python -m tokenspeed_kernel_triton.ops.moe._aot`` in subprocesses without TRITON_INTERPRET
(the interpreter replaces the kernels in this process)."""

import pytest
from support.aot import run_aot

from tokenspeed_kernel_triton.ops.moe._config import tiles_for

TARGETS = ("cuda:90", "hip:gfx942", "hip:gfx950")
SHARED_LIMIT = {"cuda:90": 227 * 1024, "hip:gfx942": 64 * 1024, "hip:gfx950": 160 * 1024}


@pytest.fixture(scope="module")
def results():
    runs = run_aot("tokenspeed_kernel_triton.ops.moe._aot", [[target] for target in TARGETS])
    return [row for run in runs for row in run.rows]


@pytest.mark.parametrize("target", TARGETS)
def test_every_moe_kernel_builds(results, target):
    mine = [r for r in results if r["target"] == target]
    failed = [f"{r['kernel']}: {r['error']}" for r in mine if not r["ok"]]
    assert not failed, "\n".join(failed)
    assert len(mine) >= 16
    assert {"moe_align", "moe_combine", "moe_topk"} <= {r["kernel"] for r in mine}


@pytest.mark.parametrize("target", TARGETS)
def test_moe_gemms_use_matrix_units_and_fit(results, target):
    for r in results:
        if r["target"] != target:
            continue
        assert r["shared_bytes"] <= SHARED_LIMIT[target], r
        assert r["spills"] == 0, r
        if r["kernel"].startswith(("moe_gemm[", "moe_mx_gemm[")):
            assert r["matrix_instructions"] > 0, f"{r['kernel']} on {target}: no mma/mfma instruction"


def test_hopper_prefill_tiles_use_wgmma(results):
    prefill = [r for r in results if r["target"] == "cuda:90" and "-m128n" in r["kernel"]]
    assert prefill, "no prefill-tile compile for sm_90"
    assert all(r["wgmma"] for r in prefill), [r["kernel"] for r in prefill if not r["wgmma"]]


@pytest.mark.parametrize("target", TARGETS)
def test_dot_scaled_gemm_builds_at_every_table_tile(results, target):
    vendor = "rocm" if target.startswith("hip") else "cuda"
    mine = {r["kernel"]: r for r in results if r["target"] == target and r["kernel"].startswith("moe_mx_")}
    tiles = tiles_for(vendor, "mxfp4_dot")
    for i, tile in enumerate(tiles):
        variants = ["planned"] + (["planned-split", "public"] if i == 0 else [])
        for layer in ("w13", "w2"):
            for v in variants:
                scales, _, split = v.partition("-")
                name = f"moe_mx_gemm[{layer}-{scales}-m{tile.block_m}n{tile.block_n}{'-split' if split else ''}]"
                assert name in mine and mine[name]["ok"], (name, mine.get(name))
    assert mine["moe_mx_split_finish"]["ok"]


def test_hopper_dot_scaled_large_tiles_use_wgmma(results):
    """sm_90: the dot_scaled GEMM's tiles of >= 64 rows run on wgmma (Triton's e2m1 -> bf16
    conversion feeding Hopper's MMA), the 16-row decode tile on mma.sync."""
    mx = [r for r in results if r["target"] == "cuda:90" and r["kernel"].startswith("moe_mx_gemm[")]
    large = [r for r in mx if int(r["kernel"].split("-m")[1].split("n")[0]) >= 64]
    assert large and all(r["wgmma"] for r in large), [r["kernel"] for r in large if not r["wgmma"]]
    assert all(r["matrix_instructions"] > 0 and r["spills"] == 0 for r in mx)


@pytest.mark.parametrize("target", TARGETS)
def test_fp8_activation_and_atomic_combine_variants_build(results, target):
    """activation_quant="fp8" (fp8 x fp8 GEMMs of both fp8 weight formats and layers, and the
    four quantize-kernel variants) and the atomic combine compile at the decode and prefill tiles."""
    mine = {r["kernel"]: r for r in results if r["target"] == target}
    fp8act = [r for name, r in mine.items() if "-fp8act-" in name]
    assert len(fp8act) == 8 and all(r["ok"] and r["matrix_instructions"] > 0 for r in fp8act), fp8act
    assert len([n for n in mine if "-atomic-" in n]) == 2
    quant = [r for name, r in mine.items() if name.startswith("moe_fp8_quant[")]
    assert len(quant) == 4 and all(r["ok"] for r in quant)
