"""Host logic of ``gluon_prefill_fa3_sm90`` on CPU: the heaviest-first tile order, the key tiles
each consumer warpgroup visits and masks (vs brute force over every (query, key) pair), the
persistent grid, the configuration table, call-time checks, the FMA-pipe exp2 (its float32
model against float64, and the PTX it emits), and a float64 emulation of the kernel's schedule
(persistent programs, two or three 64-row warpgroups, key tiles from the diagonal down, the
P·V product one step behind the softmax, sink in the epilogue, TMA rows read past a
sequence; the variants: the polynomial exp2, the lazy rescale) against the independent naive
attention."""

import dataclasses
import math
import re
import struct

import pytest
import torch
from support.naive_attention import naive_prefill
from support.online_softmax import close_online_softmax
from support.prefill_args import ragged_prefill_args

from tokenspeed_kernel_nvidia.ops.attention import gluon_prefill_fa3 as fa3

LENGTHS = [
    (1, 1),
    (37, 37),
    (64, 64),
    (65, 65),
    (128, 128),
    (129, 129),
    (300, 300),
    (5, 40),
    (16, 17),
    (3, 200),
    (40, 5),
]


def _visible(p: int, j: int, len_k: int) -> bool:
    return 0 <= j < len_k and j <= p


@pytest.mark.parametrize("len_q,len_k", LENGTHS)
@pytest.mark.parametrize("block_n", [64, 128])
@pytest.mark.parametrize("consumers", [2, 3])
def test_key_tiles_cover_what_rows_see_and_mask_only_where_needed(len_q, len_k, block_n, consumers):
    block_m = consumers * fa3.HALF
    for m0 in range(0, len_q, block_m):
        rows_all = [len_k - len_q + t for t in range(m0, min(m0 + block_m, len_q))]
        counts = set()
        for wg in range(consumers):
            n_kv, n_masked = fa3.key_tiles(len_q, len_k, m0, wg, block_n, block_m)
            counts.add(n_kv)
            assert 0 <= n_masked <= n_kv
            first = m0 + wg * fa3.HALF
            rows = [len_k - len_q + t for t in range(first, min(first + fa3.HALF, len_q))]
            need = {j for p in rows for j in range(len_k) if _visible(p, j, len_k)}
            assert need <= set(range(n_kv * block_n))  # every visible key is in a visited tile
            # visiting order j = n_kv - 1 .. 0: the first n_masked are masked, the rest fully visible
            for i in range(n_kv):
                j = n_kv - 1 - i
                if i >= n_masked:
                    assert all(_visible(p, j * block_n + c, len_k) for p in rows for c in range(block_n))
        # all warpgroups visit the same tiles (the ping-pong hand-off counts rounds), and no
        # more than the tile's last real row needs
        assert len(counts) == 1
        (n_kv,) = counts
        seen = {j for p in rows_all for j in range(len_k) if _visible(p, j, len_k)}
        assert n_kv == (math.ceil((max(seen) + 1) / block_n) if seen else 0)


@pytest.mark.parametrize("max_q,batch,heads", [(8192, 1, 64), (4096, 4, 64), (300, 3, 8), (1, 1, 1)])
def test_tile_order_is_a_permutation_heaviest_first(max_q, batch, heads):
    programs, n_m = fa3.grid(max_q, batch, heads, 132)
    assert n_m == math.ceil(max_q / fa3.BLOCK_M) and 1 <= programs <= 132
    total = n_m * batch * heads
    seen = [fa3.tile_order(t, n_m, batch, heads) for t in range(total)]
    assert sorted(seen) == sorted((m, b, h) for m in range(n_m) for b in range(batch) for h in range(heads))
    # equal lengths: the work of a tile (its key tiles) never increases along the order
    work = [fa3.key_tiles(max_q, max_q, m * fa3.BLOCK_M, 1, 128)[0] for m, _, _ in seen]
    assert work == sorted(work, reverse=True)
    # neighbours in the order: the query heads of one KV head (L2 reuse of its K/V tiles)
    assert [h for _, _, h in seen[:heads]] == list(range(heads))


def test_gpt_oss_schedule():
    # S = 8192, 64 heads: 64 query blocks x 64 heads = 4096 tiles on 132 SMs; the first wave
    # holds the last blocks (64 key tiles each), and a tile masks only its diagonal tile.
    programs, n_m = fa3.grid(8192, 1, 64, 132)
    assert (programs, n_m) == (132, 64)
    assert fa3.tile_order(0, n_m, 1, 64) == (63, 0, 0)
    assert fa3.key_tiles(8192, 8192, 63 * 128, 0, 128) == (64, 1)
    assert fa3.key_tiles(8192, 8192, 63 * 128, 1, 128) == (64, 1)
    assert fa3.key_tiles(4096, 8192, 0, 0, 128) == (33, 1)  # Lk > Lq: bottom-right aligned


