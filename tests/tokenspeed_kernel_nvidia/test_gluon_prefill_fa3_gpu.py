"""GPU numerics of ``gluon_prefill_fa3_sm90`` against a dense float64 attention.

Runs only on an sm_90 GPU (skips with the reason otherwise): ragged batches with lengths
that are not multiples of the 128-token tile (1, 37, 129, 300, 1025), GQA groups 8 and 4
and 1, sinks on and off, D 64 and 128, fp16, LSE, Lk > Lq (bottom-right causal), Lq > Lk
(rows that see nothing), more work tiles than SMs (the persistent loop), a misaligned
``out`` view and the launch configurations the device sweep times, the opt-in variants
(exp2 partly on the FMA pipe, three consumer warpgroups, the lazy rescale) included; the
sliding-window build (``gluon_prefill_fa3_window_sm90``) on the same awkward shapes with
windows 0, 4, 127, 200 and larger than the sequences. Outputs are poisoned with NaN so an
unwritten row fails. Unseen NaN/inf (docs/api.md): K and V poisoned at one key at a time
(diagonal tiles, the next sequence's rows in a last tile, window edges, Lk > Lq, Lq > Lk),
rows that cannot see it bitwise unchanged and finite, for both builds and every swept
configuration (the V cleaning on dirty tiles). A row-strided q (a fused qkv's q, NaN past
each row's q) read in place by both builds through its TMA descriptor's row stride; one whose
row stride TMA cannot take refused by name before any launch.
"""

import math

import pytest
import torch
from support.dense_attention import dense_reference
from support.gpu import sm90_skip_reason
from support.strided_q import row_strided

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


def _launch(q, k, v, cu_q, cu_k, lens_q, lens_k, sk, *, cfg=None, out=None, window=-1):
    """The kernel (``cfg`` None: the registered build through the public call; else that
    configuration through the module's launcher) on NaN-poisoned ``out`` and LSE."""
    from tokenspeed_kernel import mha_prefill
    from tokenspeed_kernel.ops.attention.args import PrefillArgs
    from tokenspeed_kernel_nvidia.ops.attention import gluon_prefill_fa3 as fa3

    out = torch.full_like(q, float("nan")) if out is None else out.fill_(float("nan"))
    lse = torch.full((q.shape[0], q.shape[1]), float("nan"), device="cuda")
    scale = 1 / math.sqrt(q.shape[-1])
    if cfg is None:
        res, lse = mha_prefill(
            q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), window_left=window, sinks=sk, return_lse=True, out=out,
            override=KERNEL if window < 0 else WINDOW_KERNEL,
        )  # fmt: skip
    else:
        args = PrefillArgs(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), True, scale, window, sk, 0.0, out, lse)
        fa3.launch(args, cfg)
        res = out
    torch.cuda.synchronize()
    return res, lse


def _run(lens_q, lens_k, hq, hkv, d, sinks, dtype, *, cfg=None, out=None, window=-1):
    lens_k = lens_k or lens_q
    q, k, v, cu_q, cu_k = _inputs(lens_q, lens_k, hq, hkv, d, dtype, seed=sum(lens_q) + hq + d)
    sk = torch.randn(hq, device="cuda") * 2 if sinks else None
    res, lse = _launch(q, k, v, cu_q, cu_k, lens_q, lens_k, sk, cfg=cfg, out=out, window=window)
    scale = 1 / math.sqrt(d)
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


# Unseen NaN/inf (docs/api.md: a key or value a query cannot see never affects it): K and V
# poisoned at one key at a time, the rows that cannot see it keep every bit of their output
# and LSE (against the clean run) and stay finite. The keys: each sequence's first, middle and
# last, and those around the 64- and 128-key tile edges, so the poison lands on the diagonal
# tile, on the second dirty tile when Lk - Lq is not a tile multiple, in the previous
# sequence's last tile (the dense view's next rows, masked as causally later), and outside a
# window's left edge. (lens_q, lens_k, d, sinks, window)
NAN_CASES = [
    ([40, 9], None, 64, True, -1),  # one tile: the diagonal and the next sequence's keys
    ([300, 129], None, 64, True, -1),  # three tiles, a ragged last one
    ([300, 129], None, 128, False, -1),
    ([100, 37, 5], [300, 40, 133], 64, True, -1),  # Lk > Lq: two dirty tiles per work tile
    ([50, 130], [20, 130], 64, False, -1),  # Lq > Lk: rows that see nothing stay 0 / -inf
    ([300, 129], None, 64, True, 5),  # the windowed build: left edges
    ([300, 130], None, 128, True, 127),
    ([100, 37, 5], [300, 40, 133], 64, False, 127),
]
POISON_VALUES = (float("nan"), float("inf"), float("-inf"))


