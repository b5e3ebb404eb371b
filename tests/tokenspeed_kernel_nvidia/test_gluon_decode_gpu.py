"""GPU numerics of ``gluon_decode_sm90`` with both ways of merging the splits: a second
combine launch, and the fused merge by the last split program of each (sequence, KV head)
(an acq_rel arrival counter per pair, reset by the merging program).

Runs only on an sm_90 GPU (skips with the reason otherwise). Against the float64
``support.naive_attention.naive_decode``: ragged lengths (partial pages, one sequence of
length 1), split counts forced to 1, 3, 7 and 64 (more splits than tiles: empty splits),
windows, sinks, LSE, GQA groups 8 and 4, D 64 and 128, fp16; outputs poisoned with NaN so
an unwritten row fails; the fused merge called many times in a row and under CUDA-graph
replay (the counters must come back to 0 every time); a row-strided q (a fused qkv's q, NaN
past each row's q, also one element into its buffer) read in place.
"""

import dataclasses
import functools

import pytest
import torch
from support.gpu import sm90_skip_reason
from support.naive_attention import naive_decode
from support.strided_q import row_strided

from tokenspeed_kernel import mha_decode_with_kvcache

KERNEL = "gluon_decode_sm90"
SKIP = sm90_skip_reason()
if SKIP:
    print(f"test_gluon_decode_gpu: skipped: {SKIP}")
pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")