WINDOWS = [0, 4, 127, 200, 5000, fa3.NO_WINDOW]


def _sees(p: int, key: int, len_k: int, window: int) -> bool:
    return 0 <= key < len_k and 0 <= p - key <= window


@pytest.mark.parametrize("len_q,len_k", [*LENGTHS, (600, 600), (256, 700)])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("block_n", [64, 128])
@pytest.mark.parametrize("consumers", [2, 3])
def test_window_band_covers_what_rows_see_and_masks_only_the_edges(len_q, len_k, window, block_n, consumers):
    block_m = consumers * fa3.HALF
    for m0 in range(0, len_q, block_m):
        j_lo, n_kv = fa3.key_band(len_q, len_k, m0, block_n, window, block_m)
        tiles = range(j_lo, j_lo + n_kv)
        p0 = len_k - len_q + m0
        real = [len_k - len_q + t for t in range(m0, min(m0 + block_m, len_q))]
        seen = {key // block_n for p in real for key in range(len_k) if _sees(p, key, len_k, window)}
        assert seen == set(tiles)  # every tile some row of the work tile sees, and no other
        for wg in range(consumers):
            first = p0 + wg * fa3.HALF
            rows = [p for p in real if first <= p < first + fa3.HALF]
            for j in tiles:
                keys = range(j * block_n, (j + 1) * block_n)
                if rows and not fa3.edge(j, first, first + fa3.HALF - 1, block_n, window):
                    # an unmasked tile: real keys, every one inside every row's window
                    assert all(_sees(p, key, len_k, window) for p in rows for key in keys)


def test_gpt_oss_window_schedule():
    # S = 8192, window 127, 64-key tiles: every work tile past the first visits 4 key tiles
    # (the band [p0 - 127, p0 + 127] aligned out to 256 keys, as with 2 tiles of 128), of
    # which each warpgroup masks 3 (its window's edge, its diagonal, the tile past it) and
    # sees one whole
    cfg = fa3.fa3_window_config(64)
    assert (cfg.block_n, cfg.stages, cfg.window) == (64, 4, True)
    for m in (1, 10, 63):
        m0 = m * fa3.BLOCK_M
        j_lo, n_kv = fa3.key_band(8192, 8192, m0, 64, 127)
        assert (j_lo, n_kv) == (m0 // 64 - 2, 4)
        assert fa3.key_band(8192, 8192, m0, 128, 127) == (m0 // 128 - 1, 2)
        for wg in (0, 1):
            first = m0 + wg * fa3.HALF
            edges = [fa3.edge(j, first, first + fa3.HALF - 1, 64, 127) for j in range(j_lo, j_lo + n_kv)]
            assert sum(edges) == 3, (m, wg, edges)
    assert fa3.key_band(8192, 8192, 0, 64, 127) == (0, 2)  # the first tile: no keys before it
    assert fa3.key_band(4096, 8192, 0, 64, 127) == (62, 4)  # Lk > Lq: the band moves right
    for d in fa3.HEAD_DIMS:
        w = fa3.fa3_window_config(d)
        assert w.window and w.shared_bytes() <= 227 * 1024 and "-sw" in w.tag
        assert not fa3.fa3_config(d).window  # the causal-only build is unchanged


@pytest.mark.parametrize("len_q,len_k", [*LENGTHS, (600, 600), (256, 700), (129, 1), (200, 73)])
@pytest.mark.parametrize("window", [None, 0, 4, 127, 200])
@pytest.mark.parametrize("block_n", [64, 128])
@pytest.mark.parametrize("consumers", [2, 3])
def test_dirty_tiles_hold_every_key_some_row_of_the_work_tile_cannot_see(len_q, len_k, window, block_n, consumers):
    # docs/api.md: a NaN/inf key or value a query cannot see never reaches it. The kernel
    # cleans the V tiles ``dirty`` names (every warpgroup of the work tile the same ones: they
    # meet on a barrier): brute force over every (row, key) pair of each visited tile, keys
    # past the sequence included (the dense view's next sequence: seen by no row).
    block_m = consumers * fa3.HALF
    w = fa3.NO_WINDOW if window is None else window
    for m0 in range(0, len_q, block_m):
        p0 = len_k - len_q + m0
        real = [p0 + t for t in range(min(block_m, len_q - m0))]
        if window is None:
            n_kv, n_unclean = fa3.key_tiles(len_q, len_k, m0, 0, block_n, block_m)
            tiles = [n_kv - 1 - i for i in range(n_kv)]  # visiting order
            # the kernel's causal walk: the first n_unclean visited tiles are the dirty ones
            assert [fa3.dirty(j, p0, block_n, w, block_m) for j in tiles] == [i < n_unclean for i in range(n_kv)]
            for wg in range(consumers):  # a tile a warpgroup masks is dirty
                n_masked = fa3.key_tiles(len_q, len_k, m0, wg, block_n, block_m)[1]
                assert n_masked <= n_unclean
        else:
            j_lo, n_kv = fa3.key_band(len_q, len_k, m0, block_n, w, block_m)
            tiles = list(range(j_lo + n_kv - 1, j_lo - 1, -1))
        for j in tiles:
            keys = range(j * block_n, (j + 1) * block_n)
            unseen = any(not _sees(p, key, len_k, w) for p in real for key in keys)
            if unseen:
                assert fa3.dirty(j, p0, block_n, w, block_m), (m0, j)
            if window is None or len(real) == block_m:
                # exact when the rule's last row is a real one (causal: only the first row counts)
                assert fa3.dirty(j, p0, block_n, w, block_m) == unseen, (m0, j)
            if (j + 1) * block_n > len_k:  # keys past the sequence (the next one's rows): dirty
                assert fa3.dirty(j, p0, block_n, w, block_m)


def test_config_table():
    for d in fa3.HEAD_DIMS:
        cfg = fa3.fa3_config(d)
        assert cfg.head_dim == d and cfg.block_n == 128
        assert cfg.shared_bytes() <= 227 * 1024
        warps = 4 * (cfg.consumers + 1)
        # the warps at maxnreg fit the register file; the warpgroups' split fits the launch
        assert cfg.maxnreg * warps * 32 <= 65536
        assert (cfg.consumers * cfg.consumer_regs + cfg.producer_regs) <= (cfg.consumers + 1) * cfg.maxnreg
        assert cfg.consumer_regs % 8 == 0 and cfg.producer_regs % 8 == 0 and 24 <= cfg.producer_regs
    # D = 64 ships three consumer warpgroups (192-row tiles: Q 192 x 64, a 3-stage K/V ring)
    assert fa3.fa3_config(64) == fa3.fa3_variant(64, wide=True, stages=3) and fa3.fa3_config(64).block_m == 192
    assert fa3.fa3_config(64).shared_bytes() == 2 * 64 * (192 + 2 * 3 * 128)
    assert fa3.fa3_config(128).stages == 2 and fa3.fa3_config(128).consumers == 2
    # the paged extend keeps two at both head dims
    assert all(c.consumers == 2 and c.block_m == 128 for c in fa3.TWO_CONSUMER_CONFIGS.values())


def _args(**kw):
    args = ragged_prefill_args(lens_q=(4,), lens_k=(4,), hq=8, hkv=1)
    for name, value in kw.items():
        setattr(args, name, value)
    return args


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"causal": False}, "causal"),
        ({"window_left": 127}, "window"),
        ({"logit_cap": 30.0}, "logit cap"),
        ({"softmax_scale": -0.1}, "softmax_scale"),
        ({"q": torch.zeros(4 * 8 * 64 + 1, dtype=torch.bfloat16)[1:].view(4, 8, 64)}, "q 16-byte"),
    ],
)
def test_call_time_checks_reject_what_the_request_cannot_say(kw, match):
    with pytest.raises(ValueError, match=match):
        fa3.gluon_prefill_fa3(_args(**kw))


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"window_left": -1}, "windowed build"),
        ({"causal": False, "window_left": 127}, "causal"),
        ({"logit_cap": 30.0, "window_left": 127}, "logit cap"),
        ({"softmax_scale": 0.0, "window_left": 127}, "softmax_scale"),
        ({"head_dim_check": True}, "head_dim 96"),
    ],
)
def test_windowed_build_rejects_what_it_cannot_serve(kw, match):
    if kw.pop("head_dim_check", False):
        args = ragged_prefill_args(lens_q=(4,), lens_k=(4,), hq=8, hkv=1, d=96, window_left=127)
    else:
        args = _args(**kw)
    with pytest.raises(ValueError, match=match):
        fa3.gluon_prefill_fa3_window(args)
    # a configuration of the other build is refused too, before any launch
    with pytest.raises(ValueError, match="unwindowed build"):
        fa3.launch(_args(window_left=127), fa3.fa3_config(64))


