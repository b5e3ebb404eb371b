"""Every Triton attention/KV-store kernel compiles ahead of time for sm_90, gfx942 and gfx950
(no GPU needed), over the configurations the launch heuristics can choose (regimes, head
dims 64/80/96/128/256, bf16/fp16, fp8 KV, page sizes, GQA groups, splits, features), and the
assembly holds the matrix instructions it should (``mma``/``wgmma`` in PTX, ``v_mfma`` in
AMDGCN). Runs ``python -m tokenspeed_kernel_dev.aot_triton <target>`` once per target, in
parallel subprocesses without TRITON_INTERPRET (the interpreter replaces the kernels here).
"""

import pytest
from support.aot import run_aot

TARGETS = ("cuda:90", "hip:gfx942", "hip:gfx950")
SHARED_LIMIT = {"cuda:90": 227 * 1024, "hip:gfx942": 64 * 1024, "hip:gfx950": 160 * 1024}


@pytest.fixture(scope="module")
def results() -> dict[str, list[dict]]:
    runs = run_aot("tokenspeed_kernel_dev.aot_triton", [[target] for target in TARGETS])
    return {target: run.rows for target, run in zip(TARGETS, runs)}


@pytest.mark.parametrize("target", TARGETS)
def test_every_kernel_builds(results, target):
    mine = results[target]
    failed = [f"{r['kernel']}: {r['error']}" for r in mine if not r["ok"]]
    assert not failed, "\n".join(failed)
    assert len(mine) >= 13, f"only {len(mine)} configurations compiled"
    assert {r["kernel"].split("[")[0] for r in mine} == {"attention", "combine", "store"}


@pytest.mark.parametrize("target", TARGETS)
def test_attention_uses_matrix_instructions_and_fits_shared_memory(results, target):
    for r in results[target]:
        assert r["shared_bytes"] <= SHARED_LIMIT[target], r
        if r["kernel"].startswith("attention["):
            assert r["matrix_instructions"] > 0, f"{r['kernel']} on {target}: no mma/mfma instruction"


# ROCm tile rows that still spill (see _launch.ROCM_TILES): key -> {target: most spills}.
# Every other ROCm row must compile with zero spills and no scratch on gfx942 and gfx950.
ROCM_KNOWN_SPILLS = {
    "prefill_window": {"hip:gfx942": 13, "hip:gfx950": 13},
    "decode_d128": {"hip:gfx942": 2, "hip:gfx950": 0},
}


@pytest.mark.parametrize("target", TARGETS)
def test_every_tile_row_compiles(results, target):
    from tokenspeed_kernel_triton.ops.attention._launch import VENDOR_TILES

    vendor = "rocm" if target.startswith("hip") else "cuda"
    attention = [r for r in results[target] if r["kernel"].startswith("attention[")]
    assert {r["tile"] for r in attention} == set(VENDOR_TILES[vendor]), "a tile row the grid does not compile"
    if vendor != "rocm":
        return
    for r in attention:
        bound = ROCM_KNOWN_SPILLS.get(r["tile"], {}).get(target, 0)
        assert r["spills"] <= bound, f"{r['kernel']} ({r['tile']}) on {target}: {r['spills']} spills > {bound}"
        assert r["scratch_bytes"] == 0 or bound, f"{r['kernel']} on {target}: {r['scratch_bytes']} scratch bytes"


def test_hopper_prefill_uses_wgmma(results):
    prefill = [r for r in results["cuda:90"] if r["kernel"].startswith("attention[prefill-bfloat16")]
    assert prefill, "no prefill configuration in the sweep"
    assert all(r["wgmma"] > 0 for r in prefill if "-d64-g8-" in r["kernel"]), prefill[0]
    # Under the interpreter no fp8 conversion is compiled; here it must be: fp8 KV configs built.
    assert any("kv_fp8" in r["kernel"] for r in results["cuda:90"])
