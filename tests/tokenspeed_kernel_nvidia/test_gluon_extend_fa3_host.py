"""Host logic of ``gluon_extend_fa3_sm90`` on CPU: the key band each work tile visits and the
tiles it masks and cleans (vs brute force over every (query, key) pair, with and without a
window), the TMA boxes of a key tile (vs the page of every key), the page sizes it tiles,
registration metadata and call checks, and a float64 emulation of the kernel's schedule
(boxes gathered through the page table with out-of-range pages zero-filled, stale slots
poisoned with NaN, masks and V cleaning only where the plain-Python mirror says) against a
dense attention over the sequence's keys."""

import math

import pytest
import torch

from tokenspeed_kernel import registry, selector
from tokenspeed_kernel.ops.attention.args import ExtendArgs
from tokenspeed_kernel.platform import platform_from_arch
from tokenspeed_kernel.registry import Priority, Request
from tokenspeed_kernel_nvidia.ops.attention import gluon_extend_fa3 as ext

BLOCK_N = 128
NAME = "gluon_extend_fa3_sm90"
# (len_q, len_k): prefix 0, partial tiles, one token, a long prefix, a chunk of one tile
LENGTHS = [(1, 1), (37, 37), (128, 128), (129, 300), (5, 40), (3, 200), (200, 457), (256, 1000)]
WINDOWS = [ext.NO_WINDOW, 0, 5, 127, 200]


def _sees(p: int, key: int, len_k: int, window: int) -> bool:
    return 0 <= key < len_k and 0 <= p - key <= window


