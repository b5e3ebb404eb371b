"""Ahead-of-time compile of the Gluon kernels for sm_90 (no GPU): the PTX holds the intended
instructions (decode: cp.async gathers, mma.sync; window prefill: TMA copies, wgmma; FA3-style
prefill: warp specialization with setmaxnreg, wgmma left in flight), and ptxas reports no spills."""

import re

import pytest
from support.aot import run_aot


def _compile(kind: str) -> list[dict]:
    (run,) = run_aot("tokenspeed_kernel_dev.aot_nvidia", [[kind]], timeout=300)
    for row in run.rows:
        assert row["ok"], row
        assert row["spills"] == 0 and row["local"] == 0, row
        assert row["shared_bytes"] <= 227 * 1024, row
    assert run.returncode == 0, run.stderr
    return run.rows


@pytest.fixture(scope="module")
def prefill_rows() -> list[dict]:
    return _compile("prefill")


@pytest.fixture(scope="module")
def decode_rows() -> list[dict]:
    return _compile("decode")


def test_gluon_decode_compiles_for_sm90(decode_rows):
    rows = decode_rows
    for row in rows:
        assert row["cp_async"] > 0, row
        assert row["mma"] > 0, row
        assert row["spills"] == 0, row
    # The fused merge: one gpu-scope acq_rel arrival per program (issued by one thread after
    # a CTA barrier), the other splits' partials read past L1; absent without it.
    for row in rows:
        fused = "-fused" in row["kernel"]
        assert row["atom_acq_rel_gpu"] == (1 if fused else 0), row
        assert (row["ld_cg"] > 0) == fused, row
    assert sum("-fused" in row["kernel"] for row in rows) == 4
    # the ring depth the launcher picks for large grids (gluon_decode.TWO_STAGE_PROGRAMS)
    assert any(row["kernel"].endswith("-st2") for row in rows)


_MIN_WGMMA = {"-n16-": 5, "-n32-": 6}  # wgmma instructions in the code of a window variant's key tile
_PERSISTENT = re.compile(r"-p(\d+)(?=-|$)")  # the persistent build's tag: programs per SM


def test_gluon_prefill_compiles_for_sm90_with_tma_and_wgmma(prefill_rows):
    assert len(prefill_rows) >= 9
    for row in prefill_rows:
        # Both products on wgmma (QK^T and PV: one m64 instruction per 16-wide k step and
        # 64-row half; fewer with 32- and 16-key tiles), K/V by TMA, no cp.async gathers or
        # mma.sync left.
        want = next((n for key, n in _MIN_WGMMA.items() if key in row["kernel"]), 8)
        assert row["wgmma"] >= want, row
        assert row["tma"] >= 4, row
        # cp.async only in the persistent build (its Q tiles; checked below)
        assert (row["cp_async"] > 0) == bool(_PERSISTENT.search(row["kernel"])) and row["mma"] == 0, row
        assert 0 < row["registers"] <= 255, row


def test_gluon_prefill_d64_default_fits_six_programs_per_sm(prefill_rows):
    # The GPT-OSS configuration: 64-row tiles on one warpgroup (128 threads), a 2-stage ring of
    # 32-key tiles (24 KiB of shared memory) and <= 80 registers without spills, so six
    # programs share an SM (the 2026-11-28 sweeps' point: the kernel is occupancy-bound).
    row = next(r for r in prefill_rows if r["kernel"] == "gluon_prefill-bfloat16-d64-g8-m64-n32-s2-w4-r80-sinks")
    assert row["shared_bytes"] <= 26 * 1024 and row["spills"] == 0 and row["local"] == 0, row
    assert row["registers"] * 128 * 6 <= 65536, row


