"""One device call for the Triton attention kernels: numerics, then speed against baselines.

1. Numerics: every Triton attention kernel (prefill, extend, decode, KV store) on GPU-sized
   awkward shapes — ragged lengths, partial and shuffled pages (sizes 1…256), GQA 1/4/8,
   MQA, head dims 64/80/128/256, windows, sinks, logit cap, lse, speculative decode, fp8 KV
   — in bf16 and fp16, outputs poisoned with NaN, against the float64 ground truth
   (``tokenspeed_kernel.tools.cases.reference``), judged by ``tools.tolerances``.
2. Ceiling: the device-to-device copy bandwidth, measured now (bytes read + written).
3. Speed at GPT-OSS-120B shapes (64 q heads, 8 KV heads, D=64, bf16, page 16) against
   torch baselines timed in the same process: decode vs gather+SDPA and SDPA on a
   contiguous cache; causal prefill vs flex_attention and SDPA (flash, cuDNN); window-128
   prefill vs flex_attention with a block mask; sinks vs no sinks. Everything is timed the
   same way (``tools.timing.time_fn``: CUDA-graph replays, CUDA events, median, L2 flushed).
4. ``--sweep``: the tile variants behind ``_launch.TILES`` for window and causal prefill and
   the decode split size, each checked against the default variant's output.
5. A table of ratios against the goals of the Triton attention issue, printed last.

Usage (device tool; our wheels built here into .whl and carried)::

    python3 -m pip install -q --no-deps --no-index .whl/tokenspeed_kernel-*.whl \
        .whl/tokenspeed_kernel_triton-*.whl && python3 ci/device/attention_bench.py --sweep

It stops starting new sections after ``--budget-s`` seconds (default 420) and says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable

import torch
import triton

from tokenspeed_kernel import registry
from tokenspeed_kernel.ops._dispatch import last_kernel
from tokenspeed_kernel.tools import cases
from tokenspeed_kernel.tools.baselines import baselines_for
from tokenspeed_kernel.tools.cases import AttentionCase
from tokenspeed_kernel.tools.timing import time_fn
from tokenspeed_kernel.tools.tolerances import compare, tolerance_for

DEV = torch.device("cuda")
BF16, FP16, FP8 = torch.bfloat16, torch.float16, torch.float8_e4m3fn
TRITON = {
    "attention.prefill": "triton_prefill",
    "attention.extend": "triton_extend",
    "attention.decode": "triton_decode",
    "kvcache.store": "triton_store_kvcache",
}
START = time.time()


def _elapsed() -> float:
    return time.time() - START


def _log(msg: str) -> None:
    print(f"[{_elapsed():6.1f}s] {msg}", flush=True)


# ----------------------------------------------------------------------------- numerics


def numerics_cases(dtype: torch.dtype) -> list[AttentionCase]:
    """GPU-sized awkward cases (bigger than the CPU suite's: several tiles, several splits)."""
    P, E, D = "attention.prefill", "attention.extend", "attention.decode"
    ragged_q, ragged_k = (1000, 1, 2047, 333), (1000, 1, 2047, 333)
    return [
        AttentionCase(P, ragged_q, ragged_k, 64, 8, 64, dtype=dtype, sinks=True, return_lse=True, name="p_gqa8_sinks_lse"),
        AttentionCase(P, ragged_q, ragged_k, 64, 8, 64, dtype=dtype, window_left=127, sinks=True, name="p_win127"),
        AttentionCase(P, (700, 5, 130), (1500, 900, 130), 32, 8, 128, dtype=dtype, logit_cap=30.0, return_lse=True, name="p_bottom_right_cap_d128"),
        AttentionCase(P, (300, 77), (300, 77), 16, 16, 64, dtype=dtype, causal=False, name="p_noncausal_mha"),
        AttentionCase(P, (257, 64), (257, 64), 12, 4, 80, dtype=dtype, window_left=50, sinks=True, name="p_d80_gqa3_win"),
        AttentionCase(P, (200, 129), (200, 300), 8, 1, 256, dtype=dtype, sinks=True, name="p_d256_mqa"),
        AttentionCase(E, (513, 1, 64), (3000, 17, 64), 64, 8, 64, page_size=16, dtype=dtype, sinks=True, return_lse=True, name="e_p16_sinks_lse"),
        AttentionCase(E, (100, 37), (1100, 537), 64, 8, 64, page_size=64, dtype=dtype, kv_dtype=FP8, window_left=127, sinks=True, name="e_p64_fp8_win"),
        AttentionCase(E, (33, 9), (70, 9), 16, 4, 128, page_size=1, dtype=dtype, logit_cap=20.0, name="e_p1_cap_d128"),
        AttentionCase(E, (40,), (600,), 8, 8, 96, page_size=256, dtype=dtype, causal=False, name="e_p256_noncausal_d96"),
        AttentionCase(D, (1,) * 3, (8191, 1, 3000), 64, 8, 64, page_size=16, dtype=dtype, sinks=True, return_lse=True, name="d_splitkv_sinks_lse"),
        AttentionCase(D, (1,) * 37, tuple(100 + 53 * i for i in range(37)), 64, 8, 64, page_size=64, dtype=dtype, kv_dtype=FP8, sinks=True, name="d_b37_p64_fp8"),
        AttentionCase(D, (4,) * 5, (4, 900, 2049, 77, 5000), 64, 8, 64, page_size=16, dtype=dtype, sinks=True, return_lse=True, name="d_spec4"),
        AttentionCase(D, (1,) * 4, (5000, 128, 129, 3001), 64, 8, 64, page_size=16, dtype=dtype, window_left=127, sinks=True, name="d_win127"),
        AttentionCase(D, (1,) * 2, (2000, 333), 32, 8, 128, page_size=1, dtype=dtype, logit_cap=30.0, name="d_p1_cap_d128"),
        AttentionCase(D, (2,) * 2, (1500, 300), 16, 1, 256, page_size=256, dtype=dtype, kv_dtype=FP8, name="d_p256_mqa_d256_fp8_spec2"),
        AttentionCase("kvcache.store", (1, 1, 1), (900, 5, 64), 8, 8, 64, page_size=16, dtype=dtype, name="s_decode"),
        AttentionCase("kvcache.store", (700,), (3000,), 8, 8, 64, page_size=64, dtype=dtype, kv_dtype=FP8, name="s_fp8"),
        AttentionCase("kvcache.store", (100, 3), (100, 7), 4, 4, 128, page_size=1, dtype=dtype, name="s_p1"),
    ]  # fmt: skip


def run_numerics() -> list[str]:
    failures = []
    for dtype in (BF16, FP16):
        for case in numerics_cases(dtype):
            inputs = cases.make_inputs(case, DEV, seed=7)
            ref = cases.reference(case, inputs)
            if case.op == "kvcache.store":
                k_cache, v_cache = cases.call(case, inputs, TRITON[case.op])
                ok = all(
                    torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                    for a, b in ((k_cache, ref[0]), (v_cache, ref[1]))
                )
                detail = "bit-exact" if ok else "MISMATCH"
            else:
                out_ref, lse_ref = ref
                poisoned = torch.full(out_ref.shape, float("nan"), dtype=case.dtype, device=DEV)
                result = cases.call(case, inputs, TRITON[case.op], out=poisoned)
                out, lse = result if case.return_lse else (result, None)
                cmp = compare(out, out_ref, tolerance_for(case))
                ok = cmp.passed
                detail = f"rel_l2 {cmp.rel_l2:.1e} max_abs {cmp.max_abs:.1e}"
                if lse is not None:
                    finite = torch.isfinite(lse_ref)
                    lse_err = float((lse.double() - lse_ref)[finite].abs().max()) if finite.any() else 0.0
                    same_inf = bool(torch.equal(torch.isfinite(lse), finite))
                    ok = ok and lse_err < 2e-3 and same_inf
                    detail += f" lse_err {lse_err:.1e}"
            ran = last_kernel()
            ok = ok and ran == TRITON[case.op]
            tag = "PASS" if ok else "FAIL"
            print(f"  {tag} {ran:22s} {case.describe()}: {detail}", flush=True)
            if not ok:
                failures.append(case.describe())
    return failures


# ----------------------------------------------------------------------------- speed


def _gqa(op: str, batch: int, q: int, k: int, name: str, **kw) -> AttentionCase:
    kw.setdefault("sinks", True)
    return AttentionCase(op, (q,) * batch, (k,) * batch, 64, 8, 64, page_size=16, dtype=BF16, name=name, **kw)


def bench_cases() -> list[AttentionCase]:
    P, D, E = "attention.prefill", "attention.decode", "attention.extend"
    return [
        _gqa(D, 64, 1, 8192, "decode_b64_ctx8192"),
        _gqa(D, 64, 1, 8192, "decode_b64_ctx8192_nosinks", sinks=False),
        _gqa(D, 256, 1, 2048, "decode_b256_ctx2048"),
        _gqa(D, 1, 1, 8192, "decode_b1_ctx8192"),
        _gqa(D, 64, 1, 8192, "decode_b64_ctx8192_win128", window_left=127),
        _gqa(D, 64, 4, 8192, "decode_b64_ctx8192_spec4"),
        _gqa(D, 64, 1, 8192, "decode_b64_ctx8192_fp8kv", kv_dtype=FP8),
        _gqa(P, 1, 8192, 8192, "prefill_b1_s8192"),
        _gqa(P, 1, 8192, 8192, "prefill_b1_s8192_nosinks", sinks=False),
        _gqa(P, 4, 4096, 4096, "prefill_b4_s4096"),
        _gqa(P, 1, 8192, 8192, "prefill_b1_s8192_win128", window_left=127),
        _gqa(P, 1, 8192, 8192, "prefill_b1_s8192_win128_nosinks", window_left=127, sinks=False),
        _gqa(E, 1, 2048, 8192, "extend_2048_on_6144"),
        AttentionCase("kvcache.store", (8192,), (8192,), 8, 8, 64, page_size=16, name="store_prefill_8192"),
    ]


@dataclasses.dataclass
class Row:
    case: str
    impl: str
    ms: float
    tflops: float
    tbs: float
    kv_tbs: float


def _kv_bytes(case: AttentionCase) -> float:
    """K/V bytes a kernel must read: the keys some query sees (window-aware), once."""
    el = torch.empty(0, dtype=case.cache_dtype).element_size()
    return float(case._visible_keys()) * case.num_kv_heads * (case.head_dim + case.dv) * el


def _time(fn: Callable[[], object], rep_ms: float = 100.0) -> float:
    return time_fn(fn, DEV, rep_ms=rep_ms).median_ms


def run_bench(rows: list[Row]) -> None:
    for case in bench_cases():
        inputs = cases.make_inputs(case, DEV, seed=1)
        ours = TRITON[case.op]
        impls: list[tuple[str, Callable[[], object]]] = [
            ("triton", lambda c=case, i=inputs, o=ours: cases.call(c, i, o))
        ]
        for base in baselines_for(case.op):
            if base.name == "sdpa_efficient":
                continue
            prepared = base.prepare(case, inputs, DEV)
            if isinstance(prepared, str):
                continue
            impls.append((base.name + ("" if not case.sinks else "(nosinks)"), prepared))
        for name, fn in impls:
            try:
                ms = _time(fn)
            except Exception as exc:  # a baseline that cannot run here: say so, go on
                print(f"  {case.name:34s} {name:24s} failed: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            row = Row(
                case.name,
                name,
                ms,
                case.flops() / ms / 1e9,
                case.bytes_moved() / ms / 1e9,
                _kv_bytes(case) / ms / 1e9,
            )
            rows.append(row)
            print(
                f"  {case.name:34s} {name:24s} {ms * 1e3:9.1f} us {row.tflops:7.1f} TFLOP/s "
                f"{row.tbs:6.2f} TB/s (KV {row.kv_tbs:5.2f})",
                flush=True,
            )
        if case.name.startswith("decode_b1"):
            print(f"  (decode B=1 used {last_kernel()})")
        del inputs
        torch.cuda.empty_cache()


def copy_bandwidth() -> float:
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device=DEV).random_()
    dst = torch.empty_like(src)
    ms = time_fn(lambda: dst.copy_(src), DEV, graph=False).median_ms
    return 2 * n / ms / 1e9