@pytest.mark.parametrize("len_q,len_k", LENGTHS)
@pytest.mark.parametrize("window", WINDOWS)
def test_band_covers_what_rows_see_and_masks_only_where_needed(len_q, len_k, window):
    for m0 in range(0, len_q, ext.BLOCK_M):
        j_lo, n_kv = ext.key_band(len_q, len_k, m0, BLOCK_N, window)
        tiles = range(j_lo, j_lo + n_kv)
        p0 = len_k - len_q + m0
        real = [len_k - len_q + t for t in range(m0, min(m0 + ext.BLOCK_M, len_q))]
        seen = {key // BLOCK_N for p in real for key in range(len_k) if _sees(p, key, len_k, window)}
        assert seen == set(tiles)  # every tile some row sees, and no other
        for j in tiles:
            keys = range(j * BLOCK_N, (j + 1) * BLOCK_N)
            for wg in (0, 1):
                first = p0 + wg * ext.HALF
                rows = [p for p in real if first <= p < first + ext.HALF]
                if rows and not ext.masked(j, first, first + ext.HALF - 1, BLOCK_N, window):
                    assert all(_sees(p, key, len_k, window) for p in rows for key in keys)
            if not ext.dirty(j, p0, BLOCK_N, window):
                # a clean tile: real keys only, every one seen by every row of the tile
                assert all(key < len_k and _sees(p, key, len_k, window) for p in real for key in keys)


@pytest.mark.parametrize("page_size", [8, 16, 32, 128, 256])
@pytest.mark.parametrize("len_k", [1, 16, 100, 300, 1000])
def test_boxes_hold_each_key_on_its_page(page_size, len_k):
    rows = ext.box_rows(page_size, BLOCK_N)
    max_pages = math.ceil(len_k / page_size) + 1  # a table wider than the sequence
    for j in range(math.ceil(len_k / BLOCK_N) + 1):
        boxes = ext.page_boxes(j, BLOCK_N, page_size, len_k, max_pages)
        assert len(boxes) == BLOCK_N // rows
        for key in range(j * BLOCK_N, (j + 1) * BLOCK_N):
            col, tok = boxes[(key - j * BLOCK_N) // rows]
            if key < len_k:
                assert col == key // page_size and tok + (key - j * BLOCK_N) % rows == key % page_size
            elif col is not None:  # a real page past the sequence: its stale tail
                assert col == key // page_size and col < math.ceil(len_k / page_size)


def test_page_sizes_are_whole_swizzle_atoms():
    assert [p for p in (1, 2, 4, 8, 16, 32, 64, 128, 256) if ext.supported_page(p)] == [8, 16, 32, 64, 128, 256]
    assert not ext.supported_page(24) and ext.box_rows(256, BLOCK_N) == BLOCK_N


def _extend_request(page_size=16, head_dim=64, kv=torch.bfloat16, features=("sinks", "sliding_window")):
    shapes = {"head_dim": head_dim, "head_dim_v": head_dim, "num_q_heads": 64, "num_kv_heads": 8}
    return Request.make(
        "attention.extend", {"q": torch.bfloat16, "kv": kv}, shapes | {"page_size": page_size}, features
    )


def test_ranked_first_only_where_measured_faster():
    """Unwindowed extend at head dims 64 and 128 (H200, 2026-11-28: 1.5-2.7x triton_extend at 64,
    2.1-3.4x at 128, extend-lengths-d128); with GPT-OSS's 128-token window (slower there)
    triton_extend stays first."""

    def winner(request):
        return selector.explain(request, platform=platform_from_arch("sm_90")).winner.name

    assert winner(_extend_request(features=("sinks",))) == NAME
    assert winner(_extend_request(features=("sinks", "return_lse", "strided_kv"))) == NAME
    windowed = _extend_request(features=("sinks", "sliding_window"))
    windowed = Request.make(
        windowed.op, dict(windowed.dtypes), {**dict(windowed.shapes), "window_left": 127}, windowed.features
    )
    assert winner(windowed) == "triton_extend"
    assert winner(_extend_request(head_dim=128, features=("sinks",))) == NAME


def test_registered_opt_in_on_sm90_with_honest_gates():
    spec = registry.get_kernel(NAME)
    assert spec.op == "attention.extend" and spec.priority == Priority.OPT_IN < Priority.PORTABLE
    assert spec.archs == frozenset({"sm_90"})
    assert {"logit_cap", "non_causal", "fp8_kv"}.isdisjoint(spec.features)
    assert {"sinks", "sliding_window", "return_lse", "strided_kv"} <= spec.features

    def reasons(request, arch="sm_90"):
        selection = selector.explain(request, platform=platform_from_arch(arch))
        return {c.spec.name: c.reasons for c in selection.candidates}[NAME]

    assert not reasons(_extend_request())  # GPT-OSS's extend on an H100/H200
    assert not reasons(_extend_request(head_dim=128, page_size=8))
    assert reasons(_extend_request(page_size=4))  # boxes under the 8-row swizzle atom
    assert reasons(_extend_request(kv=torch.float8_e4m3fn))
    assert reasons(_extend_request(features=("logit_cap",)))
    assert reasons(_extend_request(features=("non_causal",)))
    assert reasons(_extend_request(head_dim=96))
    assert reasons(_extend_request(), arch="sm_80")


def _args(**over) -> ExtendArgs:
    """A small CPU ExtendArgs (the call checks read no device memory)."""
    q = torch.zeros(5, 8, 64, dtype=torch.bfloat16)
    cache = torch.zeros(4, 16, 1, 64, dtype=torch.bfloat16)
    fields = dict(
        q=q,
        k_cache=cache,
        v_cache=cache.clone(),
        page_table=torch.zeros(1, 4, dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, 5], dtype=torch.int32),
        cache_seqlens=torch.tensor([40], dtype=torch.int32),
        max_seqlen_q=5,
        max_seqlen_k=40,
        causal=True,
        softmax_scale=0.125,
        window_left=-1,
        sinks=None,
        logit_cap=0.0,
        k_scale=None,
        v_scale=None,
        out=torch.empty_like(q),
        lse=None,
    )
    return ExtendArgs(**(fields | over))


def test_call_checks_name_what_the_request_cannot_express():
    ext._check_call(_args())  # the baseline passes
    pool = torch.zeros(4, 16, 1, 64 + 4, dtype=torch.bfloat16)  # 136-byte token stride
    bad = [
        (dict(causal=False), "causal"),
        (dict(logit_cap=30.0), "logit cap"),
        (dict(k_cache=pool[..., :64]), "k_cache"),
        (dict(v_cache=pool[..., 4:]), "v_cache"),
        (dict(k_cache=torch.zeros(4, 4, 1, 64, dtype=torch.bfloat16)), "page_size"),
        (dict(k_cache=torch.zeros(4, 16, 1, 64, dtype=torch.float16)), "dtype"),
    ]
    for over, needle in bad:
        with pytest.raises(ValueError, match=needle):
            ext._check_call(_args(**over))


def test_plan_carries_the_dense_variants_and_rejects_what_the_extend_cannot_run():
    from tokenspeed_kernel_nvidia.ops.attention._gluon_extend_fa3_kernel import extend_fa3_kernel

    plan = ext.extend_plan(64, 16, pv_overlap=True, exp2_poly=1)
    consts = plan.constexprs(64, 8, sinks=True, lse=False)
    assert consts["PV_OVERLAP"] is True and consts["EXP2_POLY"] == 1 and consts["NUM_WG"] == 2
    assert (consts["HQ"], consts["G"], consts["D"], consts["PAGE"], consts["BOX"]) == (64, 8, 64, 16, 16)
    # the launcher passes exactly the kernel's compile-time parameters (the plan's, and per
    # launch whether the batch's tiles are listed)
    kernel_consts = {p.name for p in extend_fa3_kernel.params if p.is_constexpr}
    assert set(consts) | {"TILE_LIST"} == kernel_consts
    assert ext.extend_plan(64, 16).cfg.pv_overlap is False  # the shipped default
    with pytest.raises(ValueError, match="consumers"):
        ext.extend_plan(64, 16, consumers=3, consumer_regs=160, producer_regs=24, maxnreg=128)
    with pytest.raises(ValueError, match="plan"):
        ext.launch(_args(), ext.extend_plan(64, 32))  # a plan for another page size


def _emulate(q, k_cache, v_cache, table, len_q, len_k, window, sink, scale):
    """The kernel's arithmetic for one sequence and head (float64): per work tile and
    warpgroup, key tiles from the diagonal down, each gathered box by box as the TMA unit
    would (an out-of-range page reads zeros), mask only on masked tiles, V cleaned of
    non-finite values only on dirty tiles, online softmax in base 2, sink in the epilogue."""
    page = k_cache.shape[1]
    rows_box = ext.box_rows(page, BLOCK_N)
    out = torch.zeros(len_q, q.shape[-1], dtype=torch.float64)
    for m0 in range(0, len_q, ext.BLOCK_M):
        j_lo, n_kv = ext.key_band(len_q, len_k, m0, BLOCK_N, window)
        p0 = len_k - len_q + m0
        for wg in (0, 1):
            first = p0 + wg * ext.HALF
            pos = torch.arange(first, first + ext.HALF)
            toks = pos - (len_k - len_q)
            qi = q[toks.clamp(max=len_q - 1)]
            m_i = torch.full((ext.HALF,), -math.inf, dtype=torch.float64)
            l_i = torch.zeros(ext.HALF, dtype=torch.float64)
            acc = torch.zeros(ext.HALF, q.shape[-1], dtype=torch.float64)
            for j in range(j_lo + n_kv - 1, j_lo - 1, -1):
                kt, vt = [], []
                for col, tok in ext.page_boxes(j, BLOCK_N, page, len_k, table.shape[0]):
                    for cache, dst in ((k_cache, kt), (v_cache, vt)):
                        if col is None:
                            dst.append(torch.zeros(rows_box, cache.shape[-1], dtype=torch.float64))
                        else:
                            dst.append(cache[int(table[col]), tok : tok + rows_box])
                kj, vj = torch.cat(kt), torch.cat(vt)
                s = (qi @ kj.T) * scale * math.log2(math.e)
                if ext.masked(j, first, first + ext.HALF - 1, BLOCK_N, window):
                    dist = pos[:, None] - (j * BLOCK_N + torch.arange(BLOCK_N))[None, :]
                    s = torch.where((dist >= 0) & (dist <= window), s, -math.inf)
                if ext.dirty(j, p0, BLOCK_N, window):
                    vj = torch.where(vj.isfinite(), vj, 0.0)
                m_new = torch.maximum(m_i, s.max(1).values)
                m_use = torch.where(m_new == -math.inf, 0.0, m_new)
                alpha = torch.exp2(m_i - m_use)
                p = torch.exp2(s - m_use[:, None])
                l_i = l_i * alpha + p.sum(1)
                acc = acc * alpha[:, None] + p @ vj
                m_i = m_new
            sink2 = sink * math.log2(math.e) if sink is not None else -math.inf
            m_fin = torch.maximum(m_i, torch.tensor(sink2, dtype=torch.float64))
            m_use = torch.where(m_fin == -math.inf, 0.0, m_fin)
            l_fin = l_i * torch.exp2(m_i - m_use) + (0.0 if sink is None else torch.exp2(sink2 - m_use))
            res = acc * torch.exp2(m_i - m_use)[:, None] / torch.where(l_fin > 0, l_fin, 1.0)[:, None]
            keep = (toks >= 0) & (toks < len_q)
            out[toks[keep]] = res[keep]
    return out


def _dense(q, keys, vals, len_q, len_k, window, sink, scale):
    s = (q @ keys.T) * scale
    pos = torch.arange(len_k - len_q, len_k)[:, None]
    dist = pos - torch.arange(len_k)[None, :]
    s = torch.where((dist >= 0) & (dist <= window), s, -math.inf)
    if sink is not None:
        s = torch.cat([s, torch.full((len_q, 1), sink, dtype=torch.float64)], 1)
        vals = torch.cat([vals, torch.zeros(1, vals.shape[-1], dtype=torch.float64)])
    w = torch.softmax(s, 1)
    return torch.nan_to_num(w) @ vals


@pytest.mark.parametrize(
    ("len_q", "len_k", "page", "window", "sink"),
    [
        (37, 37, 16, ext.NO_WINDOW, None),  # prefix 0, partial page
        (129, 300, 16, ext.NO_WINDOW, 0.7),  # a prefix, partial tiles, sink
        (200, 457, 8, 127, 0.3),  # GPT-OSS's window
        (5, 260, 256, ext.NO_WINDOW, None),  # a page larger than a key tile
        (70, 70, 32, 5, -1.0),
    ],
)
def test_emulated_schedule_matches_dense_attention_with_stale_nan(len_q, len_k, page, window, sink):
    g = torch.Generator().manual_seed(len_q + len_k + page)
    d, scale = 64, 0.125
    n_pages = math.ceil(len_k / page)
    num_pages = n_pages + 3
    table = torch.randperm(num_pages, generator=g)[:n_pages]
    k_cache = torch.full((num_pages, page, d), math.nan, dtype=torch.float64)
    v_cache = torch.full((num_pages, page, d), math.nan, dtype=torch.float64)
    keys = torch.randn(len_k, d, generator=g, dtype=torch.float64)
    vals = torch.randn(len_k, d, generator=g, dtype=torch.float64)
    for key in range(len_k):  # every slot no key lives in stays NaN (stale pages and tails)
        k_cache[table[key // page], key % page] = keys[key]
        v_cache[table[key // page], key % page] = vals[key]
    q = torch.randn(len_q, d, generator=g, dtype=torch.float64)
    got = _emulate(q, k_cache, v_cache, table, len_q, len_k, window, sink, scale)
    want = _dense(q, keys, vals, len_q, len_k, window, sink, scale)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


# --- the tile list of a ragged batch (the pre-pass, _tile_list) ---------------------------


@pytest.mark.parametrize(
    "lens_q,heads",
    [((1024, 300, 37, 2), 64), ((5, 0, 260, 129), 8), ((128, 129), 6), ((1,) * 70, 4), ((0, 0, 300), 8)],
)
def test_tile_list_lists_the_tiles_holding_queries_in_walk_order(lens_q, heads, monkeypatch):
    """The pre-pass (Triton: compiled on a GPU host, under the interpreter on a CPU) writes the
    count and the walk's indices of the tiles that hold queries, as the plain-Python mirror
    does; the entries past the count stay untouched; decoded as the kernel decodes them, each
    is a tile with queries."""
    from tokenspeed_kernel.kit import cdiv
    from tokenspeed_kernel_nvidia.ops.attention import _tile_list

    on_gpu = torch.cuda.is_available()  # there tl.cumsum is a compiled helper the interpreter cannot call
    device = "cuda" if on_gpu else "cpu"
    n_m = max(cdiv(max(lens_q), ext.BLOCK_M), 1)
    cu = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device=device)
    batch = len(lens_q)
    tiles = torch.full((_tile_list.list_length(n_m, batch, heads),), -7, dtype=torch.int32, device=device)
    args, constexprs = _tile_list.launch_args(cu, tiles, n_m, batch, heads, ext.BLOCK_M)
    if on_gpu:
        _tile_list.tile_list_kernel[(1,)](*args, **constexprs)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        constexprs.pop("num_warps")
        _interpreted(_tile_list.tile_list_kernel)[(1,)](*args, **constexprs)
    tiles = tiles.cpu()
    want = _tile_list.reference(list(lens_q), n_m, heads, ext.BLOCK_M)
    assert tiles[: len(want)].tolist() == want
    assert (tiles[len(want) :] == -7).all(), "past the count: untouched"
    for t in want[1:]:
        m_rev, rest = divmod(t, batch * heads)
        b = rest // heads
        assert (n_m - 1 - m_rev) * ext.BLOCK_M < lens_q[b]


@pytest.mark.parametrize("block_m", [128, 192])
def test_a_launch_skips_the_list_only_where_every_tile_holds_queries(block_m):
    """``lists_tiles`` (host integers only) never skips a list that would leave tiles out: where
    it says no, the plain-Python mirror lists every tile of the walk; and uniform batches,
    one sequence and one block skip it."""
    from tokenspeed_kernel.kit import cdiv
    from tokenspeed_kernel_nvidia.ops.attention._tile_list import lists_tiles, reference

    g = torch.Generator().manual_seed(block_m)
    batches = [[int(n) for n in torch.randint(1, 5 * block_m, (b,), generator=g)] for b in (2, 3, 5, 8) * 25]
    batches += [[n] * b for n in (1, block_m - 1, block_m, block_m + 1, 1000, 4096) for b in (2, 7)]
    batches += [[3 * block_m, 3 * block_m - 1], [2 * block_m + 1, 3 * block_m]]
    for lens in batches:
        n_m = max(cdiv(max(lens), block_m), 1)
        listed = lists_tiles(sum(lens), max(lens), len(lens), n_m, block_m)
        every_tile = reference(lens, n_m, 1, block_m)[0] == n_m * len(lens)
        assert listed or every_tile, lens
        if len(set(lens)) == 1 or n_m == 1:
            assert not listed, lens
    assert lists_tiles(3 * block_m - 1 + 2 * block_m + 1, 3 * block_m, 2, 3, block_m)  # one block short


def _interpreted(kernel):
    """``kernel``'s function as an interpreter kernel (this module imported it as a compiled one)."""
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(kernel.fn)


def test_a_ragged_batch_lists_its_tiles_before_the_kernel_and_one_sequence_does_not(monkeypatch):
    """The launch building: several sequences whose longest has several query blocks get the
    pre-pass first (its buffer the one scratch, handed to the kernel with TILE_LIST); one
    sequence, one block, or a uniform batch launches the kernel alone over every tile (the
    buffer argument a placeholder it never reads)."""
    from tokenspeed_kernel_nvidia.ops.attention import _tile_list

    monkeypatch.setattr(ext, "sm_count", lambda device: 132)  # an H100's (the CPU has none)
    pages = torch.zeros(40, 16, 1, 64, dtype=torch.bfloat16)

    def args(lens_q):
        q = torch.zeros(sum(lens_q), 8, 64, dtype=torch.bfloat16)
        return _args(
            q=q,
            k_cache=pages,
            v_cache=pages.clone(),
            page_table=torch.zeros(len(lens_q), 10, dtype=torch.int32),
            cu_seqlens_q=torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32),
            cache_seqlens=torch.tensor([n + 10 for n in lens_q], dtype=torch.int32),
            max_seqlen_q=max(lens_q),
            max_seqlen_k=max(lens_q) + 10,
            out=torch.empty_like(q),
        )

    def built(lens_q):
        launches, scratch, *_ = ext._launches(args(lens_q))
        return launches, scratch

    launches, scratch = built([300, 37, 2])
    assert [launch.fn for launch in launches] == [_tile_list.tile_list_kernel, launches[1].fn]
    (tiles,) = scratch
    assert tiles.dtype == torch.int32 and tiles.numel() == _tile_list.list_length(3, 3, 8)
    assert launches[0].args[1] is tiles and launches[1].args[-1] is tiles and launches[1].kwargs["TILE_LIST"]
    for lens in ([300], [100, 37, 2], [300, 300]):  # one sequence; one query block; uniform
        launches, scratch = built(lens)
        assert len(launches) == 1 and scratch == () and not launches[0].kwargs["TILE_LIST"]


def test_a_variant_build_is_another_runner_key(monkeypatch):
    """The runner key holds the build (:func:`extend_plan`'s key): a call after the GPU tests
    patch ``extend_plan`` to a variant binds a runner of its own instead of reusing the default
    build's (before, the variant tests could run the default build)."""
    monkeypatch.setattr(ext, "sm_count", lambda device: 132)  # an H100's (the CPU has none)
    args = _args()
    default = ext._runner_key(args)
    plan = ext.extend_plan
    for variant in ({"pv_overlap": True}, {"exp2_poly": 1}, {"rescale_threshold": 8.0}):
        monkeypatch.setattr(ext, "extend_plan", lambda d, p, v=variant: plan(d, p, **v))
        assert ext._runner_key(args) != default, variant
    monkeypatch.setattr(ext, "extend_plan", plan)
    assert ext._runner_key(args) == default