def _poison_keys(lens_k) -> list[int]:
    """K/V rows to poison (one at a time): per sequence its first, middle and last key and
    those at the 64- and 128-key tile edges."""
    starts = [0, *torch.tensor(lens_k).cumsum(0).tolist()]
    picks = (0, 63, 64, 127, 128, 255, 256)
    return sorted({starts[b] + j for b, n in enumerate(lens_k) for j in (*picks, n // 2, n - 1) if 0 <= j < n})


def _blind_rows(lens_q, lens_k, key_row: int, window: int) -> torch.Tensor:
    """Per query row of the batch: whether it cannot see K/V row ``key_row`` (another
    sequence's, causally later or outside its window)."""
    blind, k0 = [], 0
    for lq, lk in zip(lens_q, lens_k, strict=True):
        j = key_row - k0
        for t in range(lq):
            p = lk - lq + t
            sees = 0 <= j < lk and j <= p and (window < 0 or p - j <= window)
            blind.append(not sees)
        k0 += lk
    return torch.tensor(blind, device="cuda")


def _assert_unseen_poison_changes_nothing(lens_q, lens_k, d, sinks, window, *, cfg=None, values=POISON_VALUES):
    lens_k = lens_k or lens_q
    q, k, v, cu_q, cu_k = _inputs(lens_q, lens_k, 16, 2, d, torch.bfloat16, seed=sum(lens_q) + d + window)
    sk = torch.randn(16, device="cuda") * 2 if sinks else None
    out, lse = _launch(q, k, v, cu_q, cu_k, lens_q, lens_k, sk, cfg=cfg, window=window)
    keys = _poison_keys(lens_k)
    for n, key_row in enumerate(keys):
        value = values[n % len(values)]
        bad_k, bad_v = k.clone(), v.clone()
        bad_k[key_row], bad_v[key_row] = value, value
        bad_out, bad_lse = _launch(q, bad_k, bad_v, cu_q, cu_k, lens_q, lens_k, sk, cfg=cfg, window=window)
        blind = _blind_rows(lens_q, lens_k, key_row, window)
        where = f"key row {key_row} = {value}"
        assert torch.isfinite(bad_out[blind]).all(), f"{where}: leaked into rows that cannot see it"
        assert torch.equal(bad_out[blind], out[blind]), f"{where}: changed the output of rows that cannot see it"
        assert torch.equal(bad_lse[blind], lse[blind]), f"{where}: changed the LSE of rows that cannot see it"


@pytest.mark.parametrize("lens_q,lens_k,d,sinks,window", NAN_CASES)
@pytest.mark.parametrize("value", POISON_VALUES, ids=("nan", "inf", "-inf"))
def test_gluon_prefill_fa3_unseen_nan_changes_nothing(lens_q, lens_k, d, sinks, window, value):
    _skip()
    _assert_unseen_poison_changes_nothing(lens_q, lens_k, d, sinks, window, values=(value,))


@pytest.mark.parametrize("d,kw", SWEEP_CONFIGS, ids=lambda x: str(x))
def test_gluon_prefill_fa3_sweep_configs_unseen_nan_changes_nothing(d, kw):
    # every swept configuration (64-key tiles, three warpgroups, the variants): Lk > Lq, so
    # work tiles have two dirty tiles, and NaN / inf / -inf in turn over the poisoned keys
    _skip()
    _assert_unseen_poison_changes_nothing([100, 37, 5], [300, 40, 133], d, True, -1, cfg=fa3_variant(d, **kw))


@pytest.mark.parametrize("d,kw", WINDOW_SWEEP_CONFIGS, ids=lambda x: str(x))
def test_gluon_prefill_fa3_window_sweep_configs_unseen_nan_changes_nothing(d, kw):
    _skip()
    _assert_unseen_poison_changes_nothing([300, 129], None, d, True, 5, cfg=fa3_variant(d, window=True, **kw))


# A row-strided q (strided_q): (lens_q, lens_k, hq, hkv, d, sinks, dtype, window)
STRIDED_Q_CASES = [
    (RAGGED, None, 16, 2, 64, True, torch.bfloat16, -1),
    (RAGGED, None, 16, 2, 128, True, torch.bfloat16, -1),
    ([200, 77], None, 64, 8, 64, True, torch.bfloat16, -1),  # GPT-OSS: q rows of 80 x 64
    ([100, 37, 5], [300, 40, 133], 16, 4, 64, True, torch.float16, -1),  # Lk > Lq
    ([50, 130], [20, 130], 16, 2, 64, False, torch.bfloat16, -1),  # Lq > Lk: rows with no key
    ([3000, 1500], None, 16, 2, 64, True, torch.bfloat16, -1),  # several tiles per program
    (RAGGED, None, 16, 2, 64, True, torch.bfloat16, 127),  # the windowed build
    ([200, 77], None, 64, 8, 64, True, torch.bfloat16, 127),
    (RAGGED, None, 16, 2, 128, False, torch.float16, 4),
]


@pytest.mark.parametrize("lens_q,lens_k,hq,hkv,d,sinks,dtype,window", STRIDED_Q_CASES)
def test_gluon_prefill_fa3_reads_a_row_strided_q_in_place(lens_q, lens_k, hq, hkv, d, sinks, dtype, window):
    """A fused qkv's q (rows of (Hq + 2 Hkv) D elements, NaN in each row past its q): its TMA
    descriptor has q's row stride over ``[rows, Hq D]`` (the k/v columns never read), so the
    call takes no copy (``strided_q``) and gives the contiguous q's bits and the float64
    reference, out (contiguous) fully written."""
    _skip()
    from tokenspeed_kernel.ops._dispatch import last_request

    lens_k = lens_k or lens_q
    q, k, v, cu_q, cu_k = _inputs(lens_q, lens_k, hq, hkv, d, dtype, seed=sum(lens_q) + hq + d + 2)
    sk = torch.randn(hq, device="cuda") * 2 if sinks else None
    flat, flat_lse = (t.clone() for t in _launch(q, k, v, cu_q, cu_k, lens_q, lens_k, sk, window=window))
    strided = row_strided(q, 2 * hkv * d)
    out = torch.empty(q.shape, dtype=q.dtype, device="cuda")
    res, lse = _launch(strided, k, v, cu_q, cu_k, lens_q, lens_k, sk, out=out, window=window)
    assert "strided_q" in last_request().features and res.data_ptr() == out.data_ptr()
    assert torch.equal(res, flat) and torch.equal(lse, flat_lse)
    ro, rl = dense_reference(
        q, k, v, cu_q, cu_k, scale=1 / math.sqrt(d), window=window if window >= 0 else NO_WINDOW, sinks=sk
    )
    _assert_close(res, lse, ro, rl)


@pytest.mark.parametrize("window", [-1, 127])
def test_gluon_prefill_fa3_refuses_a_q_row_stride_tma_cannot_take(window):
    """Rows 4 bf16 elements wider than Hq D (a row stride that is an 8-byte, not a 16-byte,
    multiple): the call asks for ``unaligned_qkv``, which neither build lists, so forcing one
    raises before any launch naming the feature, and the selector's own choice serves it."""
    _skip()
    from tokenspeed_kernel import KernelOverrideError, last_kernel, mha_prefill

    lens = [129, 37]
    q, k, v, cu, _ = _inputs(lens, lens, 16, 2, 64, torch.bfloat16, seed=7)
    odd = row_strided(q, 4)
    kernel = KERNEL if window < 0 else WINDOW_KERNEL
    with pytest.raises(KernelOverrideError, match="unaligned_qkv"):
        mha_prefill(odd, k, v, cu, cu, max(lens), max(lens), window_left=window, override=kernel)
    res = mha_prefill(odd, k, v, cu, cu, max(lens), max(lens), window_left=window)
    assert last_kernel() not in (KERNEL, WINDOW_KERNEL)
    ro, _ = dense_reference(q, k, v, cu, cu, scale=1 / 8, window=window if window >= 0 else NO_WINDOW, sinks=None)
    assert float((res.double() - ro).norm() / ro.norm()) < 2e-2