def _prefill_request(head_dim=64, **options):
    from tokenspeed_kernel.ops.attention.api import attention_request
    from tokenspeed_kernel.ops.attention.args import Heads

    heads = Heads(64, 8, head_dim, head_dim)
    return attention_request(
        "attention.prefill", q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, heads=heads, **options
    )


def test_window_build_registered_opt_in_and_ranked_below_the_measured_window_kernel():
    from tokenspeed_kernel import registry, selector
    from tokenspeed_kernel.platform import platform_from_arch
    from tokenspeed_kernel.registry import Priority

    name = "gluon_prefill_fa3_window_sm90"
    spec = registry.get_kernel(name)
    assert spec.op == "attention.prefill" and spec.archs == frozenset({"sm_90"})
    # measured on an H200 (2026-11-28): 1.6x slower than gluon_prefill_window_sm90 at window 127
    assert spec.priority == Priority.OPT_IN and spec.rank_rules == ()
    assert spec.features == frozenset({"sinks", "sliding_window", "return_lse", "strided_q"})
    # the causal-only registration: no window, ranked performant from its measured length
    dense = registry.get_kernel("gluon_prefill_fa3_sm90")
    assert "sliding_window" not in dense.features and {priority for _, priority in dense.rank_rules} == {
        Priority.PERFORMANT
    }

    def verdict(request, arch="sm_90"):
        selection = selector.explain(request, platform=platform_from_arch(arch))
        return {c.spec.name: c.reasons for c in selection.candidates}, selection

    gpt_oss = _prefill_request(sinks=True, window_left=127)
    reasons, selection = verdict(gpt_oss)
    assert reasons[name] == ()
    # gluon_prefill_window_sm90 (measured first at window 127, D 64) stays the choice
    assert selection.winner.name == "gluon_prefill_window_sm90"
    assert verdict(_prefill_request(head_dim=128, window_left=1000))[0][name] == ()
    assert _reasons_has(verdict(_prefill_request(sinks=True))[0], name, "windowed calls only")
    assert verdict(_prefill_request(window_left=127), arch="sm_80")[0][name]
    assert verdict(_prefill_request(window_left=127, logit_cap=30.0))[0][name]


