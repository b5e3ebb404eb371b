"""Host logic of ``gluon_prefill_fa3_sm90`` on CPU: the heaviest-first tile order, the key tiles
each consumer warpgroup visits and masks (vs brute force over every (query, key) pair), the
persistent grid, the configuration table, call-time checks, and a float64 emulation of the
kernel's schedule (persistent programs, two 64-row warpgroups, key tiles from the diagonal
down, the P·V product one step behind the softmax, sink in the epilogue, TMA rows read past
a sequence) against the independent naive attention."""

import math

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
def test_key_tiles_cover_what_rows_see_and_mask_only_where_needed(len_q, len_k, block_n):
    for m0 in range(0, len_q, fa3.BLOCK_M):
        rows_all = [len_k - len_q + t for t in range(m0, min(m0 + fa3.BLOCK_M, len_q))]
        counts = set()
        for wg in (0, 1):
            n_kv, n_masked = fa3.key_tiles(len_q, len_k, m0, wg, block_n)
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
        # both warpgroups visit the same tiles (the ping-pong hand-off counts rounds), and no
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


def test_config_table():
    for d in fa3.HEAD_DIMS:
        cfg = fa3.fa3_config(d)
        assert cfg.head_dim == d and cfg.block_n == 128
        assert cfg.shared_bytes() <= 227 * 1024
        # 12 warps at maxnreg fit the register file; the warpgroups' split fits the launch
        assert cfg.maxnreg * 12 * 32 <= 65536
        assert (2 * cfg.consumer_regs + cfg.producer_regs) <= 3 * cfg.maxnreg
        assert cfg.consumer_regs % 8 == 0 and cfg.producer_regs % 8 == 0 and 24 <= cfg.producer_regs
    assert fa3.fa3_config(64).shared_bytes() == 2 * 64 * (128 + 2 * 3 * 128)
    assert fa3.fa3_config(128).stages == 2


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


# ---------------------------------------------------------------- algorithm emulation
def _emulate(q, k, v, cu_q, cu_k, max_q, *, sinks, scale, block_n, programs):
    """float64 model of the kernel: persistent programs walk the tile order; per tile, each
    warpgroup's 64 rows visit ``key_tiles`` from the diagonal down, masking the first
    ``n_masked``; online softmax with the max of the raw scores; ``O += P·V`` one step late
    (after the next tile's max); sink and LSE in the epilogue. Q and K/V tiles are read at
    absolute rows like the TMA boxes (past a sequence: the next one's rows; past the tensor: 0)."""
    log2e = 1 / math.log(2)
    total_q, hq, d = q.shape
    group = hq // k.shape[1]
    out = torch.full_like(q, float("nan"))
    lse = torch.full((total_q, hq), float("nan"), dtype=torch.float64)
    batch = len(cu_q) - 1
    _, n_m = fa3.grid(max_q, batch, hq, programs)

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
            m0 = m_block * fa3.BLOCK_M
            if m0 >= len_q:
                continue
            for wg in (0, 1):
                r0 = m0 + wg * fa3.HALF
                qt = rows_at(q, cu_q[b] + r0, fa3.HALF, head)
                pos = torch.arange(fa3.HALF) + len_k - len_q + r0
                n_kv, n_masked = fa3.key_tiles(len_q, len_k, m0, wg, block_n)
                m = torch.full((fa3.HALF,), float("-inf"), dtype=torch.float64)
                ell = torch.zeros(fa3.HALF, dtype=torch.float64)
                acc = torch.zeros(fa3.HALF, d, dtype=torch.float64)
                pending = None  # (p, v tile) of the previous step
                for i in range(n_kv):
                    j = n_kv - 1 - i
                    kt = rows_at(k, cu_k[b] + j * block_n, block_n, head // group)
                    s = qt @ kt.T
                    if i < n_masked:
                        keys = torch.arange(block_n) + j * block_n
                        s = s.masked_fill(keys[None, :] > pos[:, None], float("-inf"))
                    m_new = torch.maximum(m, s.max(1).values * scale * log2e)
                    m_use = torch.where(m_new == float("-inf"), 0.0, m_new)
                    alpha = torch.exp2(m - m_use)
                    p = torch.exp2(s * scale * log2e - m_use[:, None])
                    ell = ell * alpha + p.sum(1)
                    m = m_new
                    if pending is not None:
                        acc = acc + pending[0] @ pending[1]
                    acc = acc * alpha[:, None]
                    pending = (p, rows_at(v, cu_k[b] + j * block_n, block_n, head // group))
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


@pytest.mark.parametrize(
    "lens_q,lens_k,group,sinks,block_n,programs",
    [
        ([1, 37, 129, 200], None, 4, True, 128, 5),
        ([70, 5], [300, 5], 2, False, 64, 3),  # Lk > Lq (bottom-right), a short one after
        ([40, 65], [5, 65], 2, True, 128, 2),  # Lq > Lk: rows that see nothing (sink only)
        ([130], None, 1, True, 64, 1),
    ],
)
def test_emulated_schedule_matches_naive_attention(lens_q, lens_k, group, sinks, block_n, programs):
    torch.manual_seed(sum(lens_q) + group)
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
    out, lse = _emulate(q, k, v, cu_q, cu_k, max(lens_q), sinks=sk, scale=scale, block_n=block_n, programs=programs)
    cq, ck = torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32)
    ro, rl = naive_prefill(q, k, v, cq, ck, softmax_scale=scale, window_left=-1, sinks=sk, logit_cap=0.0)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out, ro, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(lse, rl, rtol=1e-9, atol=1e-9)