# ----------------------------------------------------------------------------- sweep


def run_sweep(budget_s: float) -> None:
    from tokenspeed_kernel_triton.ops.attention import _launch
    from tokenspeed_kernel_triton.ops.attention._launch import Tile

    plan = [
        (
            "prefill",
            _gqa("attention.prefill", 1, 8192, 8192, "causal"),
            [(128, 64, 8, 3), (128, 64, 4, 3), (128, 64, 8, 2)],
        ),
    ]  # fmt: skip
    for key, case, variants in plan:
        inputs = cases.make_inputs(case, DEV, seed=3)
        default = _launch.TILES[key]
        ref = cases.call(case, inputs, TRITON[case.op]).float()
        results = []
        for variant in variants:
            if _elapsed() > budget_s:
                print("  sweep: out of time budget, stopping")
                break
            _launch.TILES[key] = Tile(*variant)
            try:
                out = cases.call(case, inputs, TRITON[case.op]).float()
                err = float((out - ref).norm() / ref.norm())
                ms = _time(lambda c=case, i=inputs: cases.call(c, i, TRITON[c.op]), rep_ms=50)
            except Exception as exc:
                results.append((float("inf"), variant, f"{type(exc).__name__}: {str(exc)[:60]}"))
                continue
            results.append((ms, variant, f"err {err:.0e}" + ("" if err < 1e-2 else " WRONG")))
        _launch.TILES[key] = default
        results.sort(key=lambda r: r[0])
        print(f"\n  sweep {key} ({case.describe()}), default {default}")
        for ms, variant, note in results:
            print(
                f"    {ms * 1e3:8.1f} us {case.flops() / ms / 1e9:7.1f} TFLOP/s rows,bn,warps,stages={variant} {note}"
            )