def _problem(lens, hq, hkv, d, page, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    batch = len(lens)
    pages = max(-(-n // page) for n in lens) + 1
    k = torch.randn(batch * pages, page, hkv, d, generator=gen, device="cuda").to(dtype)
    v = torch.randn(batch * pages, page, hkv, d, generator=gen, device="cuda").to(dtype)
    table = torch.randperm(batch * pages, generator=gen, device="cuda").int().view(batch, pages)
    q = torch.randn(batch, hq, d, generator=gen, device="cuda").to(dtype)
    sinks = torch.randn(hq, generator=gen, device="cuda")
    return q, k, v, table, torch.tensor(lens, dtype=torch.int32, device="cuda"), sinks


@pytest.fixture
def forced(monkeypatch):
    """Set the merge mode (every split count fused, or none) and the split count of the
    Gluon decode launcher; ``splits=None`` keeps the shipped heuristic."""
    from tokenspeed_kernel_nvidia.ops.attention import gluon_decode as gd

    def force(fused: bool, splits: int | None):
        shipped = gd.decode_config
        monkeypatch.setattr(
            gd,
            "decode_config",
            lambda hd, ps, programs=0: dataclasses.replace(
                shipped(hd, ps, programs), fused_max_splits=64 if fused else 0
            ),
        )
        if splits is not None:
            monkeypatch.setattr(gd, "num_splits", lambda *a: splits)

    return force


def _rel(out, ref):
    return float((out.double() - ref).norm() / ref.norm())


CASES = {
    "gqa8-ragged-sinks-lse": ([1, 37, 300, 1025], 64, 8, 64, 16, -1, True, True, torch.bfloat16),
    "window127-sinks": ([129, 2048, 5], 64, 8, 64, 16, 127, True, False, torch.bfloat16),
    "gqa4-d128-fp16-lse": ([700, 64], 16, 4, 128, 16, -1, False, True, torch.float16),
    "page1-window31": ([513], 8, 2, 64, 1, 31, True, True, torch.bfloat16),
    # 64 x 8 programs, one split each: the launcher's 2-stage ring (gluon_decode.TWO_STAGE_PROGRAMS)
    "b64-two-stage-ring": ([1 + (37 * i) % 700 for i in range(64)], 64, 8, 64, 16, -1, True, True, torch.bfloat16),
}


@functools.cache
def _case(name):
    """(inputs on the GPU, float64 reference out and lse on the CPU), computed once per case."""
    lens, hq, hkv, d, page, window, sinks, _, dtype = CASES[name]
    q, k, v, table, seqlens, sk = _problem(lens, hq, hkv, d, page, dtype, seed=len(lens) + d)
    sk = sk if sinks else None
    ref = naive_decode(
        q.cpu(),
        k.cpu(),
        v.cpu(),
        table.cpu(),
        seqlens.cpu(),
        window_left=window,
        sinks=None if sk is None else sk.cpu(),
    )
    return (q, k, v, table, seqlens, sk), ref


def _check_case(name):
    """The public call with the launcher as it stands against the case's float64 reference:
    NaN-poisoned output fully written, rel. error per dtype, LSE when asked."""
    lens, _, _, _, _, window, _, lse, dtype = CASES[name]
    (q, k, v, table, seqlens, sk), (ref, ref_lse) = _case(name)
    out = torch.full_like(q, float("nan"))
    res = mha_decode_with_kvcache(
        q, k, v, table, seqlens, max(lens), window_left=window, sinks=sk, return_lse=lse, out=out, override=KERNEL
    )
    assert not out.isnan().any()
    assert _rel(out.cpu(), ref) < (2e-2 if dtype == torch.bfloat16 else 5e-3)
    if lse:
        assert torch.allclose(res[1].cpu().double().view_as(ref_lse), ref_lse, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("splits", [1, 3, 7, 64, None])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_float64(forced, fused, splits, name):
    forced(fused, splits)
    _check_case(name)


@pytest.mark.parametrize("name", list(CASES))
def test_shipped_rule_matches_float64(name):
    """The launcher as shipped: its split count, merged in-kernel up to 8 splits."""
    _check_case(name)


def test_fused_merge_repeats_and_replays(forced):
    """Counters return to 0: 20 eager calls in a row and 10 graph replays give the same bits."""
    forced(True, 16)
    q, k, v, table, seqlens, sk = _problem([3000, 17, 1], 64, 8, 64, 16, seed=5)
    first = mha_decode_with_kvcache(q, k, v, table, seqlens, 3000, sinks=sk, override=KERNEL).clone()
    for _ in range(20):
        again = mha_decode_with_kvcache(q, k, v, table, seqlens, 3000, sinks=sk, override=KERNEL)
        assert torch.equal(again, first)
    out = torch.empty_like(q)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mha_decode_with_kvcache(q, k, v, table, seqlens, 3000, sinks=sk, out=out, override=KERNEL)
    for _ in range(10):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, first)


@pytest.mark.parametrize("layout", ["vllm", "hnd", "stacked"])
@pytest.mark.parametrize("name", ["gqa8-ragged-sinks-lse", "window127-sinks", "gqa4-d128-fp16-lse"])
def test_strided_caches_give_the_contiguous_bits(name, layout):
    """Engines' cache views (vLLM's interleaved rows, HND, a stacked pool) are read through
    their strides: the same bits as the contiguous cache, and the float64 reference."""
    from tokenspeed_kernel.tools.cases.attention import lay_out_caches

    lens, _, _, _, _, window, _, _, dtype = CASES[name]
    (q, k, v, table, seqlens, sk), (ref, _) = _case(name)
    k_view, v_view = lay_out_caches(k, v, layout)
    assert not k_view.is_contiguous()
    flat = mha_decode_with_kvcache(q, k, v, table, seqlens, max(lens), window_left=window, sinks=sk, override=KERNEL)
    out = torch.full_like(q, float("nan"))
    mha_decode_with_kvcache(
        q, k_view, v_view, table, seqlens, max(lens), window_left=window, sinks=sk, out=out, override=KERNEL
    )
    assert torch.equal(out, flat)
    assert _rel(out.cpu(), ref) < (2e-2 if dtype == torch.bfloat16 else 5e-3)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "combine"])
def test_plan_runs_bound_launches_match_float64(forced, fused):
    """``DecodePlan.run`` launches through ``BoundLaunch`` (keyed once): a fresh q every run
    (new contents, new address), then a 2-byte-misaligned q view (the alignment the binary
    was keyed on changes: the full launch path compiles the matching binary), then q back in
    an aligned buffer, then a graph capture of the run; each against float64, NaN-poisoned."""
    from tokenspeed_kernel import mha_decode_plan

    forced(fused, 5)
    lens = [700, 33, 1]
    q, k, v, table, seqlens, sk = _problem(lens, 64, 8, 64, 16, seed=9)
    plan = mha_decode_plan(
        k,
        v,
        table,
        seqlens,
        max(lens),
        q_dtype=q.dtype,
        num_q_heads=64,
        sinks=sk,
        return_lse=True,
        override=KERNEL,
    )
    gen = torch.Generator(device="cuda").manual_seed(3)

    def fresh(misaligned=False):
        flat = torch.randn(q.numel() + 1, generator=gen, device="cuda").to(q.dtype)
        return (flat[1:] if misaligned else flat[:-1]).view_as(q)

    cpu = [t.cpu() for t in (k, v, table, seqlens, sk)]

    def check(qi, out, lse):
        ref, ref_lse = naive_decode(qi.cpu(), *cpu[:4], sinks=cpu[4])
        assert not out.isnan().any() and _rel(out.cpu(), ref) < 2e-2
        assert torch.allclose(lse.cpu().double().view_as(ref_lse), ref_lse, atol=1e-3, rtol=1e-3)

    for misaligned in (False, False, False, True, False):
        qi = fresh(misaligned)
        out = torch.full_like(qi, float("nan"))
        _, lse = plan.run(qi, out=out)
        check(qi, out, lse)
    qg = fresh()
    out = torch.full_like(qg, float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, lse_g = plan.run(qg, out=out)
    for _ in range(3):
        qg.copy_(fresh())
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(qg, out, lse_g)


@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "one-element-in"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "combine"])
@pytest.mark.parametrize(
    "name", ["gqa8-ragged-sinks-lse", "window127-sinks", "gqa4-d128-fp16-lse", "b64-two-stage-ring"]
)
def test_strided_q_gives_the_contiguous_bits(forced, name, fused, offset):
    """A fused qkv's q (rows of (Hq + 2 Hkv) D elements, NaN in each row past its q; also one
    element into its buffer: 2-byte aligned, loaded with narrower loads) is read in place
    (``strided_q``, no copy): the contiguous q's bits, output and LSE, and the float64
    reference; the output (contiguous) fully written."""
    from tokenspeed_kernel.ops._dispatch import last_request

    forced(fused, 5)
    lens, _, hkv, d, _, window, _, lse, dtype = CASES[name]
    (q, k, v, table, seqlens, sk), (ref, ref_lse) = _case(name)
    call = functools.partial(
        mha_decode_with_kvcache, k_cache=k, v_cache=v, page_table=table, cache_seqlens=seqlens,
        max_seqlen_k=max(lens), window_left=window, sinks=sk, return_lse=True, override=KERNEL,
    )  # fmt: skip
    flat, flat_lse = call(q)
    strided = row_strided(q, 2 * hkv * d, offset)
    assert strided.stride(0) == (q.shape[1] + 2 * hkv) * d and torch.equal(strided, q)
    out = torch.full_like(q, float("nan"))
    _, lse_s = call(strided, out=out)
    assert "strided_q" in last_request().features
    assert torch.equal(out, flat) and torch.equal(lse_s, flat_lse)
    assert not out.isnan().any() and _rel(out.cpu(), ref) < (2e-2 if dtype == torch.bfloat16 else 5e-3)
    if lse:
        assert torch.allclose(lse_s.cpu().double().view_as(ref_lse), ref_lse, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "one-element-in"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "combine"])