def test_gluon_prefill_window_variants_compile_without_spills(prefill_rows):
    # The opt-in variants the device sweep times (gluon_prefill.window_variants): each builds
    # for sm_90 without spilling; issuing the next tile's Q·K^T ahead doubles the QK^T wgmma
    # count in the code (the peeled last tile) and keeps a second score tile in registers.
    from tokenspeed_kernel_nvidia.ops.attention.gluon_prefill import prefill_config, window_variants

    by_name = {r["kernel"]: r for r in prefill_rows}
    names = [f"gluon_prefill-bfloat16-d64-g8-{cfg.tag}-sinks" for cfg in window_variants(64, 8)]
    for name in names:
        row = by_name[name]
        assert row["ok"] and row["spills"] == 0 and row["local"] == 0, row
    plain = by_name[f"gluon_prefill-bfloat16-d64-g8-{prefill_config(64, 8).tag}-sinks"]
    ahead = by_name["gluon_prefill-bfloat16-d64-g8-m64-n32-s2-w4-ahead-sinks"]
    assert ahead["wgmma"] == 2 * plain["wgmma"] and ahead["registers"] > plain["registers"]


def test_gluon_prefill_persistent_build_fits_its_programs_and_keeps_the_tile_math(prefill_rows):
    """The persistent build (``-p<N>``: N programs per SM walking work items; the two variants
    of ``window_variants`` and the feature branches): no spills (every row), registers and
    shared memory that let all N programs of 128 or 256 threads be resident at once (its
    programs never wait for a free slot), Q copied by ``cp.async`` in 16-byte vectors
    (``LDGSTS.128``, two sites: the first item's and the next item's), and in its key-tile loop
    the floating-point and tensor-core instructions of the tiled build of the same tiles (the
    same softmax and products per tile: only the integer work of the item walk is new)."""
    from tokenspeed_kernel_nvidia.ops.attention.gluon_prefill import SMEM_PER_SM, window_variants

    by_name = {r["kernel"]: r for r in prefill_rows}
    persistent = [r for r in prefill_rows if _PERSISTENT.search(r["kernel"])]
    assert len(persistent) >= 8
    for cfg in window_variants(64, 8):
        if cfg.persistent:
            assert f"gluon_prefill-bfloat16-d64-g8-{cfg.tag}-sinks" in by_name, cfg
    for row in persistent:
        programs = int(_PERSISTENT.search(row["kernel"]).group(1))
        threads = 256 if "-w8" in row["kernel"] else 128
        allocated = -(-row["registers"] // 8) * 8  # registers are allocated 8 per thread at a time
        assert programs * threads * allocated <= 65536, row
        assert programs * (row["shared_bytes"] + 1024) <= SMEM_PER_SM, row
        assert row["cp_async"] > 0 and row["sass"]["LDG.128"] == row["cp_async"], row  # LDGSTS.128, no q LDG
        twin = by_name[_PERSISTENT.sub("", row["kernel"])]
        for key in ("wgmma", "tma"):
            assert row[key] == twin[key], (key, row, twin)
        for key in ("KV_HGMMA", "KV_MUFU.EX2", "KV_FFMA", "KV_FADD", "KV_FMUL", "KV_FMNMX"):
            assert row["sass"][key] == twin["sass"][key], (key, row, twin)
    # the GPT-OSS variants: five programs under 96 registers, six under 80, both in 33 KiB
    p5 = by_name["gluon_prefill-bfloat16-d64-g8-m64-n32-s2-w4-p5-sinks"]
    p6 = by_name["gluon_prefill-bfloat16-d64-g8-m64-n32-s2-w4-p6-sinks"]
    assert p5["registers"] <= 96 and p6["registers"] <= 80, (p5, p6)
    assert p5["shared_bytes"] <= 33 * 1024 and p6["shared_bytes"] <= 33 * 1024, (p5, p6)


def test_a_row_strided_q_builds_the_same_pipeline(decode_rows, prefill_rows):
    """The builds for a row-strided q (``-qs<row stride>``: a fused qkv's q, rows of (Hq + 2
    Hkv) D elements; the kernels' ``Q_ROW``) compile without spills (every row above) and keep
    their contiguous twin's pipeline: the same copies, tensor-core products and shared memory,
    and q still loaded with 16-byte vectors (the same ``ld.global.v4`` / ``LDG.128`` counts).
    A contiguous q's build is unchanged by the stride argument (its ``Q_ROW`` is Hq D and the
    kernels branch on it at compile time; the PTX and SASS of every contiguous configuration
    were compared with the build before it, 2026-11-28: identical but the line numbers)."""
    rows = decode_rows + prefill_rows
    by_name = {r["kernel"]: r for r in rows}
    strided = [r for r in rows if "-qs" in r["kernel"]]
    assert len(strided) == 5
    for row in strided:
        twin = by_name[re.sub(r"-qs\d+$", "", row["kernel"])]
        for key in ("cp_async", "mma", "wgmma", "tma", "ld_v4", "shared_bytes", "atom_acq_rel_gpu"):
            assert row[key] == twin[key], (key, row, twin)
        assert row["sass"]["LDG.128"] == twin["sass"]["LDG.128"] and row["spills"] == 0, (row, twin)


def _fa3_consumers(name: str) -> int:
    m = re.search(r"-wg(\d+)", name)
    return int(m.group(1)) if m else 2


@pytest.fixture(scope="module")
def fa3_rows() -> list[dict]:
    return _compile("prefill_fa3")


def test_gluon_prefill_fa3_compiles_warp_specialized_with_wgmma(fa3_rows):
    rows = fa3_rows
    assert len(rows) >= 25
    names = {r["kernel"] for r in rows}
    assert "gluon_prefill_fa3-bfloat16-g8-d64-n128-st3-r240.24-sinks" in names  # GPT-OSS's launch
    assert "gluon_prefill_fa3-bfloat16-g8-d128-n128-st2-r240.24-sinks" in names
    for row in rows:
        name = row["kernel"]
        d, n = (int(x) for x in re.search(r"-d(\d+)-n(\d+)-", name).groups())
        wg = _fa3_consumers(name)
        consumer, producer = (int(x) for x in re.search(r"-r(\d+)\.(\d+)", name).groups())
        # Each consumer warpgroup: S = Q·Kᵀ as D/16 m64nNk16 steps (first key tile and loop) and
        # O += P·V as N/16 m64nDk16 steps (loop and last tile); no mma.sync, no cp.async.
        assert row["wgmma"] == wg * 2 * (d // 16 + n // 16), row
        assert row["mma"] == 0 and row["cp_async"] == 0, row
        # TMA only: the Q halves, one K and one V box (each split in two 128-byte-wide copies at D = 128)
        assert row["tma"] == (wg + 2) * (d // 64), row
        # Warp specialization: the producer shrinks to 24 registers, the consumers grow (240;
        # 160 with three consumer warpgroups, whose SASS names at most ~165 registers).
        assert {producer, consumer} <= set(row["setmaxnreg"]) and row["sass"]["REGS"] <= 240, row
        # The next S = Q·Kᵀ is awaited with the P·V product still in flight: one wait(1) per consumer.
        assert row["wgmma_wait1"] == wg, row
        assert row["mbar_wait"] > 0 and row["mbar_arrive"] > 0, row
        # V cleaned on dirty tiles (docs/api.md: unseen NaN never leaks) at both P·V sites of
        # each consumer: the stores made visible to wgmma, after the barrier inits' fence (none
        # in fa3_sweep --clean-ab's reference build without it, "-nocl")
        assert row["fence_async"] == 1 + (0 if "-nocl" in name else 2 * wg), row
        # The key-tile loop's softmax: 64 scores per thread (block_n = 128; 32 at 64) plus the
        # two rows' alpha on MUFU, less the exp2_poly of every 8 moved to the FMA pipe (3 FFMA
        # + 3 FADD each: Horner, and the round-trip through the 1.5 * 2**23 shifter).
        sass = row["sass"]
        poly = int(re.search(r"-ex(\d)", name).group(1)) if "-ex" in name else 0
        per_thread = n // 2
        moved = per_thread * poly // 8
        assert sass["KV_MUFU.EX2"] == per_thread + 2 - moved, row
        assert sass["KV_FFMA"] == per_thread + 2 + 3 * moved, row
        assert sass["KV_HGMMA"] == d // 16 + n // 16, row
    # The ping-pong hand-off: a wait and an arrive at each of the 3 issue sites of each consumer.
    by_name = {r["kernel"]: r for r in rows}
    pp = by_name["gluon_prefill_fa3-bfloat16-g8-d64-n128-st3-r240.24-sinks"]
    free = by_name["gluon_prefill_fa3-bfloat16-g8-d64-n128-st3-r240.24-free-sinks"]
    assert pp["mbar_wait"] - free["mbar_wait"] == 6 and pp["mbar_arrive"] - free["mbar_arrive"] == 6, (pp, free)
    # Three consumer warpgroups fit 160 registers without spills (checked for every row above)
    # and 123 KB of shared memory (three Q halves and the 3-stage ring).
    wide = by_name["gluon_prefill_fa3-bfloat16-g8-d64-n128-st3-r160.24-wg3-sinks"]
    assert wide["registers"] == 128 and wide["shared_bytes"] <= 124 * 1024, wide
    # A ragged batch's launch walks the pre-pass's tile list: the same pipeline, the tile
    # index loaded from the list (its count, loaded once, reaches the partitions through
    # shared memory: a few bytes more).
    listed = by_name["gluon_prefill_fa3-bfloat16-g8-d64-n128-st3-r160.24-wg3-sinks-tl"]
    for key in ("wgmma", "wgmma_wait1", "tma", "mbar_wait", "mbar_arrive", "fence_async", "registers"):
        assert listed[key] == wide[key], (key, wide, listed)
    assert 0 <= listed["shared_bytes"] - wide["shared_bytes"] <= 64, (wide, listed)


def test_gluon_prefill_fa3_pv_overlap_moves_the_pv_wait_after_the_softmax(fa3_rows):
    # KV_EX2_UNDER_PV: the key-tile loop's MUFU.EX2 between the wait for S_i (WARPGROUP.DEPBAR.LE
    # gsb0, 0x1) and the wait for P_{i-1}·V_{i-1} (gsb0, 0x0). By default ptxas hoists the P·V
    # wait to the top of the softmax's basic block: no exponential overlaps the P·V product
    # (the rows assert the default lacks it). Fa3Config.pv_overlap ends that block with an
    # mbarrier wait that passes at once, and every exponential of the loop is issued before the
    # P·V wait (the new P is packed after it), with no spills (checked for every row) and the
    # registers within the consumers' budget. The lazy rescale's warpgroup vote is itself a
    # block boundary and gets part of the way by accident.
    by_name = {r["kernel"]: r for r in fa3_rows}
    overlapped = [r for r in fa3_rows if "-ov" in r["kernel"]]
    assert len(overlapped) >= 5
    for row in fa3_rows:
        sass = row["sass"]
        if "-ov" in row["kernel"]:
            # with the lazy rescale the two rows' alpha (read only by the skippable O *= alpha)
            # may follow the wait; every score exponential precedes it
            alphas = 2 if "-lz" in row["kernel"] else 0
            assert 0 < sass["KV_MUFU.EX2"] - alphas <= sass["KV_EX2_UNDER_PV"] <= sass["KV_MUFU.EX2"], row
            # REGS is the kernel's highest register: with three consumer warpgroups the default
            # partition (consumer 0) runs at setmaxnreg 168, the two workers at 160
            budget = 168 if "-wg3" in row["kernel"] else 240
            assert sass["REGS"] <= budget and row["spills"] == 0, row
        elif "-lz" not in row["kernel"]:
            assert sass["KV_EX2_UNDER_PV"] == 0, row
    # the cost: one more mbarrier wait per consumer warpgroup, nothing else in the PTX
    base = by_name["gluon_prefill_fa3-bfloat16-g8-d64-n128-st3-r240.24-sinks"]
    ov = by_name["gluon_prefill_fa3-bfloat16-g8-d64-n128-st3-r240.24-ov-sinks"]
    assert ov["mbar_wait"] - base["mbar_wait"] == 2, (base, ov)
    for key in ("wgmma", "wgmma_wait1", "tma", "mbar_arrive", "shared_bytes"):
        assert ov[key] == base[key], (key, base, ov)


def test_gluon_prefill_fa3_window_build_keeps_the_pipeline(fa3_rows):
    # The sliding-window build (gluon_prefill_fa3_window_sm90, "-sw"): the launcher's
    # configurations (D 64: 64-key tiles, 4 stages; D 128: 64-key tiles, 3 stages) compile
    # without spills (every row above) and with the pipeline of the causal-only build of the
    # same tile: the window changes the key band walked and the mask, not the wgmma products,
    # the TMA copies, the in-flight P·V or the barriers.
    from tokenspeed_kernel_nvidia.ops.attention.gluon_prefill_fa3 import fa3_window_config

    by_name = {r["kernel"]: r for r in fa3_rows}
    for d in (64, 128):
        assert f"gluon_prefill_fa3-bfloat16-g8-{fa3_window_config(d).tag}-sinks" in by_name
    windowed = [r for r in fa3_rows if "-sw" in r["kernel"]]
    assert len(windowed) >= 6
    pairs = [
        ("gluon_prefill_fa3-bfloat16-g8-d64-n64-st4-r240.24-sw-sinks", "gluon_prefill_fa3-bfloat16-g8-d64-n64-st4-r240.24-sinks"),
        ("gluon_prefill_fa3-bfloat16-g8-d128-n64-st3-r240.24-sw-sinks", "gluon_prefill_fa3-bfloat16-g8-d128-n64-st3-r240.24-sinks"),
    ]  # fmt: skip
    for win, base in pairs:
        w, b = by_name[win], by_name[base]
        for key in ("wgmma", "wgmma_wait1", "tma", "mbar_arrive", "mbar_wait", "setmaxnreg"):
            assert w[key] == b[key], (key, w, b)
        for key in ("KV_HGMMA", "KV_MUFU.EX2"):
            assert w["sass"][key] == b["sass"][key], (key, w, b)
        # the same buffers (the compiler's scratch for layout conversions may land a few bytes apart)
        assert abs(w["shared_bytes"] - b["shared_bytes"]) <= 64 and w["spills"] == 0, (w, b)


def test_gluon_moe_decode_compiles_for_sm90_with_vector_loads():
    rows = _compile("moe")
    assert len(rows) >= 18
    names = {r["kernel"] for r in rows}
    assert "gluon_moe_w13-bfloat16-h2880-i2880-e128-k4-t1-swiglu_oai-route-bias" in names
    assert "gluon_moe_w2-float16-h64-i64-k2-t1-bias" in names  # a tiny shape
    for row in rows:
        sass = row["sass"]
        # Weights: one 16-byte load per lane, MX group and row (layer 1: 4 gate + 4 up rows
        # per thread; layer 2: the word-permuted intermediate too); no tensor cores.
        assert row["ld_v4"] >= 8 and sass["LDG.128"] == row["ld_v4"], row
        assert row["mma"] == 0 and row["wgmma"] == 0 and row["tma"] == 0, row
        # The E2M1 decode widens fp16 patterns with HADD2.F32 (FMA pipe), never F2F.
        assert row["cvt_f16"] >= 128 and sass["HADD2.F32"] >= row["cvt_f16"] and sass["F2F"] == 0, row
        # About two integer ops (shift, mask/or) per decoded value: the budget of the design.
        assert sass["LOP3"] + sass["SHF"] <= 2.2 * row["cvt_f16"], row
        assert 0 < row["registers"] <= 255, row
    gpt_t1 = next(
        r for r in rows if r["kernel"] == "gluon_moe_w13-bfloat16-h2880-i2880-e128-k4-t1-swiglu_oai-route-bias"
    )
    assert gpt_t1["registers"] <= 168, gpt_t1  # 3 programs (12 warps) per SM


def test_gluon_moe_mma_compiles_for_sm90_with_tensor_cores():
    rows = _compile("moe_mma")
    assert len(rows) >= 10
    by_name = {r["kernel"]: r for r in rows}
    # Instruction budget of the main K loop (static SASS), the reason this kernel exists: layer
    # 1 handles 16 words per thread per step, layer 2 4 (FMA kernel: ~39 and ~36 per word).
    w13 = by_name["gluon_moe_mma_w13-bfloat16-h2880-i2880-k4-c4.2.2.2.1-swiglu_oai-bias"]
    w2 = by_name["gluon_moe_mma_w2-bfloat16-h2880-i2880-k4-c4.2.2.2.1-bias"]
    assert 0 < w13["sass"]["LOOP"] <= 27 * 16, w13
    assert 0 < w2["sass"]["LOOP"] <= 31 * 4, w2
    # The shipped T = 1 configuration (software-pipelined, 4 K-split warps in layer 2, L2
    # 256-byte hint on the full steps' weight words): the loop also issues the next step's
    # loads, a few more instructions per word.
    w13 = by_name["gluon_moe_mma_w13-bfloat16-h2880-i2880-k4-c4.2.4.2.1ph-swiglu_oai-bias"]
    w2 = by_name["gluon_moe_mma_w2-bfloat16-h2880-i2880-k4-c4.2.4.2.1ph-bias"]
    assert 0 < w13["sass"]["LOOP"] <= 30 * 16 and w13["registers"] <= 168, w13  # 3 programs per SM
    assert 0 < w2["sass"]["LOOP"] <= 33 * 4, w2
    # 2 gate + 2 up words per slot and step, twice (pipeline prologue + loop); 2 per slot in layer 2
    assert w13["ld_l2_256"] == 2 * 4 * 2 * 2 and w2["ld_l2_256"] == 2 * 2 * 2, (w13, w2)
    assert by_name["gluon_moe_mma_w13-bfloat16-h2880-i2880-k4-c4.2.2.2.1-swiglu_oai-bias"]["ld_l2_256"] == 0
    for row in rows:
        sass = row["sass"]
        # Dots on mma.sync (two m16n8k16 per MX group and 16-row block); no float32 widening
        # of the decoded codes (the FMA kernel has >= 128 per K step): at most the fp16
        # bias of the epilogue.
        assert row["mma"] >= 4 and row["mma"] % 2 == 0, row
        assert row["cvt_f16"] <= 16 and sass["HADD2.F32"] <= 16, row
        assert row["wgmma"] == 0, row
        # TMA only in the TMA-staged layers (tag t<stages> for layer 1, shipped at T = 4 and 8
        # with 2 stages; T<stages> for layer 2, opt-in), no spills. Layer 1: 2 boxes per
        # prologue stage and 2 in the loop (stages of 2 x 4 KB); layer 2 at GPT-OSS top-4: one
        # box per choice, prologue and loop.
        tag = re.search(r"-c[\d.]+([A-Za-z\d]*)-", row["kernel"]).group(1)
        stages1 = re.search(r"t(\d+)", tag)
        if "mma_w13" in row["kernel"] and stages1:
            n = int(stages1.group(1))
            copies = 2 * n + 2 if "-h2880-" in row["kernel"] else 2  # H = 64: one step, copied once
            assert row["tma"] == copies and row["spills"] == 0 and row["shared_bytes"] >= 2 * n * 4096, row
        elif "mma_w2" in row["kernel"] and "T4" in tag and "-k4-" in row["kernel"]:
            assert row["tma"] == 4 * 4 + 4 and row["spills"] == 0 and row["shared_bytes"] >= 4 * 4 * 2048, row
        elif ("mma_w13" in row["kernel"] and "t" not in tag) or ("mma_w2" in row["kernel"] and "T" not in tag):
            assert row["tma"] == 0, row
        assert 0 < row["registers"] <= 255, row


def test_gluon_mx_grouped_w2_prototype_is_warp_specialized_with_wgmma():
    """The layer-2 grouped GEMM prototype (``gluon_mx_grouped``, not registered): one TMA
    producer warp (three copies per step) and two consumer warpgroups under setmaxnreg, each
    issuing one m64 wgmma step (8 k16 instructions) with one step left in flight; the decoded
    weight reaches wgmma's register A without a shared-memory layout conversion (the only
    shared loads are the words, the scale words and the barriers'); registers and spills
    are printed for the report (spills are 0 today)."""
    rows = {r["kernel"]: r for r in _compile("moe_grouped")}
    for name, r in rows.items():
        print(name, "registers", r["registers"], "spills", r["spills"], "sass regs", r["sass"].get("REGS"))
        assert r["wgmma"] == 16 and r["wgmma_wait1"] >= 2, r
        assert r["tma"] >= 3, r
        assert {24, 240} <= set(r["setmaxnreg"]), r
        assert r["sass"]["STS"] <= 2 and r["sass"]["LDS"] <= 9, r
    assert rows["gluon_mx_grouped_w2-s4p-r240.24.168"]["shared_bytes"] <= 170 * 1024
