"""GPU numerics of ``gluon_prefill_window_sm90`` against an independent float64 attention.

Runs only on an sm_90 GPU (skips with the reason otherwise): ragged batches with lengths
1, 37, 129, 300, 1025, windows 127/64/1, GQA groups 8 and 4, sinks on and off, D 64 and 128,
fp16, logit cap and LSE, a row-strided q (a fused qkv's q, NaN past each row's q, read in
place); outputs poisoned with NaN so an unwritten row fails. The opt-in configurations the
device sweep times (``window_variants``) run through the uncached launcher, and the persistent
build gives the tiled build's bits (one and six programs per SM, many items each). The float64
reference is a dense masked softmax written here (no code shared with the kernel); it is
itself checked against ``support.naive_attention`` on small shapes, on any machine.
"""

import dataclasses
import math

import pytest
import torch
from support.dense_attention import dense_reference
from support.gpu import sm90_skip_reason
from support.naive_attention import naive_prefill
from support.strided_q import row_strided

from tokenspeed_kernel.ops.attention.args import PrefillArgs
from tokenspeed_kernel_nvidia.ops.attention import gluon_prefill as gp

KERNEL = "gluon_prefill_window_sm90"


def _inputs(lens, hq, hkv, d, dtype, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    total = int(cu[-1])
    q, k, v = (torch.randn(total, h, d, device=device, generator=g).to(dtype) for h in (hq, hkv, hkv))
    return q, k, v, cu


def test_dense_reference_matches_naive_attention():
    lens = [1, 9, 23]
    q, k, v, cu = _inputs(lens, 8, 2, 8, torch.float64, "cpu", 0)
    sinks = torch.randn(8, dtype=torch.float64)
    for window, cap, sk in ((4, 0.0, sinks), (0, 3.0, None), (30, 0.0, None)):
        out, lse = dense_reference(q, k, v, cu, cu, scale=0.3, window=window, sinks=sk, cap=cap)
        ro, rl = naive_prefill(q, k, v, cu, cu, softmax_scale=0.3, window_left=window, sinks=sk, logit_cap=cap)
        torch.testing.assert_close(out, ro)
        torch.testing.assert_close(lse, rl)


RAGGED = [1, 37, 129, 300, 1025]
CASES = [
    # (lens, hq, hkv, d, window, sinks, cap, dtype)
    (RAGGED, 16, 2, 64, 127, True, 0.0, torch.bfloat16),
    (RAGGED, 16, 2, 64, 127, False, 0.0, torch.bfloat16),
    (RAGGED, 16, 2, 64, 64, True, 0.0, torch.bfloat16),
    (RAGGED, 16, 2, 64, 1, True, 0.0, torch.bfloat16),
    (RAGGED, 16, 4, 64, 127, True, 0.0, torch.bfloat16),
    (RAGGED, 16, 4, 64, 64, False, 0.0, torch.float16),
    (RAGGED, 16, 2, 128, 127, True, 0.0, torch.bfloat16),
    ([300, 1, 77], 24, 4, 64, 100, True, 0.0, torch.bfloat16),  # G = 6, padded to 8
    ([129, 37], 16, 4, 64, 127, True, 30.0, torch.bfloat16),
]


def _skip():
    reason = sm90_skip_reason()
    if reason:
        print(f"SKIP {KERNEL}: {reason}")
        pytest.skip(reason)


def _call(q, k, v, cu, lens, window, sk, cap):
    """The public call with the kernel forced, into a NaN-poisoned contiguous ``out``."""
    from tokenspeed_kernel import mha_prefill

    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    res, lse = mha_prefill(
        q, k, v, cu, cu, max(lens), max(lens), window_left=window, sinks=sk, logit_cap=cap, return_lse=True,
        out=out, override=KERNEL,
    )  # fmt: skip
    torch.cuda.synchronize()
    return res, lse


def _check_float64(q, k, v, cu, d, window, sk, cap, res, lse):
    ro, rl = dense_reference(q, k, v, cu, cu, scale=1 / math.sqrt(d), window=window, sinks=sk, cap=cap)
    assert not torch.isnan(res).any() and not torch.isnan(lse).any()
    err = float((res.double() - ro).norm() / ro.norm())
    assert err < 2e-2, err
    torch.testing.assert_close(lse.double(), rl, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("lens,hq,hkv,d,window,sinks,cap,dtype", CASES)
def test_gluon_prefill_window_numerics(lens, hq, hkv, d, window, sinks, cap, dtype):
    _skip()
    q, k, v, cu = _inputs(lens, hq, hkv, d, dtype, "cuda", seed=sum(lens) + window + d)
    sk = torch.randn(hq, device="cuda") * 2 if sinks else None
    res, lse = _call(q, k, v, cu, lens, window, sk, cap)
    _check_float64(q, k, v, cu, d, window, sk, cap, res, lse)


@pytest.mark.parametrize("lens,hq,hkv,d,window,sinks,cap,dtype", [CASES[0], CASES[5], CASES[6], CASES[7], CASES[8]])
def test_gluon_prefill_window_reads_a_row_strided_q_in_place(lens, hq, hkv, d, window, sinks, cap, dtype):
    """A fused qkv's q (rows of (Hq + 2 Hkv) D elements, NaN in each row past its q): read in
    place (``strided_q``, no copy), the contiguous q's bits and the float64 reference (GQA
    2 and 4, a padded group of 6, D 64 and 128, fp16, a logit cap)."""
    _skip()
    from tokenspeed_kernel.ops._dispatch import last_request

    q, k, v, cu = _inputs(lens, hq, hkv, d, dtype, "cuda", seed=sum(lens) + window + d + 1)
    sk = torch.randn(hq, device="cuda") * 2 if sinks else None
    flat, flat_lse = _call(q, k, v, cu, lens, window, sk, cap)
    strided = row_strided(q, 2 * hkv * d)
    res, lse = _call(strided, k, v, cu, lens, window, sk, cap)
    assert "strided_q" in last_request().features and res.is_contiguous()
    assert torch.equal(res, flat) and torch.equal(lse, flat_lse)
    _check_float64(q, k, v, cu, d, window, sk, cap, res, lse)


_VARIANT_CASES = [CASES[0], CASES[7]]  # ragged with sinks; G = 6 padded to 8, window 100


@pytest.mark.parametrize("variant", range(len(gp.window_variants(64, 8))))
@pytest.mark.parametrize("lens,hq,hkv,d,window,sinks,cap,dtype", _VARIANT_CASES)
def test_gluon_prefill_window_variants_numerics(variant, lens, hq, hkv, d, window, sinks, cap, dtype):
    """Each opt-in configuration (``gluon_prefill.window_variants``) against float64 on the
    ragged case with sinks and the padded group (G = 6) at window 100."""
    _skip()
    cfg = gp.window_variants(d, hq // hkv)[variant]
    q, k, v, cu = _inputs(lens, hq, hkv, d, dtype, "cuda", seed=sum(lens) + window + d + variant)
    sk = torch.randn(hq, device="cuda") * 2 if sinks else None
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), device="cuda")
    args = PrefillArgs(q, k, v, cu, cu, max(lens), max(lens), True, 1 / math.sqrt(d), window, sk, cap, out, lse)
    gp.launch(args, cfg)
    torch.cuda.synchronize()
    _check_float64(q, k, v, cu, d, window, sk, cap, out, lse)


def _persistent_cases():
    """(case, programs per SM, row-strided q) of every case: one program per SM (many items per
    program, the ring running across them) and six (the variant's) where six fit, and the
    GPT-OSS-like case with a fused qkv's q."""
    out = []
    for i, case in enumerate(CASES):
        d, group = case[3], case[1] // case[2]
        for per_sm in (1, 6):
            try:
                dataclasses.replace(gp.prefill_config(d, group), persistent=per_sm)
            except ValueError:  # D 128's tiles: six do not fit an SM
                continue
            out.append(pytest.param(case, per_sm, False, id=f"case{i}-p{per_sm}"))
    return [*out, pytest.param(CASES[0], 6, True, id="case0-p6-strided_q")]


@pytest.mark.parametrize("case,per_sm,strided", _persistent_cases())
def test_gluon_prefill_window_persistent_build_gives_the_tiled_build_s_bits(case, per_sm, strided):
    """``GluonPrefillConfig.persistent`` (programs walking (head, query tile) items, the next
    item's Q and first K/V tiles loaded while the current one finishes) against the tiled
    build of the same tiles on every case (ragged with sinks, windows 127/64/1, GQA 8/4 and a
    padded 6, fp16, D 128, a logit cap; LSE): the same output and LSE bits, and the float64
    reference."""
    _skip()
    lens, hq, hkv, d, window, sinks, cap, dtype = case
    q, k, v, cu = _inputs(lens, hq, hkv, d, dtype, "cuda", seed=sum(lens) + window + d + per_sm)
    if strided:
        q = row_strided(q, 2 * hkv * d)
    sk = torch.randn(hq, device="cuda") * 2 if sinks else None
    tiled_cfg = gp.prefill_config(d, hq // hkv)
    results = []
    for cfg in (tiled_cfg, dataclasses.replace(tiled_cfg, persistent=per_sm)):
        out = torch.full(q.shape, float("nan"), dtype=dtype, device="cuda")
        lse = torch.full(q.shape[:2], float("nan"), device="cuda")
        args = PrefillArgs(q, k, v, cu, cu, max(lens), max(lens), True, 1 / math.sqrt(d), window, sk, cap, out, lse)
        gp.launch(args, cfg)
        torch.cuda.synchronize()
        results.append((out, lse))
    (tiled, tiled_lse), (out, lse) = results
    assert torch.equal(out, tiled) and torch.equal(lse, tiled_lse)
    _check_float64(q, k, v, cu, d, window, sk, cap, out, lse)