# ----------------------------------------------------------------------------- goals


def goals_table(rows: list[Row], copy_tbs: float) -> list[str]:
    t = {(r.case, r.impl.split("(")[0]): r for r in rows}

    def ms(case: str, impl: str = "triton") -> float | None:
        r = t.get((case, impl))
        return r.ms if r else None

    def ratio(case: str, base: str) -> str:
        a, b = ms(case), ms(case, base)
        return f"{b / a:.2f}x" if a and b else "n/a"

    lines = [
        f"copy bandwidth (measured, read+write): {copy_tbs:.2f} TB/s",
        "| goal | measured | met |",
        "| --- | --- | --- |",
    ]
    for case in ("decode_b64_ctx8192", "decode_b256_ctx2048"):
        r = t.get((case, "triton"))
        if r:
            frac = r.kv_tbs / copy_tbs
            g = ms(case) and ms(case, "gather_sdpa") and ms(case, "gather_sdpa") / ms(case)
            lines.append(
                f"| {case}: KV TB/s >= 85% copy; >= 2.5x gather+SDPA | {r.ms * 1e3:.1f} us, {r.kv_tbs:.2f} TB/s = "
                f"{frac:.0%} of copy; {ratio(case, 'gather_sdpa')} gather+SDPA; {ratio(case, 'sdpa_contiguous')} "
                f"contiguous SDPA | {'yes' if frac >= 0.85 and g and g >= 2.5 else 'NO'} |"
            )
    a, b = ms("decode_b1_ctx8192"), ms("decode_b1_ctx8192", "sdpa_contiguous")
    if a and b:
        lines.append(
            f"| decode_b1_ctx8192 within 1.5x contiguous SDPA | {a * 1e3:.1f} us vs {b * 1e3:.1f} us = {a / b:.2f}x "
            f"| {'yes' if a / b <= 1.5 else 'NO'} |"
        )
    for case in ("prefill_b1_s8192", "prefill_b4_s4096"):
        a, f = ms(case), ms(case, "flex_attention")
        if a:
            lines.append(
                f"| {case} causal >= 1.0x flex | {a * 1e3:.0f} us, {t[(case, 'triton')].tflops:.0f} TFLOP/s; "
                f"{ratio(case, 'flex_attention')} flex, {ratio(case, 'sdpa_flash')} SDPA flash, "
                f"{ratio(case, 'sdpa_cudnn')} cuDNN | {'yes' if f and f / a >= 1.0 else 'NO'} |"
            )
    case = "prefill_b1_s8192_win128"
    a, f = ms(case), ms(case, "flex_attention")
    if a:
        lines.append(
            f"| window-128 prefill >= 2x flex | {a * 1e3:.0f} us, {t[(case, 'triton')].tflops:.0f} eff. TFLOP/s; "
            f"{ratio(case, 'flex_attention')} flex | {'yes' if f and f / a >= 2.0 else 'NO'} |"
        )
    for with_s, without in (
        ("prefill_b1_s8192", "prefill_b1_s8192_nosinks"),
        ("prefill_b1_s8192_win128", "prefill_b1_s8192_win128_nosinks"),
        ("decode_b64_ctx8192", "decode_b64_ctx8192_nosinks"),
    ):
        a, b = ms(with_s), ms(without)
        if a and b:
            lines.append(f"| sinks cost <= 5% ({with_s}) | {a / b - 1:+.1%} | {'yes' if a / b <= 1.05 else 'NO'} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also sweep the tile table variants")
    parser.add_argument("--skip-numerics", action="store_true")
    parser.add_argument("--budget-s", type=float, default=420.0)
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "/tmp"), "attention_bench.json"))
    args = parser.parse_args()

    if "triton" not in {b.name for b in registry.backends() if b.state == "loaded"}:
        print("triton backend not loaded through its entry point; loading it by hand")
        registry.load_backend("triton", "tokenspeed_kernel_triton:register")
    props = torch.cuda.get_device_properties(DEV)
    print(
        f"device {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, triton {triton.__version__}"
    )
    failures: list[str] = []
    if not args.skip_numerics:
        _log("numerics (Triton kernels vs float64 reference, outputs poisoned with NaN)")
        failures = run_numerics()
        _log(f"numerics: {len(failures)} failure(s)")
    copy_tbs = copy_bandwidth()
    _log(f"device copy bandwidth {copy_tbs:.2f} TB/s (read + write)")
    rows: list[Row] = []
    _log("speed (median of CUDA-graph replays, L2 flushed between them)")
    run_bench(rows)
    if args.sweep and _elapsed() < args.budget_s:
        _log("tile sweep")
        run_sweep(args.budget_s)
    with open(args.json, "w") as fh:
        json.dump({"copy_tb_s": copy_tbs, "rows": [dataclasses.asdict(r) for r in rows]}, fh, indent=1)
    _log("goals (issue 3), ratios measured in this run")
    print("\n".join(goals_table(rows, copy_tbs)))
    if failures:
        print("NUMERICS FAILURES:\n  " + "\n  ".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
