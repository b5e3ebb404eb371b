"""GPU: launches through the launch cache give the same bits as Triton's normal path.

For every kernel converted to ``tokenspeed_kernel_triton._launcher.jit_launch``, through the
public call with ``override=``: outputs with the cache off (Triton's ``JITFunction.run``)
against outputs with the cache on, twice (the first launch of a key fills the cache, the
second is served from it), bitwise. Then a second dtype, and for the router top-k a
misaligned (4-byte offset) logits tensor, after the first: the key changes, Triton compiles
the matching binary, and the cached launch still matches the normal path bitwise. Outputs
are poisoned with NaN before each run. Skips (with the printed reason) without CUDA, under
the interpreter, and for the Gluon kernels off sm_90.
"""

from __future__ import annotations

import os

import pytest
import torch

from tokenspeed_kernel import (
    mha_decode_with_kvcache,
    mha_extend_with_kvcache,
    mha_prefill,
    moe_apply,
    moe_topk,
    registry,
    store_kvcache,
)

# The Gluon kernels of the NVIDIA wheel launch through the same cache (conftest.py).
ALL_BACKENDS = True
SKIP = None
if not torch.cuda.is_available():
    SKIP = "no CUDA device: the launch cache only serves compiled GPU launches (CPU: test_launcher.py)"
elif os.environ.get("TRITON_INTERPRET") == "1":
    SKIP = "TRITON_INTERPRET=1: the launch cache is bypassed under the interpreter"
if SKIP:
    print(f"test_launcher_gpu: skipped: {SKIP}")
pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")
SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


_LAYER = [0]  # test_functional_runners_*: the "layer" whose data the cases draw


def _gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed + 1000 * _LAYER[0])


