"""GPU numerics of ``gluon_prefill_fa3_sm90`` against a dense float64 attention.

Runs only on an sm_90 GPU (skips with the reason otherwise): ragged batches with lengths
that are not multiples of the 128-token tile (1, 37, 129, 300, 1025), GQA groups 8 and 4
and 1, sinks on and off, D 64 and 128, fp16, LSE, Lk > Lq (bottom-right causal), Lq > Lk
(rows that see nothing), more work tiles than SMs (the persistent loop), a misaligned
``out`` view and the launch configurations the device sweep times, the opt-in variants
(exp2 partly on the FMA pipe, three consumer warpgroups, the lazy rescale) included; the
sliding-window build (``gluon_prefill_fa3_window_sm90``) on the same awkward shapes with
windows 0, 4, 127, 200 and larger than the sequences. Outputs are poisoned with NaN so an
unwritten row fails.
"""

import math

import pytest
import torch
from support.dense_attention import dense_reference
from support.gpu import sm90_skip_reason

from tokenspeed_kernel_nvidia.ops.attention.gluon_prefill_fa3 import fa3_variant

KERNEL = "gluon_prefill_fa3_sm90"
WINDOW_KERNEL = "gluon_prefill_fa3_window_sm90"
NO_WINDOW = 1 << 30
RAGGED = [1, 37, 129, 300, 1025]
CASES = [
    # (lens_q, lens_k, hq, hkv, d, sinks, dtype)
    (RAGGED, None, 16, 2, 64, True, torch.bfloat16),
    (RAGGED, None, 16, 2, 64, False, torch.bfloat16),
    (RAGGED, None, 16, 4, 64, True, torch.float16),
    (RAGGED, None, 16, 2, 128, True, torch.bfloat16),
    (RAGGED, None, 8, 8, 128, False, torch.float16),  # group 1
    ([200, 77], None, 64, 8, 64, True, torch.bfloat16),  # GPT-OSS heads
    ([100, 37, 5], [300, 40, 133], 16, 2, 64, True, torch.bfloat16),  # Lk > Lq
    ([50, 130], [20, 130], 16, 2, 64, True, torch.bfloat16),  # Lq > Lk: rows with no key
    ([50], [20], 16, 2, 128, False, torch.bfloat16),  # ... and no sink: zeros, lse -inf
    ([3000, 1500], None, 16, 2, 64, True, torch.bfloat16),  # 768 tiles: several per program
]


def _skip():
    reason = sm90_skip_reason()
    if reason:
        print(f"SKIP {KERNEL}: {reason}")
        pytest.skip(reason)


def _inputs(lens_q, lens_k, hq, hkv, d, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    cu_q, cu_k = (
        torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        for lens in (lens_q, lens_k)
    )
    q = torch.randn(int(cu_q[-1]), hq, d, device="cuda", generator=g).to(dtype)
    k, v = (torch.randn(int(cu_k[-1]), hkv, d, device="cuda", generator=g).to(dtype) for _ in range(2))
    return q, k, v, cu_q, cu_k


def _run(lens_q, lens_k, hq, hkv, d, sinks, dtype, *, cfg=None, out=None, window=-1):
    from tokenspeed_kernel import mha_prefill
    from tokenspeed_kernel.ops.attention.args import PrefillArgs
    from tokenspeed_kernel_nvidia.ops.attention import gluon_prefill_fa3 as fa3

    lens_k = lens_k or lens_q
    q, k, v, cu_q, cu_k = _inputs(lens_q, lens_k, hq, hkv, d, dtype, seed=sum(lens_q) + hq + d)
    sk = torch.randn(hq, device="cuda") * 2 if sinks else None
    out = torch.full_like(q, float("nan")) if out is None else out.fill_(float("nan"))
    lse = torch.full((q.shape[0], hq), float("nan"), device="cuda")
    scale = 1 / math.sqrt(d)
    if cfg is None:
        res, lse = mha_prefill(
            q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), window_left=window, sinks=sk, return_lse=True, out=out,
            override=KERNEL if window < 0 else WINDOW_KERNEL,
        )  # fmt: skip
    else:  # a non-default launch configuration, through the module's launcher
        args = PrefillArgs(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), True, scale, window, sk, 0.0, out, lse)
        fa3.launch(args, cfg)
        res = out
    torch.cuda.synchronize()
    ro, rl = dense_reference(q, k, v, cu_q, cu_k, scale=scale, window=window if window >= 0 else NO_WINDOW, sinks=sk)
    return res, lse, ro, rl


def _assert_close(res, lse, ro, rl):
    assert not torch.isnan(res).any(), "unwritten (NaN-poisoned) output rows"
    assert not torch.isnan(lse).any(), "unwritten LSE rows"
    err = float((res.double() - ro).norm() / ro.norm().clamp_min(1e-30))
    assert err < 2e-2, err
    finite = torch.isfinite(rl)
    assert torch.equal(torch.isfinite(lse), finite)  # -inf exactly where a row sees nothing
    torch.testing.assert_close(lse.double()[finite], rl[finite], atol=2e-2, rtol=2e-2)
    blind = res.double()[~finite]  # rows that see no key: zeros
    assert blind.numel() == 0 or float(blind.abs().max()) == 0.0


@pytest.mark.parametrize("lens_q,lens_k,hq,hkv,d,sinks,dtype", CASES)
def test_gluon_prefill_fa3_numerics(lens_q, lens_k, hq, hkv, d, sinks, dtype):
    _skip()
    _assert_close(*_run(lens_q, lens_k, hq, hkv, d, sinks, dtype))