def _reasons_has(reasons: dict, name: str, text: str) -> bool:
    return any(text in r for r in reasons[name])


# ---------------------------------------------------------------- algorithm emulation
def _emulate(
    q, k, v, cu_q, cu_k, max_q, *, sinks, scale, block_n, programs, consumers=2, poly=False, lazy=0.0, window=None,
    clean_v=True,
):  # fmt: skip
    """float64 model of the kernel: persistent programs walk the tile order; per tile, each of
    the ``consumers`` warpgroups' 64 rows visit ``key_tiles`` from the diagonal down, masking
    the first ``n_masked``; online softmax with the max of the raw scores (``lazy > 0``: a
    row's max moves only when a tile raises it by more than ``lazy``); ``p`` by exp2 or
    (``poly``) the float32 model of the FMA-pipe exp2; ``O += P·V`` one step late (after the
    next tile's max); sink and LSE in the epilogue. Q and K/V tiles are read at absolute rows
    like the TMA boxes (past a sequence: the next one's rows; past the tensor: 0). ``window``
    (the windowed build): the tiles of ``key_band`` from its last down, masking those ``edge``
    names with ``0 <= p - key <= window``. ``clean_v``: the non-finite values of a V tile
    zeroed on the tiles ``dirty`` names (off: the kernel before it cleaned, NaN x 0 = NaN)."""
    log2e = 1 / math.log(2)
    total_q, hq, d = q.shape
    group = hq // k.shape[1]
    out = torch.full_like(q, float("nan"))
    lse = torch.full((total_q, hq), float("nan"), dtype=torch.float64)
    batch = len(cu_q) - 1
    block_m = consumers * fa3.HALF
    _, n_m = fa3.grid(max_q, batch, hq, programs, block_m)
    exp2 = (lambda x: fa3.exp2_fma_reference(x.float()).double()) if poly else torch.exp2

    def rows_at(x, start, n, head):  # a TMA box [n, D] at row ``start``; zero past the tensor
        box = torch.zeros(n, d, dtype=torch.float64)
        end = min(start + n, x.shape[0])
        if end > start:
            box[: end - start] = x[start:end, head]
        return box

    for pid in range(programs):
        for t in range(pid, n_m * batch * hq, programs):
            m_block, b, head = fa3.tile_order(t, n_m, batch, hq)
            len_q, len_k = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
            m0 = m_block * block_m
            if m0 >= len_q:
                continue
            for wg in range(consumers):
                r0 = m0 + wg * fa3.HALF
                qt = rows_at(q, cu_q[b] + r0, fa3.HALF, head)
                pos = torch.arange(fa3.HALF) + len_k - len_q + r0
                if window is None:
                    j_lo, (n_kv, n_masked) = 0, fa3.key_tiles(len_q, len_k, m0, wg, block_n, block_m)
                else:
                    j_lo, n_kv = fa3.key_band(len_q, len_k, m0, block_n, window, block_m)
                m = torch.full((fa3.HALF,), float("-inf"), dtype=torch.float64)
                ell = torch.zeros(fa3.HALF, dtype=torch.float64)
                acc = torch.zeros(fa3.HALF, d, dtype=torch.float64)
                pending = None  # (p, v tile) of the previous step
                for i in range(n_kv):
                    j = j_lo + n_kv - 1 - i
                    kt = rows_at(k, cu_k[b] + j * block_n, block_n, head // group)
                    s = qt @ kt.T
                    keys = torch.arange(block_n) + j * block_n
                    if window is None and i < n_masked:
                        s = s.masked_fill(keys[None, :] > pos[:, None], float("-inf"))
                    elif window is not None and fa3.edge(j, int(pos[0]), int(pos[-1]), block_n, window):
                        dist = pos[:, None] - keys[None, :]
                        s = s.masked_fill((dist < 0) | (dist > window), float("-inf"))
                    m_new = torch.maximum(m, s.max(1).values * scale * log2e)
                    if lazy:
                        m_new = torch.where(m_new > m + lazy, m_new, m)
                    m_use = torch.where(m_new == float("-inf"), 0.0, m_new)
                    alpha = torch.exp2(m - m_use)
                    p = exp2(s * scale * log2e - m_use[:, None])
                    ell = ell * alpha + p.sum(1)
                    m = m_new
                    if pending is not None:
                        acc = acc + pending[0] @ pending[1]
                    acc = acc * alpha[:, None]
                    vt = rows_at(v, cu_k[b] + j * block_n, block_n, head // group)
                    p0 = len_k - len_q + m0  # the work tile's first row: every warpgroup agrees
                    if clean_v and fa3.dirty(j, p0, block_n, fa3.NO_WINDOW if window is None else window, block_m):
                        vt = torch.where(torch.isfinite(vt), vt, 0.0)
                    pending = (p, vt)
                if pending is not None:
                    acc = acc + pending[0] @ pending[1]
                sink = (
                    None if sinks is None else torch.full((fa3.HALF,), float(sinks[head]) * log2e, dtype=torch.float64)
                )
                inv, ls = close_online_softmax(m, ell, sink)
                for r in range(fa3.HALF):
                    if r0 + r < len_q:
                        out[cu_q[b] + r0 + r, head] = acc[r] * inv[r]
                        lse[cu_q[b] + r0 + r, head] = ls[r]
    return out, lse


EMULATED = [
    ([1, 37, 129, 200], None, 4, True, 128, 5),
    ([70, 5], [300, 5], 2, False, 64, 3),  # Lk > Lq (bottom-right), a short one after
    ([40, 65], [5, 65], 2, True, 128, 2),  # Lq > Lk: rows that see nothing (sink only)
    ([130], None, 1, True, 64, 1),
    ([200, 450], None, 2, True, 128, 3),  # three warpgroups: 192-token tiles, a ragged last one
]
# (consumers, poly exp2, lazy rescale threshold): the default and each variant (alone, together)
VARIANTS = [(2, False, 0.0), (3, False, 0.0), (2, True, 0.0), (2, False, 8.0), (3, True, 8.0)]


def _emulated_vs_naive(lens_q, lens_k, group, sinks, block_n, programs, *, seed, tol=1e-9, window=None, **variant):
    """Emulate the kernel (``variant``: ``_emulate``'s consumers / poly / lazy) on ragged
    float64 inputs (2 KV heads, D 16) and compare with the naive attention."""
    torch.manual_seed(seed)
    hkv, d = 2, 16
    lens_k = lens_k or lens_q
    cu_q, cu_k = [0], [0]
    for a, c in zip(lens_q, lens_k, strict=True):
        cu_q.append(cu_q[-1] + a)
        cu_k.append(cu_k[-1] + c)
    q = torch.randn(cu_q[-1], hkv * group, d, dtype=torch.float64)
    k = torch.randn(cu_k[-1], hkv, d, dtype=torch.float64)
    v = torch.randn(cu_k[-1], hkv, d, dtype=torch.float64)
    sk = torch.randn(hkv * group, dtype=torch.float64) * 2 if sinks else None
    scale = 1 / math.sqrt(d)
    out, lse = _emulate(
        q, k, v, cu_q, cu_k, max(lens_q), sinks=sk, scale=scale, block_n=block_n, programs=programs, window=window,
        **variant,
    )  # fmt: skip
    cq, ck = torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32)
    window_left = -1 if window is None else window
    ro, rl = naive_prefill(q, k, v, cq, ck, softmax_scale=scale, window_left=window_left, sinks=sk, logit_cap=0.0)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out, ro, rtol=tol, atol=tol)
    torch.testing.assert_close(lse, rl, rtol=tol, atol=tol)
    # rows that see no key stay exactly zero with -inf LSE when there is no sink, on either exp2
    blind = torch.isinf(rl)
    assert torch.equal(torch.isinf(lse), blind) and float(out[blind].abs().sum()) == 0.0