@pytest.mark.parametrize(
    "name", ["gqa8-ragged-sinks-lse", "window127-sinks", "gqa4-d128-fp16-lse", "b64-two-stage-ring"]
)
def test_strided_q_plan_gives_the_contiguous_plans_bits(forced, name, fused, offset):
    """A ``DecodePlan`` made with ``q_row_stride`` (a fused qkv's q: rows of (Hq + 2 Hkv) D
    elements, NaN past each row's q; also one element into its buffer) runs its q in place
    through the runner bound for that row stride: the contiguous q's plan's bits, output and
    LSE, the float64 reference, then under CUDA-graph capture and replay (new values in the
    captured strided buffer each replay) too."""
    from tokenspeed_kernel import mha_decode_plan

    forced(fused, 5)
    lens, hq, hkv, d, _, window, _, lse, dtype = CASES[name]
    (q, k, v, table, seqlens, sk), (ref, ref_lse) = _case(name)
    make = functools.partial(
        mha_decode_plan, k, v, table, seqlens, max(lens), num_q_heads=hq, q_dtype=dtype, window_left=window,
        sinks=sk, return_lse=True, override=KERNEL, capturable=True,
    )  # fmt: skip
    row = (hq + 2 * hkv) * d
    plain, plan = make(), make(q_row_stride=row)
    assert plan.q_row_stride == row and "strided_q" in plan.request.features
    flat, flat_lse = plain.run(q)
    strided = row_strided(q, 2 * hkv * d, offset)
    assert strided.stride() == (row, d, 1) and torch.equal(strided, q)
    out = torch.full_like(q, float("nan"))
    for _ in range(2):  # the checked path (out given), then the quick one
        _, lse_s = plan.run(strided, out=out)
        assert torch.equal(out, flat) and torch.equal(lse_s, flat_lse)
        out, lse_s = plan.run(strided)
        assert torch.equal(out, flat) and torch.equal(lse_s, flat_lse)
    assert _rel(out.cpu(), ref) < (2e-2 if dtype == torch.bfloat16 else 5e-3)
    if lse:
        assert torch.allclose(lse_s.cpu().double().view_as(ref_lse), ref_lse, atol=1e-3, rtol=1e-3)
    with pytest.raises(ValueError, match=r"q must be \[batch, Hq, D\] with strides"):
        plan.run(q)
    graph_out = torch.full_like(q, float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(strided, out=graph_out)
    gen = torch.Generator(device="cuda").manual_seed(11)
    for _ in range(2):
        fresh = torch.randn(q.shape, generator=gen, device="cuda").to(dtype)
        strided.copy_(fresh)  # the captured buffer's q columns; the NaN past them stays
        graph_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(graph_out, plain.run(fresh)[0])