def _paged(dtype, lens, hq=8, hkv=2, d=64, page=16, seed=0):
    g = _gen(seed)
    batch = len(lens)
    pages = max(-(-n // page) for n in lens) + 1
    k = torch.randn(batch * pages, page, hkv, d, generator=g, device="cuda").to(dtype)
    v = torch.randn(batch * pages, page, hkv, d, generator=g, device="cuda").to(dtype)
    table = torch.randperm(batch * pages, generator=g, device="cuda").int().view(batch, pages)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    sinks = torch.randn(hq, generator=g, device="cuda")
    return k, v, table, seqlens, sinks


def _decode(kernel):
    def run(dtype, misaligned=False):
        lens = [1, 37, 300]
        k, v, table, seqlens, sinks = _paged(dtype, lens)
        q = torch.randn(len(lens), 8, 64, generator=_gen(1), device="cuda").to(dtype)
        out = torch.full_like(q, float("nan"))
        mha_decode_with_kvcache(
            q, k, v, table, seqlens, max(lens), window_left=127, sinks=sinks, out=out, override=kernel
        )
        return (out,)

    return run


def _extend(kernel):
    def run(dtype, misaligned=False):
        lens_q, lens_k = [3, 17], [40, 90]
        k, v, table, seqlens, sinks = _paged(dtype, lens_k)
        q = torch.randn(sum(lens_q), 8, 64, generator=_gen(2), device="cuda").to(dtype)
        cu_q = torch.tensor([0, 3, 20], dtype=torch.int32, device="cuda")
        out = torch.full_like(q, float("nan"))
        mha_extend_with_kvcache(
            q, k, v, table, cu_q, seqlens, max(lens_q), max(lens_k), sinks=sinks, out=out, override=kernel
        )
        return (out,)

    return run


def _prefill(kernel, window_left=127):
    def run(dtype, misaligned=False):
        lens = [70, 129]
        g = _gen(3)
        q = torch.randn(sum(lens), 8, 64, generator=g, device="cuda").to(dtype)
        k = torch.randn(sum(lens), 2, 64, generator=g, device="cuda").to(dtype)
        v = torch.randn(sum(lens), 2, 64, generator=g, device="cuda").to(dtype)
        cu = torch.tensor([0, 70, 199], dtype=torch.int32, device="cuda")
        sinks = torch.randn(8, generator=g, device="cuda")
        out = torch.full_like(q, float("nan"))
        mha_prefill(
            q, k, v, cu, cu, max(lens), max(lens), causal=True, window_left=window_left, sinks=sinks, out=out,
            override=kernel,
        )  # fmt: skip
        return (out,)

    return run


def _store(dtype, misaligned=False):
    k_cache, v_cache, _, _, _ = _paged(dtype, [64, 64])
    k_cache.fill_(float("nan"))
    v_cache.fill_(float("nan"))
    g = _gen(4)
    k = torch.randn(20, 2, 64, generator=g, device="cuda").to(dtype)
    v = torch.randn(20, 2, 64, generator=g, device="cuda").to(dtype)
    slots = torch.randperm(k_cache.shape[0] * 16, generator=g, device="cuda")[:20].long()
    store_kvcache(k, v, k_cache, v_cache, slots, override="triton_store_kvcache")
    return k_cache, v_cache


def _topk(dtype, misaligned=False):
    t, e = 5, 128
    buf = torch.randn(t * e + 1, generator=_gen(5), device="cuda").to(dtype)
    logits = buf[1:].view(t, e) if misaligned else buf[: t * e].view(t, e)
    return moe_topk(logits, 4, override="triton_moe_topk")


def _moe(kernel, mxfp4):
    def run(dtype, misaligned=False):
        from tokenspeed_kernel.quant import quantize_mxfp4

        t, e, h, inter = 4, 8, 256, 128
        g = _gen(6)
        x = torch.randn(t, h, generator=g, device="cuda").to(dtype)
        w13 = (torch.randn(e, 2 * inter, h, generator=g, device="cuda") / 16).to(dtype)
        w2 = (torch.randn(e, h, inter, generator=g, device="cuda") / 16).to(dtype)
        if mxfp4:
            w13, w2 = quantize_mxfp4(w13.float()), quantize_mxfp4(w2.float())
        weights, ids = moe_topk(torch.randn(t, e, generator=g, device="cuda"), 2)
        out = torch.full((t, h), float("nan"), dtype=dtype, device="cuda")
        moe_apply(x, w13, w2, weights, ids, activation="swiglu_oai", out=out, override=kernel)
        return (out,)

    return run


CASES = {
    "triton_decode": (_decode("triton_decode"), False),
    "triton_extend": (_extend("triton_extend"), False),
    "triton_prefill": (_prefill("triton_prefill"), False),
    "triton_store_kvcache": (_store, False),
    "triton_moe_topk": (_topk, False),
    "triton_fused_moe": (_moe("triton_fused_moe", False), False),
    "triton_moe_gemv": (_moe("triton_moe_gemv", False), False),
    "triton_moe_gemv_mx": (_moe("triton_moe_gemv_mx", True), False),
    "gluon_decode_sm90": (_decode("gluon_decode_sm90"), True),
    "gluon_prefill_window_sm90": (_prefill("gluon_prefill_window_sm90"), True),
    "gluon_prefill_fa3_sm90": (_prefill("gluon_prefill_fa3_sm90", window_left=-1), True),
    "gluon_extend_fa3_sm90": (_extend("gluon_extend_fa3_sm90"), True),
    "gluon_moe_decode_mx_sm90": (_moe("gluon_moe_decode_mx_sm90", True), True),
    "gluon_moe_mma_sm90": (_moe("gluon_moe_mma_sm90", True), True),
}


def _bits(run, dtype, misaligned, cached):
    from tokenspeed_kernel_triton import _launcher

    previous = _launcher.set_enabled(cached)
    try:
        outs = run(dtype, misaligned)
        torch.cuda.synchronize()
        return [o.clone() for o in outs]
    finally:
        _launcher.set_enabled(previous)


def _same(a, b):
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), "cached launch differs from the normal path"


@pytest.mark.parametrize("name", list(CASES))
def test_cached_launches_match_the_normal_path(name):
    from tokenspeed_kernel_triton import _launcher

    run, needs_sm90 = CASES[name]
    if needs_sm90 and not SM90:
        pytest.skip(f"{name} runs on sm_90 only")
    variants = [(torch.bfloat16, False), (torch.float16, False)]
    if name == "triton_moe_topk":
        variants += [(torch.float32, False), (torch.float32, True)]
    # Served from the cache: a hit of jit_launch's cache, or a BoundLaunch's direct launch
    # (gluon_decode_sm90's functional calls run a runner cached per call key).
    hits = sum(s.hits + s.direct for s in _launcher._KERNELS.values())
    for dtype, misaligned in variants:
        plain = _bits(run, dtype, misaligned, cached=False)
        for _ in range(2):  # fills the cache, then launches from it
            _same(_bits(run, dtype, misaligned, cached=True), plain)
    assert sum(s.hits + s.direct for s in _launcher._KERNELS.values()) > hits, "no launch was served from the cache"


def test_graph_capture_replays_cached_launches():
    """A cached launch inside CUDA-graph capture is captured on the capture stream."""
    run = _decode("triton_decode")
    q_out = _bits(run, torch.bfloat16, False, cached=True)  # warm: compiled and cached
    lens = [1, 37, 300]
    k, v, table, seqlens, sinks = _paged(torch.bfloat16, lens)
    q = torch.randn(len(lens), 8, 64, generator=_gen(1), device="cuda").to(torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        mha_decode_with_kvcache(
            q, k, v, table, seqlens, max(lens), window_left=127, sinks=sinks, out=out, override="triton_decode"
        )
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mha_decode_with_kvcache(
            q, k, v, table, seqlens, max(lens), window_left=127, sinks=sinks, out=out, override="triton_decode"
        )
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    _same([out], q_out)


def _cleared_runner_cache(name):
    """Kernel ``name``'s runner cache (``tokenspeed_kernel_triton._runners``), emptied: its next
    call binds a fresh runner."""
    from tokenspeed_kernel_triton import _runners

    registry.get_kernel(name)  # loads the backends: a kernel module registers its cache on import
    cache = next(c for c in _runners._CACHES if c.name == name)
    cache.clear()
    return cache


# The kernels whose functional calls run a runner cached per call key (tokenspeed_kernel_triton._runners).
# The Gluon TMA kernels' descriptors are derived per run from the layer's tensors (BoundLaunch
# encodes each run's tensor maps).
RUNNER_KERNELS = (
    "triton_decode",
    "triton_extend",
    "triton_prefill",
    "triton_fused_moe",
    "triton_moe_gemv",
    "triton_moe_gemv_mx",
    "gluon_decode_sm90",
    "gluon_prefill_window_sm90",
    "gluon_prefill_fa3_sm90",
    "gluon_extend_fa3_sm90",
)


@pytest.mark.parametrize("name", RUNNER_KERNELS)
def test_functional_runners_match_the_uncached_call_for_every_layer(name):
    """Three "layers" of one call key, each with its own caches, tables, q, out (weights and
    routing for the MoE): served by one runner, bound once, with every tensor of the call
    passed per run, bitwise equal to the uncached call (launch cache off: bound afresh,
    Triton's own path). A runner that launched a stale tensor would repeat layer 0's output."""
    run, needs_sm90 = CASES[name]
    if needs_sm90 and not SM90:
        pytest.skip(f"{name} runs on sm_90 only")
    cache = _cleared_runner_cache(name)
    binds = cache.binds
    outs = []
    try:
        for layer in range(3):
            _LAYER[0] = layer
            plain = _bits(run, torch.bfloat16, False, cached=False)
            got = _bits(run, torch.bfloat16, False, cached=True)
            _same(got, plain)
            outs.append(got[0])
    finally:
        _LAYER[0] = 0
    assert cache.binds == binds + 1, "one runner for the three layers"
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[1], outs[2]), "layers must differ"


# The Gluon TMA kernels whose runners derive their descriptors (``derive_descriptor``) in
# their launches' derived slots: a direct launch reuses its slot's encoding of the tensor's
# address, the tensor's shape, strides, dtype and device checked against the slot's first
# launch (tokenspeed_kernel_triton._launcher).
TMA_RUNNERS = ("gluon_prefill_window_sm90", "gluon_prefill_fa3_sm90", "gluon_extend_fa3_sm90")


def _tma_layer(name, layer):
    """One "layer" of a TMA runner's call: its tensors, held by the caller (so that its
    addresses repeat), and ``call(out)`` that runs it into ``out``."""
    _LAYER[0] = layer
    try:
        g = _gen(7)
        if name == "gluon_extend_fa3_sm90":
            lens_q, lens_k = [3, 17], [40, 90]
            k, v, table, seqlens, sinks = _paged(torch.bfloat16, lens_k)
            q = torch.randn(sum(lens_q), 8, 64, generator=g, device="cuda").to(torch.bfloat16)
            cu_q = torch.tensor([0, 3, 20], dtype=torch.int32, device="cuda")

            def call(out):
                mha_extend_with_kvcache(
                    q, k, v, table, cu_q, seqlens, max(lens_q), max(lens_k), sinks=sinks, out=out, override=name
                )

            return q, call
        lens = [70, 129]
        q = torch.randn(sum(lens), 8, 64, generator=g, device="cuda").to(torch.bfloat16)
        k = torch.randn(sum(lens), 2, 64, generator=g, device="cuda").to(torch.bfloat16)
        v = torch.randn(sum(lens), 2, 64, generator=g, device="cuda").to(torch.bfloat16)
        cu = torch.tensor([0, 70, 199], dtype=torch.int32, device="cuda")
        sinks = torch.randn(8, generator=g, device="cuda")
        window = -1 if name == "gluon_prefill_fa3_sm90" else 127

        def call(out):
            mha_prefill(
                q, k, v, cu, cu, max(lens), max(lens), causal=True, window_left=window, sinks=sinks, out=out,
                override=name,
            )  # fmt: skip

        return q, call
    finally:
        _LAYER[0] = 0


def _tma_out(q, call, cached):
    from tokenspeed_kernel_triton import _launcher

    out = torch.full_like(q, float("nan"))
    previous = _launcher.set_enabled(cached)
    try:
        call(out)
        torch.cuda.synchronize()
    finally:
        _launcher.set_enabled(previous)
    return out


@pytest.mark.parametrize("name", TMA_RUNNERS)
def test_tma_runners_reuse_encoded_descriptors_bitwise(name):
    """Two layers' tensors (held: their addresses repeat) run alternately through one runner:
    after each layer's first direct launch, its descriptors come from their slots' encodings
    (no new encodings) and every output equals the uncached call's bitwise; a third layer at
    new addresses too. A stale encoding would repeat another layer's output."""
    from tokenspeed_kernel_triton import _launcher

    if not SM90:
        pytest.skip(f"{name} runs on sm_90 only")
    # a fresh runner, so its slots are new: an earlier test's slots may hold encodings at the
    # addresses the caching allocator hands these layers again (right for the same layout, but
    # then nothing here would be encoded or kept)
    _cleared_runner_cache(name)
    layers = [_tma_layer(name, layer) for layer in range(2)]
    plain = [_tma_out(q, call, cached=False) for q, call in layers]
    assert not torch.equal(plain[0], plain[1]), "layers must differ"
    start = _launcher.derived_descriptor_stats()
    for q, call in layers * 2:  # binds, then each layer's first direct launch encodes
        _tma_out(q, call, cached=True)
    before = _launcher.derived_descriptor_stats()
    assert before["kept"] - start["kept"] >= 2 * 2, "each layer's descriptors (two or three) encoded and kept"
    for i, (q, call) in enumerate(layers * 2):
        _same([_tma_out(q, call, cached=True)], [plain[i % 2]])
    after = _launcher.derived_descriptor_stats()
    assert after == before, "every descriptor of a repeated layer: its slot's encoding"
    spacer = torch.empty(1 << 20, device="cuda")  # the third layer lands elsewhere
    q, call = _tma_layer(name, 2)
    _same([_tma_out(q, call, cached=True)], [_tma_out(q, call, cached=False)])
    del spacer


def test_graph_capture_of_memoized_descriptors_replays_bitwise():
    """A TMA runner's launch captured in a CUDA graph with its descriptors from their slots'
    encodings (the tensor maps are kernel parameters, copied into the graph at capture)
    replays the uncached call's bits."""
    name = "gluon_prefill_fa3_sm90"
    if not SM90:
        pytest.skip(f"{name} runs on sm_90 only")
    q, call = _tma_layer(name, 0)
    plain = _tma_out(q, call, cached=False)
    for _ in range(3):  # bound, encoded, served from the slots
        _tma_out(q, call, cached=True)
    out = torch.full_like(q, float("nan"))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call(out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    _same([out], [plain])