@pytest.mark.parametrize("lens_q,lens_k,group,sinks,block_n,programs", EMULATED)
@pytest.mark.parametrize("consumers,poly,lazy", VARIANTS)
def test_emulated_schedule_matches_naive_attention(
    lens_q, lens_k, group, sinks, block_n, programs, consumers, poly, lazy
):
    # exact up to float64 rounding; the polynomial exp2 (relative error <= 1.0e-4 per weight)
    # moves outputs and LSE by about that much
    _emulated_vs_naive(
        lens_q, lens_k, group, sinks, block_n, programs, seed=sum(lens_q) + group, tol=1e-3 if poly else 1e-9,
        consumers=consumers, poly=poly, lazy=lazy,
    )  # fmt: skip


EMULATED_WINDOW = [
    # (lens_q, lens_k, group, sinks, block_n, programs, consumers, window)
    ([1, 37, 129, 300], None, 4, True, 64, 5, 2, 127),  # ragged, GPT-OSS's window
    ([300, 130], None, 2, False, 64, 3, 2, 0),  # window 0: the diagonal key only
    ([300, 130], None, 2, True, 128, 3, 2, 4),
    ([200, 65], None, 2, True, 64, 2, 2, 5000),  # larger than the sequence: causal
    ([70, 5], [300, 5], 2, True, 64, 3, 2, 127),  # Lk > Lq (bottom-right), a short one after
    ([40, 65], [5, 65], 2, False, 64, 2, 2, 3),  # Lq > Lk: rows that see nothing
    ([450, 200], None, 2, True, 64, 3, 3, 127),  # three warpgroups: 192-token tiles
    ([400], [520], 1, True, 128, 1, 2, 200),  # 128-key tiles, a band of 3
]


