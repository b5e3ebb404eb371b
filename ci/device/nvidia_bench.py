"""One device call for tokenspeed-kernel-nvidia: numerics of every NVIDIA kernel against a
float64 reference on awkward GPU shapes, then a benchmark at GPT-OSS-120B shapes against the
Triton kernels and torch baselines measured in the same run.

Usage on the device (see docs/history.md, "NVIDIA wheel"):
    python3 ci/device/nvidia_bench.py            # writes $OUT/nvidia_bench.json
FlashInfer JIT-compiles each variant on first use; first-call times are reported separately
and FlashInfer work stops at a time budget (BUDGET_S) so the call ends inside its limit.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F

BUDGET_S = float(os.environ.get("BUDGET_S", "480"))
T0 = time.time()
RESULTS: dict = {"numerics": [], "bench": [], "first_call_s": {}}
DEV = "cuda"


def log(*a):
    print(*a, flush=True)


def elapsed():
    return time.time() - T0


def load_backends():
    from tokenspeed_kernel import registry

    registry.load_backends()
    have = {b.name for b in registry.backends()}
    for name, target in (
        ("triton", "tokenspeed_kernel_triton:register"),
        ("nvidia", "tokenspeed_kernel_nvidia:register"),
    ):
        if name not in have:
            st = registry.load_backend(name, target)
            log("backend", name, st.state, st.error[:300])


# ---------------------------------------------------------------- float64 reference
def ref_rows(q, keys, vals, qpos, kpos, scale, window, sinks, cap, causal=True):
    """q [M, Hq, D]; keys/vals [N, Hkv, D] float64; positions int64. Returns out, lse."""
    hq, hkv = q.shape[1], keys.shape[1]
    kk = keys.repeat_interleave(hq // hkv, 1)
    vv = vals.repeat_interleave(hq // hkv, 1)
    s = torch.einsum("mhd,nhd->hmn", q, kk) * scale
    if cap > 0:
        s = cap * torch.tanh(s / cap)
    mask = torch.ones(len(qpos), len(kpos), dtype=torch.bool, device=q.device)
    if causal:
        mask &= kpos[None, :] <= qpos[:, None]
    if window >= 0:
        mask &= (qpos[:, None] - kpos[None, :]) <= window
    s = s.masked_fill(~mask[None], float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.double()[:, None, None].expand(hq, len(qpos), 1)], -1)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None])
    p = torch.nan_to_num(p)
    if sinks is not None:
        p = p[..., :-1]
    out = torch.einsum("hmn,nhd->mhd", p, vv)
    return out, lse.transpose(0, 1)


def gather(cache, pt_row, n, scale):
    p = cache.shape[1]
    pages = pt_row[: (n + p - 1) // p].long()
    x = cache[pages].reshape(-1, cache.shape[2], cache.shape[3])[:n].double()
    return x * (1.0 if scale is None else float(scale))


def rel_err(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ---------------------------------------------------------------- inputs
def paged_inputs(seqlens, hq, hkv, d, page, dtype, kv_dtype, q_len=1, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    b = len(seqlens)
    max_pages = max((s + page - 1) // page for s in seqlens) + 1
    num_pages = b * max_pages + 3
    k = torch.randn(num_pages, page, hkv, d, device=DEV, generator=g)
    v = torch.randn(num_pages, page, hkv, d, device=DEV, generator=g)
    if kv_dtype == torch.float8_e4m3fn:
        k, v = (k * 4).to(kv_dtype), (v * 4).to(kv_dtype)
    else:
        k, v = k.to(kv_dtype), v.to(kv_dtype)
    pt = torch.randperm(num_pages, device=DEV, generator=g)[: b * max_pages].reshape(b, max_pages).int().contiguous()
    q = torch.randn(b, q_len, hq, d, device=DEV, generator=g).to(dtype)
    return q, k, v, pt, torch.tensor(seqlens, dtype=torch.int32, device=DEV)


def check_decode(kernel, seqlens, hq, hkv, d, page, *, sinks=False, window=-1, cap=0.0, fp8=False, lse=True):
    from tokenspeed_kernel import mha_decode_with_kvcache

    kvd = torch.float8_e4m3fn if fp8 else torch.bfloat16
    q, k, v, pt, sl = paged_inputs(seqlens, hq, hkv, d, page, torch.bfloat16, kvd, seed=len(seqlens) + d)
    sk = torch.randn(hq, device=DEV) * 2 if sinks else None
    ks, vs = (torch.tensor([0.3], device=DEV), torch.tensor([0.6], device=DEV)) if fp8 else (None, None)
    scale = 1 / math.sqrt(d)
    t = time.time()
    res = mha_decode_with_kvcache(
        q[:, 0], k, v, pt, sl, max(seqlens), window_left=window, sinks=sk, logit_cap=cap, k_scale=ks, v_scale=vs,
        return_lse=lse, override=kernel,
    )  # fmt: skip
    torch.cuda.synchronize()
    first = time.time() - t
    out, lse_out = res if lse else (res, None)
    errs = []
    for bi, n in enumerate(seqlens):
        kk, vv = gather(k, pt[bi], n, None if ks is None else ks), gather(v, pt[bi], n, None if vs is None else vs)
        ro, rl = ref_rows(
            q[bi].double(), kk, vv, torch.tensor([n - 1], device=DEV), torch.arange(n, device=DEV), scale, window,
            sk, cap,
        )  # fmt: skip
        errs.append(rel_err(out[bi : bi + 1].float(), ro))
        if lse:
            errs.append(rel_err(lse_out[bi : bi + 1], rl))
    return max(errs), first


def check_prefill(kernel, lens_q, lens_k, hq, hkv, d, *, sinks=False, window=-1, cap=0.0, extend=False, page=16):
    from tokenspeed_kernel import mha_extend_with_kvcache, mha_prefill

    g = torch.Generator(device=DEV).manual_seed(sum(lens_q))
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    q = torch.randn(int(cu_q[-1]), hq, d, device=DEV, generator=g).bfloat16()
    sk = torch.randn(hq, device=DEV) * 2 if sinks else None
    scale = 1 / math.sqrt(d)
    t = time.time()
    poisoned = torch.full_like(q, float("nan"))  # an unwritten row fails the check
    if extend:
        _, kc, vc, pt, sl = paged_inputs(lens_k, hq, hkv, d, page, torch.bfloat16, torch.bfloat16, seed=3)
        out, lse = mha_extend_with_kvcache(
            q, kc, vc, pt, cu_q, sl, max(lens_q), max(lens_k), window_left=window, sinks=sk, logit_cap=cap,
            return_lse=True, out=poisoned, override=kernel,
        )  # fmt: skip
    else:
        k = torch.randn(int(cu_k[-1]), hkv, d, device=DEV, generator=g).bfloat16()
        v = torch.randn(int(cu_k[-1]), hkv, d, device=DEV, generator=g).bfloat16()
        out, lse = mha_prefill(
            q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), window_left=window, sinks=sk, logit_cap=cap,
            return_lse=True, out=poisoned, override=kernel,
        )  # fmt: skip
    torch.cuda.synchronize()
    first = time.time() - t
    errs = [math.inf] if torch.isnan(out).any() or torch.isnan(lse).any() else []
    for bi, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        if extend:
            kk, vv = gather(kc, pt[bi], lk, None), gather(vc, pt[bi], lk, None)
        else:
            kk, vv = k[cu_k[bi] : cu_k[bi + 1]].double(), v[cu_k[bi] : cu_k[bi + 1]].double()
        qpos = torch.arange(lk - lq, lk, device=DEV)
        ro, rl = ref_rows(q[cu_q[bi] : cu_q[bi + 1]].double(), kk, vv, qpos, torch.arange(lk, device=DEV), scale,
                          window, sk, cap)  # fmt: skip
        errs += [rel_err(out[cu_q[bi] : cu_q[bi + 1]].float(), ro), rel_err(lse[cu_q[bi] : cu_q[bi + 1]], rl)]
    return max(errs), first


def record_check(name, kernel, fn, *a, tol=2e-2, **kw):
    if kernel.startswith("flashinfer") and elapsed() > BUDGET_S * 0.55:
        log(f"SKIP  {kernel:20s} {name}: time budget")
        RESULTS["numerics"].append({"kernel": kernel, "case": name, "status": "skipped (time budget)"})
        return
    try:
        err, first = fn(kernel, *a, **kw)
        ok = err < tol
        log(f"{'PASS' if ok else 'FAIL'}  {kernel:20s} {name}: rel err {err:.2e} (first call {first:.1f}s)")
        RESULTS["numerics"].append({"kernel": kernel, "case": name, "err": err, "ok": ok, "first_s": first})
    except Exception as exc:
        log(f"ERROR {kernel:20s} {name}: {type(exc).__name__}: {str(exc)[:400]}")
        traceback.print_exc(limit=3, file=sys.stdout)
        RESULTS["numerics"].append({"kernel": kernel, "case": name, "status": f"error: {exc}"[:600]})


# ---------------------------------------------------------------- bench
def bench_ms(fn):
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def copy_bandwidth():
    x = torch.empty(2**30, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    ms = bench_ms(lambda: y.copy_(x))
    return 2 * x.numel() / ms / 1e9  # TB/s read+write


def _time_kernels(row: dict, case: str, kernels, call) -> None:
    """Time ``call(name)`` for each kernel name into ``row`` (first-call time recorded apart);
    FlashInfer past the budget is skipped, errors are recorded, never raised."""
    for name in kernels:
        if name.startswith("flashinfer") and elapsed() > BUDGET_S:
            row[name] = "skipped (time budget)"
            continue
        try:
            fn = functools.partial(call, name)
            t = time.time()
            fn()
            torch.cuda.synchronize()
            RESULTS["first_call_s"][f"{name} {case}"] = time.time() - t
            row[name] = bench_ms(fn)
        except Exception as exc:
            row[name] = f"error: {type(exc).__name__}: {str(exc)[:200]}"


def bench_decode(batch, ctx, sinks, kernels):
    from tokenspeed_kernel import mha_decode_with_kvcache

    hq, hkv, d, page = 64, 8, 64, 16
    q, k, v, pt, sl = paged_inputs([ctx] * batch, hq, hkv, d, page, torch.bfloat16, torch.bfloat16, seed=7)
    q = q[:, 0].contiguous()
    sk = torch.randn(hq, device=DEV) if sinks else None
    nbytes = 2 * batch * ctx * hkv * d * 2
    case = f"decode B={batch} ctx={ctx}{' sinks' if sinks else ''}"
    row = {"case": case, "bytes": nbytes}
    _time_kernels(
        row, case, kernels, lambda name: mha_decode_with_kvcache(q, k, v, pt, sl, ctx, sinks=sk, override=name)
    )
    # torch baselines: gather pages then SDPA (GQA), and SDPA on a contiguous cache (no sinks)
    pages = pt[:, : ctx // page].long()
    qq = q[:, :, None]  # [B, Hq, 1, D]

    def gather_sdpa():
        kk = k[pages].reshape(batch, ctx, hkv, d).transpose(1, 2)
        vv = v[pages].reshape(batch, ctx, hkv, d).transpose(1, 2)
        return F.scaled_dot_product_attention(qq, kk, vv, enable_gqa=True)

    kc = k[pages].reshape(batch, ctx, hkv, d).transpose(1, 2).contiguous()
    vc = v[pages].reshape(batch, ctx, hkv, d).transpose(1, 2).contiguous()
    row["torch_gather_sdpa"] = bench_ms(gather_sdpa)
    row["torch_sdpa_contiguous"] = bench_ms(lambda: F.scaled_dot_product_attention(qq, kc, vc, enable_gqa=True))
    RESULTS["bench"].append(row)
    log(json.dumps(row))


def bench_prefill(seq, window, sinks, kernels):
    from tokenspeed_kernel import mha_prefill

    hq, hkv, d = 64, 8, 64
    q = torch.randn(seq, hq, d, device=DEV).bfloat16()
    k = torch.randn(seq, hkv, d, device=DEV).bfloat16()
    v = torch.randn(seq, hkv, d, device=DEV).bfloat16()
    cu = torch.tensor([0, seq], dtype=torch.int32, device=DEV)
    sk = torch.randn(hq, device=DEV) if sinks else None
    keys_seen = seq * (seq + 1) / 2 if window < 0 else sum(min(i + 1, window + 1) for i in range(seq))
    flops = 4 * hq * d * keys_seen
    case = f"prefill S={seq}{' window=' + str(window) if window >= 0 else ''}{' sinks' if sinks else ''}"
    row = {"case": case, "flops": flops}
    _time_kernels(
        row, case, kernels,
        lambda name: mha_prefill(q, k, v, cu, cu, seq, seq, window_left=window, sinks=sk, override=name),
    )  # fmt: skip
    qt, kt, vt = (x.transpose(0, 1)[None] for x in (q, k, v))
    if window < 0:
        row["torch_sdpa_causal"] = bench_ms(
            lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
        )
    else:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            mask = create_block_mask(lambda b, h, qi, ki: (ki <= qi) & (qi - ki <= window), None, None, seq, seq)
            flex = torch.compile(flex_attention)
            t = time.time()
            flex(qt, kt, vt, block_mask=mask, enable_gqa=True)
            torch.cuda.synchronize()
            RESULTS["first_call_s"][f"flex {case}"] = time.time() - t
            row["torch_flex_attention"] = bench_ms(lambda: flex(qt, kt, vt, block_mask=mask, enable_gqa=True))
        except Exception as exc:
            row["torch_flex_attention"] = f"error: {exc}"[:200]
    RESULTS["bench"].append(row)
    log(json.dumps(row))


GLUON_PREFILL_VARIANTS = {  # (num_warps, stages) of the D=64 G=8 tile, timed side by side
    "w4_st3": (4, 3),
    "w8_st3": (8, 3),
    "w4_st2": (4, 2),
    "w8_st2": (8, 2),
}


def bench_gluon_prefill_variants(seq, window, sinks):
    """Time launch configurations of gluon_prefill_window_sm90 directly (same inputs as
    bench_prefill), each checked against the default configuration's output first."""
    from tokenspeed_kernel.ops.attention.args import PrefillArgs
    from tokenspeed_kernel_nvidia.ops.attention import gluon_prefill as gp

    hq, hkv, d = 64, 8, 64
    q = torch.randn(seq, hq, d, device=DEV).bfloat16()
    k = torch.randn(seq, hkv, d, device=DEV).bfloat16()
    v = torch.randn(seq, hkv, d, device=DEV).bfloat16()
    cu = torch.tensor([0, seq], dtype=torch.int32, device=DEV)
    sk = torch.randn(hq, device=DEV) if sinks else None
    row = {"case": f"gluon prefill variants S={seq} window={window}{' sinks' if sinks else ''}"}
    ref = None
    for name, (warps, stages) in GLUON_PREFILL_VARIANTS.items():
        cfg = gp.GluonPrefillConfig(d, 8, block_n=64, stages=stages, num_warps=warps)
        out = torch.full_like(q, float("nan"))
        args = PrefillArgs(
            q=q, k=k, v=v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=seq, max_seqlen_k=seq, causal=True,
            softmax_scale=1 / math.sqrt(d), window_left=window, sinks=sk, logit_cap=0.0, out=out, lse=None,
        )  # fmt: skip
        try:
            gp.launch(args, cfg)
            torch.cuda.synchronize()
            ref = out.clone() if ref is None else ref
            row[name + "_maxdiff_vs_first"] = float((out.float() - ref.float()).abs().max())
            row[name] = bench_ms(lambda args=args, cfg=cfg: gp.launch(args, cfg))
        except Exception as exc:
            row[name] = f"error: {type(exc).__name__}: {str(exc)[:200]}"
    RESULTS["bench"].append(row)
    log(json.dumps(row))


