"""Host logic of the Gluon window prefill, on CPU: the band of key tiles each program visits
(vs brute force over every (query, key) pair), the mask flag, the grid, the configuration
table, call-time checks, and a float64 emulation of the kernel's algorithm (same tiles, same
online softmax, sink folded in the epilogue) against the independent naive attention."""

import dataclasses
import math

import pytest
import torch
from support.naive_attention import naive_prefill
from support.online_softmax import close_online_softmax

from tokenspeed_kernel.ops.attention.args import PrefillArgs
from tokenspeed_kernel_nvidia.ops.attention import gluon_prefill as gp

LENGTHS = [(1, 1), (37, 37), (129, 129), (300, 300), (1025, 1025), (5, 40), (16, 17), (3, 200)]


def _visible(p: int, j: int, len_k: int, window: int) -> bool:
    return 0 <= j < len_k and j <= p and p - j <= window


def _kernel_mask(p: int, start: int, n: int, window: int) -> bool:
    """The kernel's one-compare mask: uint32(p - start - n) <= uint32(window)."""
    return ((p - start - n) & 0xFFFFFFFF) <= window


@pytest.mark.parametrize("len_q,len_k", LENGTHS)
@pytest.mark.parametrize("window", [0, 1, 64, 127, 1000])
@pytest.mark.parametrize("block_t,block_n", [(16, 64), (32, 64), (8, 64), (128, 64)])
def test_band_tiles_cover_exactly_what_rows_see(len_q, len_k, window, block_t, block_n):
    programs = gp.grid(len_q, 1, 1, block_t)[0]
    assert programs == max(math.ceil(len_q / block_t), 1)
    for tile in range(programs + 1):  # one past the end: no tiles
        tiles = gp.band_tiles(len_q, len_k, tile, block_t, block_n, window)
        rows = [len_k - len_q + t for t in range(tile * block_t, min((tile + 1) * block_t, len_q))]
        if not rows:
            assert tiles == []
            continue
        need = {j for p in rows for j in range(len_k) if _visible(p, j, len_k, window)}
        covered = {s + n for s, _ in tiles for n in range(block_n)}
        assert need <= covered
        # Band only: every visited tile holds a key some row sees, and there are no more
        # tiles than the band needs.
        for start, _ in tiles:
            assert any(start <= j < start + block_n for j in need)
        if need:
            assert len(tiles) == math.ceil((max(need) - min(need) + 1) / block_n)
        for start, masked in tiles:
            pairs = [(p, start + n) for p in rows for n in range(block_n)]
            all_visible = all(_visible(p, j, len_k, window) for p, j in pairs)
            # Unmasked tiles really are fully visible; masked ones really have a hidden pair.
            assert masked == (not all_visible)
            if masked:  # the kernel's mask reproduces visibility on the rows it stores
                for p, j in pairs:
                    assert _kernel_mask(p, start, j - start, window) == _visible(p, j, len_k, window)


def test_window_128_tile_counts_at_gpt_oss_shapes():
    # 8 tokens x 8 heads per program, 32-key tiles: 135 keys in the band -> 5 tiles, and a
    # program in the steady state masks only the window-edge and the diagonal tile.
    cfg = gp.prefill_config(64, 8)
    assert (cfg.block_t, cfg.block_n, cfg.group_pad, cfg.num_warps, cfg.stages) == (8, 32, 8, 4, 2)  # H200 sweep
    tiles = gp.band_tiles(8192, 8192, 100, cfg.block_t, cfg.block_n, 127)
    assert [m for _, m in tiles] == [True, False, False, False, True]
    assert gp.grid(8192, 8, 1, cfg.block_t) == (1024, 8, 1)