@pytest.mark.parametrize("lens_q,lens_k,group,sinks,block_n,programs,consumers,window", EMULATED_WINDOW)
def test_emulated_window_schedule_matches_naive_attention(
    lens_q, lens_k, group, sinks, block_n, programs, consumers, window
):
    _emulated_vs_naive(
        lens_q, lens_k, group, sinks, block_n, programs, seed=sum(lens_q) + window, window=window, consumers=consumers
    )


POISONED = [
    # (lens_q, lens_k, block_n, consumers, window)
    ([40, 9], None, 128, 2, None),  # one tile: the diagonal and the next sequence's keys
    ([300, 129], None, 128, 2, None),  # three tiles, a ragged last one
    ([100, 37, 5], [300, 40, 133], 128, 2, None),  # Lk > Lq: two dirty tiles per work tile
    ([50, 130], [20, 130], 64, 2, None),  # Lq > Lk: rows that see nothing
    ([200, 70], None, 128, 3, None),  # three warpgroups: 192-token work tiles
    ([300, 129], None, 64, 2, 5),  # window edges
    ([70, 130], [300, 130], 64, 2, 127),
]


def _key_sees(cu_q, cu_k, row: int, key_row: int, window: int | None) -> bool:
    """Whether query row ``row`` (of the ragged batch) may see K/V row ``key_row``."""
    b = max(i for i in range(len(cu_q) - 1) if cu_q[i] <= row)
    if not cu_k[b] <= key_row < cu_k[b + 1]:
        return False
    p = (cu_k[b + 1] - cu_k[b]) - (cu_q[b + 1] - cu_q[b]) + row - cu_q[b]
    return _sees(p, key_row - cu_k[b], cu_k[b + 1] - cu_k[b], fa3.NO_WINDOW if window is None else window)