def prefill_goal(row):
    """The issue-5 goal for the window row: >= 2x flex_attention and >= 3x FlashInfer."""
    ours, flex, fi = (
        row.get("gluon_prefill_window_sm90"),
        row.get("torch_flex_attention"),
        row.get("flashinfer_prefill"),
    )
    if not isinstance(ours, float):
        return {"goal": "gluon prefill did not run", "gluon": ours}
    goal = {"gluon_ms": ours}
    for key, other, want in (
        ("vs_flex", flex, 2.0),
        ("vs_flashinfer", fi, 3.0),
        ("vs_triton", row.get("triton_prefill"), None),
    ):
        if isinstance(other, float):
            goal[key] = other / ours
            if want:
                goal[key + "_met"] = other / ours >= want
    return goal


def main():
    import triton

    load_backends()
    from tokenspeed_kernel import registry

    try:
        import flashinfer

        fi = flashinfer.__version__
    except Exception as exc:
        fi = f"not importable: {exc}"
    info = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "flashinfer": fi,
        "date": time.strftime("%Y-%m-%d"),
        "backends": {b.name: (b.state, b.error[:200]) for b in registry.backends()},
    }
    RESULTS["info"] = info
    log(json.dumps(info))
    RESULTS["copy_tbps"] = copy_bandwidth()
    log(f"copy bandwidth {RESULTS['copy_tbps']:.2f} TB/s")

    ragged = [1, 17, 300, 1025, 64]
    for kern in ("gluon_decode_sm90", "flashinfer_decode"):
        record_check("decode G8 d64 p16 sinks+lse", kern, check_decode, ragged, 16, 2, 64, 16, sinks=True)
        record_check("decode G8 d64 p16 plain", kern, check_decode, ragged, 16, 2, 64, 16, lse=False)
        record_check("decode G8 d64 p16 window100+sinks", kern, check_decode, ragged, 16, 2, 64, 16, sinks=True,
                     window=100)  # fmt: skip
    record_check("decode G4 d128 p1 cap30", "gluon_decode_sm90", check_decode, [5, 700, 33], 16, 4, 128, 1, cap=30.0)
    record_check("decode G16 d64 p64 sinks", "gluon_decode_sm90", check_decode, [999, 2], 32, 2, 64, 64, sinks=True)
    record_check("prefill causal sinks", "flashinfer_prefill", check_prefill, [50, 129, 1], [50, 129, 1], 16, 2, 64,
                 sinks=True)  # fmt: skip
    record_check("prefill window127 sinks", "flashinfer_prefill", check_prefill, [300, 77], [300, 77], 16, 2, 64,
                 sinks=True, window=127)  # fmt: skip
    record_check("extend sinks p16", "flashinfer_extend", check_prefill, [1, 37, 100], [40, 37, 333], 16, 2, 64,
                 sinks=True, extend=True)  # fmt: skip
    record_check("decode fp8 kv sinks", "flashinfer_decode", check_decode, ragged, 16, 2, 64, 16, sinks=True,
                 fp8=True)  # fmt: skip
    gp_lens = [1, 37, 129, 300, 1025]
    for label, hkv, window, sinks, cap in (
        ("G8 window127 sinks", 2, 127, True, 0.0),
        ("G8 window127", 2, 127, False, 0.0),
        ("G8 window64 sinks", 2, 64, True, 0.0),
        ("G8 window1 sinks", 2, 1, True, 0.0),
        ("G4 window127 sinks", 4, 127, True, 0.0),
        ("G4 window64 cap30", 4, 64, False, 30.0),
    ):
        record_check(f"prefill {label}", "gluon_prefill_window_sm90", check_prefill, gp_lens, gp_lens, 16, hkv,
                     64, sinks=sinks, window=window, cap=cap)  # fmt: skip
    gpw = "gluon_prefill_window_sm90"
    record_check("prefill d128 G8 window127 sinks", gpw, check_prefill, [300, 37, 1], [300, 37, 1], 16, 2, 128,
                 sinks=True, window=127)  # fmt: skip
    record_check("prefill Lq<Lk G8 window127 sinks", gpw, check_prefill, [5, 37], [40, 300], 16, 2, 64, sinks=True,
                 window=127)  # fmt: skip

    dec = ["gluon_decode_sm90", "triton_decode", "flashinfer_decode"]
    for batch, ctx, sinks in ((64, 8192, True), (64, 8192, False), (256, 2048, True), (1, 8192, True)):
        bench_decode(batch, ctx, sinks, dec)
    pre = ["triton_prefill", "flashinfer_prefill"]
    bench_prefill(8192, 127, True, ["gluon_prefill_window_sm90", *pre])
    RESULTS["gluon_prefill_goal"] = prefill_goal(RESULTS["bench"][-1])
    log(json.dumps(RESULTS["gluon_prefill_goal"]))
    bench_gluon_prefill_variants(8192, 127, True)
    bench_prefill(8192, -1, True, pre)

    out_dir = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out_dir, "nvidia_bench.json"), "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)
    log("=== summary ===")
    log(f"copy {RESULTS['copy_tbps']:.2f} TB/s; elapsed {elapsed():.0f}s")
    for r in RESULTS["numerics"]:
        log(" ", r.get("kernel"), r.get("case"), r.get("err", r.get("status")))
    for row in RESULTS["bench"]:
        log(json.dumps(row))
    log(json.dumps(RESULTS["first_call_s"]))


if __name__ == "__main__":
    main()