def test_config_table():
    for d, g, t, warps in (
        (64, 8, 8, 4),
        (64, 4, 16, 4),
        (64, 6, 8, 4),
        (64, 1, 64, 4),
        (64, 16, 8, 8),
        (128, 8, 16, 8),
    ):
        cfg = gp.prefill_config(d, g)
        assert cfg.block_t * cfg.group_pad == cfg.block_m
        assert (cfg.block_t, cfg.num_warps) == (t, warps)
        assert cfg.shared_bytes() <= 227 * 1024
    assert gp.prefill_config(64, 8).shared_bytes() == 2 * (64 * 64 + 2 * 2 * 32 * 64)
    # the sweep's variants: the configuration the D = 64 default replaced first, none the default itself
    variants = gp.window_variants(64, 8)
    assert variants[0] == gp.GluonPrefillConfig(64, 8, block_n=64, stages=3, num_warps=8)
    assert gp.prefill_config(64, 8) not in variants and len({v.tag for v in variants}) == len(variants)


def _args(window=127, causal=True):
    q = torch.zeros(4, 8, 64, dtype=torch.bfloat16)
    k = torch.zeros(4, 1, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    return PrefillArgs(
        q=q,
        k=k,
        v=k,
        cu_seqlens_q=cu,
        cu_seqlens_k=cu,
        max_seqlen_q=4,
        max_seqlen_k=4,
        causal=causal,
        softmax_scale=0.125,
        window_left=window,
        sinks=None,
        logit_cap=0.0,
        out=torch.empty_like(q),
        lse=None,
    )


@pytest.mark.parametrize(
    "window,causal,match", [(-1, True, "dense prefill"), (4096, True, "dense prefill"), (127, False, "causal")]
)
def test_call_time_checks_reject_what_the_request_cannot_say(window, causal, match):
    # The selector's request carries only the sliding_window feature, not its size.
    with pytest.raises(ValueError, match=match):
        gp.gluon_prefill_window(_args(window, causal))


# ---------------------------------------------------------------- algorithm emulation
def _emulate(q, k, v, cu_q, cu_k, *, window, sinks, cap, scale, block_t, block_n, group):
    """float64 model of the kernel: per program, visit ``band_tiles``, mask only flagged
    tiles, online softmax in base 2 with the -inf guard, sink and LSE in the epilogue."""
    log2e = 1 / math.log(2)
    hq, d = q.shape[1], q.shape[2]
    out = torch.full((q.shape[0], hq, d), float("nan"), dtype=torch.float64)
    lse = torch.full((q.shape[0], hq), float("nan"), dtype=torch.float64)
    for b in range(len(cu_q) - 1):
        qb, kb, vb = q[cu_q[b] : cu_q[b + 1]], k[cu_k[b] : cu_k[b + 1]], v[cu_k[b] : cu_k[b + 1]]
        len_q, len_k = qb.shape[0], kb.shape[0]
        for kvh in range(k.shape[1]):
            heads = list(range(kvh * group, (kvh + 1) * group))
            for tile in range(gp.grid(len_q, 1, 1, block_t)[0]):
                tokens = list(range(tile * block_t, min((tile + 1) * block_t, len_q)))
                if not tokens:
                    continue
                rows = torch.stack([qb[t, h] for t in tokens for h in heads])  # [M, D]
                pos = torch.tensor([len_k - len_q + t for t in tokens for _ in heads])
                m = torch.full((len(rows),), float("-inf"), dtype=torch.float64)
                ell = torch.zeros(len(rows), dtype=torch.float64)
                acc = torch.zeros(len(rows), d, dtype=torch.float64)
                for start, masked in gp.band_tiles(len_q, len_k, tile, block_t, block_n, window):
                    idx = torch.arange(start, start + block_n)
                    inb = idx < len_k  # rows past the key tensor are TMA zero fill
                    kt = torch.zeros(block_n, d, dtype=torch.float64)
                    vt = torch.zeros(block_n, d, dtype=torch.float64)
                    kt[inb], vt[inb] = kb[idx[inb], kvh], vb[idx[inb], kvh]
                    s = rows @ kt.T
                    s = cap * torch.tanh(s * scale / cap) * log2e if cap > 0 else s * scale * log2e
                    if masked:
                        dist = pos[:, None] - idx[None, :]
                        s = s.masked_fill(~((dist >= 0) & (dist <= window)), float("-inf"))
                    m_new = torch.maximum(m, s.max(1).values)
                    m_use = torch.where(m_new == float("-inf"), 0.0, m_new)
                    alpha = torch.exp2(m - m_use)
                    p = torch.exp2(s - m_use[:, None])
                    ell = ell * alpha + p.sum(1)
                    acc = acc * alpha[:, None] + p @ vt
                    m = m_new
                sink = None
                if sinks is not None:
                    sink = torch.tensor([float(sinks[h]) * log2e for _ in tokens for h in heads], dtype=torch.float64)
                inv, ls = close_online_softmax(m, ell, sink)
                o = acc * inv[:, None]
                for r, (t, h) in enumerate((t, h) for t in tokens for h in heads):
                    out[cu_q[b] + t, h], lse[cu_q[b] + t, h] = o[r], ls[r]
    return out, lse


@pytest.mark.parametrize(
    "lens,window,group,sinks,cap",
    [
        ([1, 37, 129, 20], 127, 8, True, 0.0),
        ([37, 70], 64, 4, False, 0.0),
        ([16, 33], 1, 8, True, 0.0),
        ([50], 0, 4, True, 5.0),
    ],
)
def test_emulated_algorithm_matches_naive_attention(lens, window, group, sinks, cap):
    torch.manual_seed(len(lens) + window)
    hkv, d = 2, 16
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    q = torch.randn(cu[-1], hkv * group, d, dtype=torch.float64)
    k = torch.randn(cu[-1], hkv, d, dtype=torch.float64)
    v = torch.randn(cu[-1], hkv, d, dtype=torch.float64)
    sk = torch.randn(hkv * group, dtype=torch.float64) * 2 if sinks else None
    cfg = gp.prefill_config(64, group)
    scale = 1 / math.sqrt(d)
    out, lse = _emulate(
        q,
        k,
        v,
        cu,
        cu,
        window=window,
        sinks=sk,
        cap=cap,
        scale=scale,
        block_t=cfg.block_t,
        block_n=cfg.block_n,
        group=group,
    )
    cu_t = torch.tensor(cu, dtype=torch.int32)
    ro, rl = naive_prefill(q, k, v, cu_t, cu_t, softmax_scale=scale, window_left=window, sinks=sk, logit_cap=cap)
    torch.testing.assert_close(out, ro, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(lse, rl, rtol=1e-9, atol=1e-9)


# ---------------------------------------------------------------- the persistent build
def test_persistent_configurations_fit_their_programs_or_are_refused():
    small = gp.window_variants(64, 8)[-1]  # the shipped tiles without the shipped 80-register cap
    assert (
        small == dataclasses.replace(gp.prefill_config(64, 8), maxnreg=None)
        and gp.prefill_config(64, 8).register_cap == 80
    )
    p5, p6 = (v for v in gp.window_variants(64, 8) if v.persistent)
    assert (p5.persistent, p6.persistent) == (5, 6) and (p5.tag, p6.tag) == ("m64-n32-s2-w4-p5", "m64-n32-s2-w4-p6")
    # registers capped so that all programs share an SM (allocated 8 per thread at a time)
    assert (p5.register_cap, p6.register_cap) == (96, 80)
    assert small.register_cap is None and dataclasses.replace(p6, maxnreg=72).register_cap == 72
    assert dataclasses.replace(gp.prefill_config(128, 8), persistent=1).register_cap is None  # 256 threads: 256 > 255
    assert p6.shared_bytes() == 2 * (2 * 64 * 64 + 2 * 2 * 32 * 64)  # two Q tiles and the ring: 32 KiB
    with pytest.raises(ValueError, match="qk_ahead"):
        dataclasses.replace(small, persistent=5, qk_ahead=True)
    with pytest.raises(ValueError, match="do not fit an SM"):
        dataclasses.replace(gp.prefill_config(128, 8), persistent=3)
    with pytest.raises(ValueError, match="persistent"):
        dataclasses.replace(small, persistent=-1)


def test_persistent_grid():
    assert gp.persistent_grid((1024, 8, 1), 5, 132) == (660, 8192)  # GPT-OSS S = 8192: 12.4 items each
    assert gp.persistent_grid((2, 2, 1), 6, 132) == (4, 4)  # never more programs than items
    assert gp.persistent_grid((512, 8, 4), 6, 132) == (792, 16384)


def _persistent_walk(lens_q, lens_k, hkv, block_t, block_n, window, programs, stages):
    """A plain-Python mirror of ``prefill_window_persistent_kernel``'s walk: per program, the
    producer cursor of ``_produce`` (the first ``stages`` tiles, then one per consumed tile,
    moving past items without tiles) and the consumer's items in order, checking that each
    tile the consumer waits for in ring slot ``g % stages`` at phase ``(g // stages) & 1`` is
    the one the producer put there (its fill count's parity), and that nothing is in flight
    at the end. Returns ``{(b, kv_head, tile): [(start, masked), ...]}`` of the live items."""
    batch = len(lens_q)
    q_tiles = gp.grid(max(lens_q), hkv, batch, block_t)[0]
    items = q_tiles * hkv * batch

    def band(item):  # _item_band: (live, key tiles, the item's key)
        if item >= items:
            return False, [], None
        tile, kv_head, b = item % q_tiles, item // q_tiles % hkv, item // q_tiles // hkv
        live = tile * block_t < lens_q[b]
        return live, gp.band_tiles(lens_q[b], lens_k[b], tile, block_t, block_n, window), (b, kv_head, tile)

    seen = {}
    for pid in range(programs):
        ring = [None] * stages  # (item, tile index, fills of the slot so far)
        fills = [0] * stages
        cursor = {"item": pid - programs, "tile": 0, "tiles": []}

        def produce(slot, cursor=cursor, ring=ring, fills=fills):
            while cursor["tile"] >= len(cursor["tiles"]) and cursor["item"] < items:
                cursor["item"] += programs
                live, tiles, _ = band(cursor["item"])
                cursor["tiles"], cursor["tile"] = tiles if live else [], 0
            if cursor["tile"] < len(cursor["tiles"]):
                assert ring[slot] is None, "a slot refilled before its tile was consumed"
                ring[slot] = (cursor["item"], cursor["tile"], fills[slot])
                fills[slot] += 1
                cursor["tile"] += 1

        for st in range(stages):
            produce(st)
        g = 0
        for item in range(pid, items, programs):
            live, tiles, key = band(item)
            if not live:
                continue
            assert key not in seen
            seen[key] = tiles
            for j in range(len(tiles)):
                slot = g % stages
                assert ring[slot] is not None and ring[slot][:2] == (item, j), (pid, item, j, ring)
                assert ring[slot][2] & 1 == (g // stages) & 1, "the phase the consumer waits on"
                ring[slot] = None
                produce(slot)
                g += 1
        assert ring == [None] * stages, "a tile left in flight"
    return seen


@pytest.mark.parametrize(
    "lens_q,lens_k",
    [
        ([1, 37, 129, 300, 1025], [1, 37, 129, 300, 1025]),  # ragged: most items of short sequences dead
        ([300, 1, 77], [300, 1, 77]),
        ([20, 9, 40], [2, 9, 200]),  # live items without a key tile (len_k < len_q) and a long prefix
        ([8192], [8192]),
    ],
)
@pytest.mark.parametrize("programs", [1, 3, 7, 660])
@pytest.mark.parametrize("stages", [2, 3])
def test_persistent_walk_visits_every_live_item_once_with_its_band(lens_q, lens_k, programs, stages):
    hkv, block_t, block_n, window = 2, 8, 32, 127
    seen = _persistent_walk(lens_q, lens_k, hkv, block_t, block_n, window, programs, stages)
    want = {
        (b, h, t): gp.band_tiles(lens_q[b], lens_k[b], t, block_t, block_n, window)
        for b in range(len(lens_q))
        for h in range(hkv)
        for t in range(-(-lens_q[b] // block_t))
    }
    assert seen == want
    if lens_k[0] < lens_q[0]:
        assert any(not tiles for tiles in seen.values()), "a live item without key tiles is walked too"