@pytest.mark.parametrize("lens_q,lens_k,block_n,consumers,window", POISONED)
def test_emulated_schedule_keeps_unseen_nan_out(lens_q, lens_k, block_n, consumers, window):
    # NaN / inf in K and V at one key at a time: rows that cannot see it keep every bit (the
    # scores masked by selection, V cleaned on dirty tiles); without the cleaning NaN x 0
    # leaks (the bug this emulation mirrors).
    torch.manual_seed(len(lens_q) + block_n)
    lens_k = lens_k or lens_q
    cu_q, cu_k = [0], [0]
    for a, c in zip(lens_q, lens_k, strict=True):
        cu_q.append(cu_q[-1] + a)
        cu_k.append(cu_k[-1] + c)
    q = torch.randn(cu_q[-1], 4, 16, dtype=torch.float64)
    k = torch.randn(cu_k[-1], 2, 16, dtype=torch.float64)
    v = torch.randn(cu_k[-1], 2, 16, dtype=torch.float64)
    kw = dict(sinks=None, scale=0.25, block_n=block_n, programs=3, consumers=consumers, window=window)
    out, lse = _emulate(q, k, v, cu_q, cu_k, max(lens_q), **kw)
    keys = sorted({cu_k[b] + j for b, n in enumerate(lens_k) for j in (0, n // 2, n - 1, 63, 64, 127, 128) if j < n})
    leaked = 0
    for key_row, value in zip(keys, [float("nan"), float("inf"), float("-inf")] * len(keys)):
        bad_k, bad_v = k.clone(), v.clone()
        bad_k[key_row], bad_v[key_row] = value, value
        blind = torch.tensor([not _key_sees(cu_q, cu_k, r, key_row, window) for r in range(cu_q[-1])])
        bad_out, bad_lse = _emulate(q, bad_k, bad_v, cu_q, cu_k, max(lens_q), **kw)
        assert torch.isfinite(bad_out[blind]).all(), key_row
        assert torch.equal(bad_out[blind], out[blind]) and torch.equal(bad_lse[blind], lse[blind]), key_row
        if math.isnan(value):
            raw, _ = _emulate(q, bad_k, bad_v, cu_q, cu_k, max(lens_q), clean_v=False, **kw)
            leaked += int(not torch.isfinite(raw[blind]).all())
    assert leaked > 0  # the cleaning is what keeps them out


# ---------------------------------------------------------------- exp2 on the FMA pipe
def test_fma_exp2_model_is_within_1e4_of_float64():
    x = torch.linspace(-126.0, 8.0, 2_000_001, dtype=torch.float64)
    got = fa3.exp2_fma_reference(x.float()).double()
    want = torch.exp2(x.float().double())  # the same float32 argument
    rel = ((got - want) / want).abs()
    assert float(rel.max()) <= 1.02e-4, float(rel.max())
    # the mean relative bias (4.4e-5) is far below bf16's half ulp (2**-9); a common factor on
    # every weight cancels anyway (the row sum and P·V use the same p)
    assert abs(float(((got - want) / want).mean())) < 5e-5


def test_fma_exp2_model_gives_exact_zero_below_the_floor_and_never_nan():
    x = torch.tensor([float("-inf"), -1e30, -300.0, -127.0, -126.99, -126.5, -126.0, 0.0, -0.5, 0.5])
    got = fa3.exp2_fma_reference(x)
    assert torch.equal(got[:4], torch.zeros(4))  # masked scores (-inf) and the floor: +0.0 exactly
    assert not torch.isnan(got).any() and bool((got >= 0).all()) and bool((got[4:7] < 2**-125).all())
    assert float(got[7]) == 1.0  # p(0) = 1: the row maximum's weight is exact
    # every float32 just above the floor: no borrow into the sign bit, no NaN
    near = torch.linspace(-127.0, -125.0, 100_001)
    val = fa3.exp2_fma_reference(near)
    assert not torch.isnan(val).any() and bool((val >= 0).all()) and bool((val <= 2**-124).all())


@pytest.mark.parametrize("n_poly", range(9))
def test_exp2_asm_splits_the_pack_between_fma_and_mufu(n_poly):
    from tokenspeed_kernel_nvidia.ops.attention._gluon_prefill_fa3_kernel import _exp2_asm_text, _f32_hex

    text = _exp2_asm_text(n_poly)
    assert text.count("ex2.approx.ftz.f32") == fa3.EXP2_PACK - n_poly
    assert text.count("fma.rn.ftz.f32") == 3 * n_poly and text.count("shl.b32") == n_poly
    # every output written once, every input read once ($0..$7 out, $8..$15 in)
    for i in range(2 * fa3.EXP2_PACK):
        assert len(re.findall(rf"\${i}\b", text)) == 1, (i, text)
    # the constants are the model's (float32 immediates)
    for c in fa3.EXP2_POLY[1:] if n_poly else ():
        assert _f32_hex(c) in text and _f32_hex(c) == "0f" + struct.pack(">f", c).hex().upper()


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"consumers": 4}, "consumers"),
        ({"exp2_poly": 9}, "exp2_poly"),
        ({"rescale_threshold": -1.0}, "rescale_threshold"),
        ({"consumers": 3}, "maxnreg"),  # 16 warps x 168 registers > 64 K
        ({"consumers": 3, "maxnreg": 128}, "consumer_regs"),  # 3 x 240 + 24 > 4 x 128
    ],
)
def test_config_rejects_what_does_not_fit(kw, match):
    with pytest.raises(ValueError, match=match):
        fa3.Fa3Config(64, **kw)