# The alternatives ci/device/fa3_sweep.py times (its VARIANTS are checked here first):
# (head dim, Fa3Config keywords; "wide" = three consumer warpgroups, gluon_prefill_fa3.WIDE)
SWEEP_CONFIGS = [
    (64, {"stages": 2}),
    (64, {"block_n": 64, "stages": 4}),
    (128, {"block_n": 64, "stages": 3}),
    (64, {"stages": 3, "pingpong": False}),
    (128, {"pingpong": False}),
    (64, {"stages": 3, "exp2_poly": 1}),
    (64, {"stages": 3, "exp2_poly": 2}),
    (64, {"stages": 3, "rescale_threshold": 8.0}),
    (64, {"stages": 3, "wide": True}),
    (64, {"stages": 3, "wide": True, "exp2_poly": 2}),
    (64, {"stages": 3, "wide": True, "exp2_poly": 2, "rescale_threshold": 8.0}),
    (128, {"exp2_poly": 1}),
    (128, {"rescale_threshold": 8.0}),
    (64, {"stages": 3, "pv_overlap": True}),
    (64, {"stages": 3, "pv_overlap": True, "exp2_poly": 1}),
    (64, {"stages": 3, "wide": True, "pv_overlap": True}),
    (128, {"pv_overlap": True}),
]


@pytest.mark.parametrize("d,kw", SWEEP_CONFIGS, ids=lambda x: str(x))
def test_gluon_prefill_fa3_sweep_configs(d, kw):
    _skip()
    cfg = fa3_variant(d, **kw)
    _assert_close(*_run(RAGGED, None, 16, 2, d, True, torch.bfloat16, cfg=cfg))


@pytest.mark.parametrize("d,kw", [c for c in SWEEP_CONFIGS if set(c[1]) - {"block_n", "stages", "pingpong"}])
def test_gluon_prefill_fa3_variants_on_rows_that_see_nothing_and_lk_gt_lq(d, kw):
    # the variants change the softmax: rows with no key must stay exactly zero with -inf LSE
    # (no sink), and bottom-right causal with Lk > Lq must still hold (the sweep-config test
    # above covers ragged lengths, sinks, LSE and more work tiles than SMs)
    _skip()
    cfg = fa3_variant(d, **kw)
    _assert_close(*_run([50, 130, 7], [20, 130, 300], 16, 2, d, False, torch.bfloat16, cfg=cfg))


def test_gluon_prefill_fa3_writes_a_misaligned_out_view():
    # out is written with plain stores (not TMA): a view 2 bytes off a 16-byte boundary works
    _skip()
    total = sum(RAGGED)
    out = torch.empty(total * 16 * 64 + 1, dtype=torch.bfloat16, device="cuda")[1:].view(total, 16, 64)
    _assert_close(*_run(RAGGED, None, 16, 2, 64, True, torch.bfloat16, out=out))


# The sliding-window build: (lens_q, lens_k, hq, hkv, d, sinks, dtype, window)
WINDOW_CASES = [
    (RAGGED, None, 16, 2, 64, True, torch.bfloat16, 127),  # GPT-OSS's window, ragged
    (RAGGED, None, 16, 2, 64, False, torch.bfloat16, 0),  # the diagonal key only
    (RAGGED, None, 16, 4, 64, True, torch.float16, 4),
    (RAGGED, None, 16, 2, 64, True, torch.bfloat16, 5000),  # larger than every sequence: causal
    (RAGGED, None, 16, 2, 128, True, torch.bfloat16, 127),
    (RAGGED, None, 8, 8, 128, False, torch.float16, 200),  # group 1
    ([200, 77], None, 64, 8, 64, True, torch.bfloat16, 127),  # GPT-OSS heads
    ([100, 37, 5], [300, 40, 133], 16, 2, 64, True, torch.bfloat16, 127),  # Lk > Lq
    ([100, 37, 5], [300, 40, 133], 16, 2, 64, True, torch.bfloat16, 3),
    ([50, 130], [20, 130], 16, 2, 64, False, torch.bfloat16, 127),  # Lq > Lk: rows with no key, no sink
    ([3000, 1500], None, 16, 2, 64, True, torch.bfloat16, 127),  # several tiles per program
]


@pytest.mark.parametrize("lens_q,lens_k,hq,hkv,d,sinks,dtype,window", WINDOW_CASES)
def test_gluon_prefill_fa3_window_numerics(lens_q, lens_k, hq, hkv, d, sinks, dtype, window):
    _skip()
    _assert_close(*_run(lens_q, lens_k, hq, hkv, d, sinks, dtype, window=window))


# The windowed alternatives ci/device/fa3_sweep.py times (--window): 128-key tiles, pv_overlap
WINDOW_SWEEP_CONFIGS = [
    (64, {"block_n": 128, "stages": 3}),
    (64, {"block_n": 64, "stages": 4, "pv_overlap": True}),
    (128, {"block_n": 128, "stages": 2}),
]


@pytest.mark.parametrize("d,kw", WINDOW_SWEEP_CONFIGS, ids=lambda x: str(x))
@pytest.mark.parametrize("window", [0, 127])
def test_gluon_prefill_fa3_window_sweep_configs(d, kw, window):
    _skip()
    cfg = fa3_variant(d, window=True, **kw)
    _assert_close(*_run(RAGGED, None, 16, 2, d, True, torch.bfloat16, cfg=cfg, window=window))