def test_pv_overlap_is_a_compile_switch_only():
    # pv_overlap moves where the kernel waits for the P·V product (the SASS test in
    # test_aot_compile.py checks it), not what it computes: same tiles, same schedule, so the
    # float64 emulation above covers its numerics; the GPU tests run it on the device.
    base, ov = fa3.Fa3Config(64, stages=3), fa3.Fa3Config(64, stages=3, pv_overlap=True)
    assert ov.tag == base.tag + "-ov" and fa3.TWO_CONSUMER_CONFIGS[64] == base and not base.pv_overlap
    assert {k: v for k, v in ov.constexprs().items() if k != "PV_OVERLAP"} == {
        k: v for k, v in base.constexprs().items() if k != "PV_OVERLAP"
    }
    assert ov.constexprs()["PV_OVERLAP"] is True and base.constexprs()["PV_OVERLAP"] is False
    assert ov.block_m == base.block_m and ov.shared_bytes() == base.shared_bytes()


def test_every_shipped_build_cleans_v_and_the_reference_without_it_is_sweep_only():
    # clean_v=False (fa3_sweep.py --clean-ab's timing reference, the kernel before the fix)
    # only drops the CLEAN layout; every launcher configuration cleans, the extend refuses it
    from tokenspeed_kernel_nvidia.ops.attention.gluon_extend_fa3 import extend_plan

    for d in fa3.HEAD_DIMS:
        for cfg in (fa3.fa3_config(d), fa3.fa3_window_config(d)):
            assert cfg.clean_v and cfg.constexprs()["CLEAN"] is cfg.clean_layout
            ref = dataclasses.replace(cfg, clean_v=False)
            assert "-nocl" in ref.tag and ref.tag.replace("-nocl", "") == cfg.tag and ref.constexprs()["CLEAN"] is None
            assert {k: v for k, v in ref.constexprs().items() if k != "CLEAN"} == {
                k: v for k, v in cfg.constexprs().items() if k != "CLEAN"
            }
        assert extend_plan(d, 16).constexprs(8, 1, True, False)["CLEAN"] == fa3.fa3_config(d).clean_layout
        with pytest.raises(ValueError, match="always cleans V"):
            extend_plan(d, 16, clean_v=False)


def test_wide_config_fits():
    cfg = fa3.Fa3Config(64, stages=3, **fa3.WIDE)
    assert cfg.block_m == 192 and cfg.shared_bytes() <= 124 * 1024
    assert cfg.constexprs()["NUM_WG"] == 3 and cfg.tag.endswith("-wg3")
    assert fa3.grid(8192, 1, 64, 132, cfg.block_m) == (132, 43)


def test_a_ragged_batch_lists_its_tiles_before_the_kernel(monkeypatch):
    """As the paged extend's launches: several sequences whose longest has several query
    blocks get the tile-list pre-pass first (its buffer the one scratch, handed to the kernel
    with TILE_LIST); one sequence, one query block, or a uniform batch launches the kernel
    alone."""
    from tokenspeed_kernel_nvidia.ops.attention import _tile_list

    monkeypatch.setattr(fa3, "sm_count", lambda device: 132)  # an H100's (the CPU has none)
    cfg = fa3.fa3_config(64)

    def built(lens):
        launches, scratch, *_ = fa3._launches(ragged_prefill_args(lens_q=lens, lens_k=lens, hq=8, hkv=1), cfg)
        return launches, scratch

    launches, (tiles,) = built((300, 37, 2))
    assert launches[0].fn is _tile_list.tile_list_kernel and len(launches) == 2
    assert tiles.numel() == _tile_list.list_length(2, 3, 8) and launches[0].kwargs["BLOCK_M"] == cfg.block_m
    assert launches[1].args[-1] is tiles and launches[1].kwargs["TILE_LIST"]
    for lens in ((300,), (100, 37, 2), (300, 300, 300)):  # one sequence; one query block of 192; uniform
        launches, scratch = built(lens)
        assert len(launches) == 1 and scratch == () and not launches[0].kwargs["TILE_LIST"]
