"""The GPT-OSS-shaped example end to end on CPU: logits of the library model (reference
backend forced, and the selector's choice = the Triton kernels under the interpreter), and
of the plain-PyTorch path, against an independent float64 forward; the paged path
(chunked extend + decode) against a one-shot prefill; the KV-cache manager; greedy
generation; CUDA-graph decode on a GPU.

The float64 forward below is written from the model's definition, not from the example's
code: its own MXFP4 bit decoding, RoPE by complex rotation, per-query attention loops with
sinks and windows, and per-token expert loops.
"""

from __future__ import annotations

import math

import pytest
import torch

from examples.gpt_oss import (
    OVERRIDE_PRESETS,
    DecodeRunner,
    Engine,
    GptOssConfig,
    GptOssModel,
    PagedKVCache,
    TorchGptOss,
    random_weights,
)
from examples.gpt_oss.weights import ModelWeights

PAGE = 4
# full sequences (teacher forcing): the last DECODE tokens of each are decoded one step at
# a time, the rest prefilled in chunks of CHUNK; lengths ragged, partial pages, > window
SEQ_LENS = (9, 14, 5)
DECODE = 3
CHUNK = 4
# relative Frobenius error of all logits against float64, per activation dtype
TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-5}  # measured: ~7e-3 and ~4e-7


# ----------------------------------------------------------------------------- float64 forward

_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _mxfp4_to_f64(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``[..., N, K]`` float64 from packed E2M1 nibbles (low first) and E8M0 block scales."""
    lo, hi = (packed & 0xF).long(), (packed >> 4).long()
    codes = torch.stack([lo, hi], dim=-1).flatten(-2)
    mag = torch.tensor(_E2M1, dtype=torch.float64)[codes & 7]
    val = torch.where((codes & 8) != 0, -mag, mag)
    scale = torch.exp2(scales.double() - 127.0).repeat_interleave(32, dim=-1)
    return val * scale


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w.double()


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """x [L, heads, D] with pairs (i, i + D/2) rotated by pos · theta^(-2i/D), as complex numbers."""
    half = x.shape[-1] // 2
    freq = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / x.shape[-1])
    rot = torch.polar(torch.ones(len(pos), half, dtype=torch.float64), pos.double()[:, None] * freq)
    z = torch.complex(x[..., :half], x[..., half:]) * rot[:, None, :]
    return torch.cat([z.real, z.imag], dim=-1)


def forward64(cfg: GptOssConfig, w: ModelWeights, tokens: torch.Tensor) -> torch.Tensor:
    """float64 logits ``[L, V]`` of every position of one sequence."""
    n, d, hq, hkv = len(tokens), cfg.head_dim, cfg.num_q_heads, cfg.num_kv_heads
    group = hq // hkv
    pos = torch.arange(n)
    h = w.embed.double()[tokens]
    for i, lw in enumerate(w.layers):
        window = cfg.sliding_window if i % 2 == 0 else None
        x = _rms(h, lw.attn_norm, cfg.rms_eps)
        qkv = x @ lw.wqkv.double().T + lw.bqkv.double()
        q = _rope(qkv[:, : hq * d].reshape(n, hq, d), pos, cfg.rope_theta)
        k = _rope(qkv[:, hq * d : (hq + hkv) * d].reshape(n, hkv, d), pos, cfg.rope_theta)
        v = qkv[:, (hq + hkv) * d :].reshape(n, hkv, d)
        att = torch.zeros(n, hq, d, dtype=torch.float64)
        for t in range(n):
            lo = 0 if window is None else max(0, t - window + 1)
            for head in range(hq):
                kh = head // group
                s = (k[lo : t + 1, kh] @ q[t, head]) / math.sqrt(d)
                m = max(float(s.max()), float(lw.sinks[head]))
                p = torch.exp(s - m)
                denom = p.sum() + math.exp(float(lw.sinks[head]) - m)
                att[t, head] = (p[:, None] * v[lo : t + 1, kh]).sum(0) / denom
        h = h + att.reshape(n, hq * d) @ lw.wo.double().T + lw.bo.double()
        x = _rms(h, lw.mlp_norm, cfg.rms_eps)
        probs = torch.softmax(x @ lw.router_w.double().T + lw.router_b.double(), dim=-1)
        w13 = _mxfp4_to_f64(lw.w13.packed, lw.w13.scales)
        w2 = _mxfp4_to_f64(lw.w2.packed, lw.w2.scales)
        inter = cfg.intermediate_size
        moe = torch.zeros_like(h)
        for t in range(n):
            top = sorted(range(cfg.num_experts), key=lambda e, t=t: -float(probs[t, e]))[: cfg.top_k]
            total = sum(float(probs[t, e]) for e in top)
            for e in top:
                gu = w13[e] @ x[t] + lw.b13[e].double()
                gate = gu[:inter].clamp(max=7.0)
                up = gu[inter:].clamp(-7.0, 7.0)
                a = gate * torch.sigmoid(1.702 * gate) * (up + 1.0)
                moe[t] += float(probs[t, e]) / total * (w2[e] @ a + lw.b2[e].double())
        h = h + moe
    return _rms(h, w.final_norm, cfg.rms_eps) @ w.lm_head.double().T


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref).norm() / ref.norm())


# ----------------------------------------------------------------------------- fixtures / drivers


@pytest.fixture(scope="module")
def seqs() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, 128, (n,), generator=gen) for n in SEQ_LENS]


_weights: dict[torch.dtype, tuple[GptOssConfig, ModelWeights]] = {}
_ref64: dict[torch.dtype, list[torch.Tensor]] = {}


def setup(dtype: torch.dtype) -> tuple[GptOssConfig, ModelWeights]:
    if dtype not in _weights:
        cfg = GptOssConfig.tiny(dtype=dtype)
        _weights[dtype] = (cfg, random_weights(cfg, seed=3))
    return _weights[dtype]


def reference64(dtype: torch.dtype, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    if dtype not in _ref64:
        cfg, w = setup(dtype)
        _ref64[dtype] = [forward64(cfg, w, s) for s in seqs]
    return _ref64[dtype]


def make_kv(cfg: GptOssConfig, **changes) -> PagedKVCache:
    args = dict(
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        num_pages=40,
        page_size=PAGE,
        max_batch=4,
        max_pages_per_seq=6,
        dtype=cfg.dtype,
        device="cpu",
        poison=True,
    )
    args.update(changes)
    return PagedKVCache(**args)


def make_model(kind: str, cfg: GptOssConfig, w: ModelWeights):
    return TorchGptOss(cfg, w) if kind == "torch" else GptOssModel(cfg, w, OVERRIDE_PRESETS[kind])


def oneshot_logits(model, cfg: GptOssConfig, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Logits of every position from one ragged ``mha_prefill`` pass."""
    engine = Engine(model, make_kv(cfg))
    rids = engine.add_requests([len(s) for s in seqs], 0)
    hidden = engine.forward_chunk(rids, seqs, mode="prefill")
    return list(model.logits(hidden).split([len(s) for s in seqs]))


def paged_logits(model, cfg: GptOssConfig, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Logits of every position: prompts in extend chunks of CHUNK, then DECODE teacher-forced
    decode steps for the whole batch (eager: a CPU run)."""
    engine = Engine(model, make_kv(cfg))
    prompts = [s[:-DECODE] for s in seqs]
    rids = engine.add_requests([len(p) for p in prompts], DECODE)
    outs: list[list[torch.Tensor]] = [[] for _ in seqs]
    done = [0] * len(seqs)
    while any(d < len(p) for d, p in zip(done, prompts)):
        active = [i for i, p in enumerate(prompts) if done[i] < len(p)]
        chunks = [prompts[i][done[i] : done[i] + CHUNK] for i in active]
        logits = model.logits(engine.forward_chunk([rids[i] for i in active], chunks))
        for i, part in zip(active, logits.split([len(c) for c in chunks])):
            outs[i].append(part)
            done[i] += len(part)
    runner = DecodeRunner(model, engine.kv, rids, graph=False)
    for step in range(DECODE):
        runner.tokens.copy_(torch.stack([s[len(s) - DECODE + step] for s in seqs]))
        logits = runner.step()
        for i in range(len(seqs)):
            outs[i].append(logits[i : i + 1].clone())
    return [torch.cat(o) for o in outs]


def check(got: list[torch.Tensor], ref: list[torch.Tensor], tol: float, what: str) -> None:
    for b, (g, r) in enumerate(zip(got, ref)):
        assert g.shape == r.shape, f"{what}: sequence {b} shape {tuple(g.shape)} != {tuple(r.shape)}"
        assert not torch.isnan(g).any(), f"{what}: NaN in logits of sequence {b}"
        err = rel_err(g, r)
        assert err < tol, f"{what}: sequence {b} (length {len(r)}) relative error {err:.2e} >= {tol:.0e}"


def triton_installed() -> bool:
    try:
        import tokenspeed_kernel_triton  # noqa: F401
    except ImportError:
        return False
    return True


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("kind", ["reference", "selector"])
def test_oneshot_prefill_matches_float64(kind, dtype, seqs):
    cfg, w = setup(dtype)
    model = make_model(kind, cfg, w)
    if kind == "selector" and triton_installed() and torch.cuda.is_available() is False:
        # under TRITON_INTERPRET=1 the Triton kernels serve the CPU and outrank the reference
        assert model.plans[0].kernel == "triton_fused_moe"
    check(oneshot_logits(model, cfg, seqs), reference64(dtype, seqs), TOL[dtype], f"{kind} one-shot")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("kind", ["reference", "selector"])
def test_paged_path_matches_oneshot_and_float64(kind, dtype, seqs):
    cfg, w = setup(dtype)
    model = make_model(kind, cfg, w)
    paged = paged_logits(model, cfg, seqs)
    check(paged, reference64(dtype, seqs), TOL[dtype], f"{kind} paged vs float64")
    oneshot = oneshot_logits(model, cfg, seqs)
    check(paged, [o.double() for o in oneshot], TOL[dtype] / 2, f"{kind} paged vs one-shot")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_torch_path_matches_float64(dtype, seqs):
    cfg, w = setup(dtype)
    model = make_model("torch", cfg, w)
    ref = reference64(dtype, seqs)
    check(oneshot_logits(model, cfg, seqs), ref, TOL[dtype], "torch path one-shot")
    check(paged_logits(model, cfg, seqs), ref, TOL[dtype], "torch path paged")


def test_generate_agrees_across_paths(seqs):
    """Greedy tokens (fp32): library (reference kernels) == plain PyTorch; whole == chunked prefill."""
    cfg, w = setup(torch.float32)
    prompts = [s[:-DECODE] for s in seqs]
    lib = Engine(make_model("reference", cfg, w), make_kv(cfg)).generate(prompts, 4, graph=False)
    lib_chunked = Engine(make_model("reference", cfg, w), make_kv(cfg)).generate(prompts, 4, chunk_size=3, graph=False)
    plain = Engine(make_model("torch", cfg, w), make_kv(cfg)).generate(prompts, 4, graph=False)
    assert lib.tokens.shape == (len(seqs), 4)
    assert torch.equal(lib.tokens, plain.tokens)
    assert torch.equal(lib.tokens, lib_chunked.tokens)


@pytest.mark.parametrize("kind", ["reference", "selector"])
def test_eager_decode_step_plans_read_the_row_strided_q(kind, seqs):
    """A decode forward without ``plan_decode`` runs ``mha_decode_step_plan`` on q as a view of
    the fused qkv rows (B = 3: row-strided); it matches the planned decode (``DecodePlan.run``
    on a contiguous q) and the float64 forward at every sequence's last position."""
    cfg, w = setup(torch.float32)
    model = make_model(kind, cfg, w)
    engine = Engine(model, make_kv(cfg))
    rids = engine.add_requests([len(s) - 1 for s in seqs], 1)
    engine.prefill(rids, [s[:-1] for s in seqs])
    tokens = torch.stack([s[-1] for s in seqs])
    logits = []
    for planned in (False, True):
        batch = engine.kv.decode_batch(rids)
        engine.kv.fill_decode(batch, advance=not planned)  # the second pass rewrites the same slots
        if planned:
            model.plan_decode(batch, engine.kv)
        logits.append(model.logits(model.forward(tokens, batch, engine.kv)))
        assert bool(batch.step_plans) != planned
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)
    ref = [r[-1:] for r in reference64(torch.float32, seqs)]
    check([row[None] for row in logits[0]], ref, TOL[torch.float32], f"{kind} eager decode step plans")


def test_kvcache_allocation_free_reuse():
    cfg = GptOssConfig.tiny()
    kv = make_kv(cfg, num_pages=6, max_batch=3, max_pages_per_seq=4)
    a = kv.add(0, 5)  # 2 pages
    b = kv.add(1, 4)  # 1 page
    assert (a.row, a.pages, b.row, b.pages) == (0, [0, 1], 1, [2])
    assert kv.page_table[0, :2].tolist() == [0, 1] and kv.page_table[1, 0].item() == 2
    assert kv.free_pages == 3
    kv.free(0)
    assert kv.free_pages == 5 and kv.page_table[0].tolist() == [0, 0, 0, 0]
    c = kv.add(2, 12)  # reuses row 0 and the lowest free pages
    assert c.row == 0 and c.pages == [0, 1, 3]
    kv.reserve(1, 8)
    assert kv.seqs[1].pages == [2, 4]
    kv.free(1)
    kv.free(2)
    assert kv.free_pages == 6 and kv.seqs == {}


def test_kvcache_slot_mapping_and_decode_metadata():
    cfg = GptOssConfig.tiny()
    kv = make_kv(cfg, num_pages=8, max_batch=2, max_pages_per_seq=4)
    kv.add(0, 3)
    kv.add(1, 9)  # pages [1, 2, 3]
    kv.free(0)
    kv.add(2, 6)  # row 0, pages [0, 4]
    assert kv.slots(1, 2, 5).tolist() == [6, 7, 8, 9, 10]  # page 1 offsets 2,3 then page 2, page 3 offset 0
    assert kv.slots(2, 3, 2).tolist() == [3, 16]
    batch = kv.chunk_batch([1, 2], [6, 4])
    assert batch.cu_seqlens_q.tolist() == [0, 6, 10]
    assert batch.positions.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]
    assert batch.page_table.tolist() == [[1, 2, 3, 0], [0, 4, 0, 0]]  # rows 1, 0: gathered
    assert batch.cache_seqlens.tolist() == [6, 4]
    dec = kv.decode_batch([2, 1])  # rows 0, 1
    kv.fill_decode(dec, advance=True)
    assert dec.cache_seqlens.tolist() == [5, 7]
    assert dec.positions.tolist() == [4, 6]
    assert dec.slot_mapping.tolist() == [kv.slots(2, 4, 1).item(), kv.slots(1, 6, 1).item()]
    with pytest.raises(ValueError, match="consecutive batch rows"):
        kv.decode_batch([1, 2])


def test_kvcache_errors():
    cfg = GptOssConfig.tiny()
    kv = make_kv(cfg, num_pages=3, max_batch=2, max_pages_per_seq=4)
    kv.add(0, 8)
    with pytest.raises(RuntimeError, match=r"out of KV pages: request 1 needs 2 pages for 5 tokens, 1 of 3 are free"):
        kv.add(1, 5)
    assert 1 not in kv.seqs and kv.free_pages == 1  # nothing leaked
    with pytest.raises(ValueError, match="at most 16"):
        kv.add(1, 17)
    with pytest.raises(ValueError, match="already in the KV cache"):
        kv.add(0, 1)
    with pytest.raises(ValueError, match="past its 2 reserved pages"):
        kv.slots(0, 6, 3)
    kv.add(1, 4)
    with pytest.raises(RuntimeError, match="no free batch row"):
        kv.add(2, 1)
    kv.set_lengths({1: 4})
    with pytest.raises(RuntimeError, match="exceed its reserved"):
        kv.check_decode_room([1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-graph decode needs a CUDA device")
def test_cuda_graph_decode_matches_eager(seqs):
    cfg = GptOssConfig.tiny()
    w = random_weights(cfg, device="cuda", seed=3)
    model = GptOssModel(cfg, w)
    prompts = [s[:-DECODE].cuda() for s in seqs]
    kw = dict(device="cuda")
    eager = Engine(model, make_kv(cfg, **kw)).generate(prompts, 6, graph=False)
    graph = Engine(model, make_kv(cfg, **kw)).generate(prompts, 6, graph=True)
    assert torch.equal(eager.tokens, graph.tokens)


def test_decode_runner_plans_once_and_updates_before_every_step(seqs, monkeypatch):
    """The decode step goes through one ``mha_decode_plan`` per layer (selected once) and
    updates every plan before each step, after the lengths advanced; the model names no
    kernel: the plans' kernels are the selector's."""
    from tokenspeed_kernel import DecodePlan, last_kernel

    cfg, w = setup(torch.float32)
    model = make_model("reference", cfg, w)
    engine = Engine(model, make_kv(cfg))
    rids = engine.add_requests([4, 6, 3], 3)
    engine.prefill(rids, [s[:n] for s, n in zip(seqs, (4, 6, 3))])
    seen: list[list[int]] = []
    real_update = DecodePlan.update

    def update(plan: DecodePlan) -> None:
        seen.append(plan.cache_seqlens.tolist())
        real_update(plan)

    monkeypatch.setattr(DecodePlan, "update", update)
    runner = DecodeRunner(model, engine.kv, rids, graph=False)
    plans = runner.batch.decode_plans
    assert [p.kernel for p in plans] == ["torch_decode"] * cfg.num_layers and not plans[0].capturable
    assert [p.window_left for p in plans] == [cfg.window_left(i) for i in range(cfg.num_layers)]
    layers = cfg.num_layers
    assert seen == [[4, 6, 3]] * layers  # planned at creation for the current lengths
    runner.step()
    runner.step()
    assert seen == [[4, 6, 3]] * layers + [[5, 7, 4]] * layers + [[6, 8, 5]] * layers
    assert last_kernel() in ("torch_moe", "torch_moe_topk", "torch_decode")


def test_example_and_benchmark_use_only_public_pieces():
    """No private modules of the library and no vendor modules in the example or its benchmark
    (``examples/gpt_oss/bench.py``)."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[2]
    files = sorted((root / "examples" / "gpt_oss").glob("*.py"))
    assert root / "examples" / "gpt_oss" / "bench.py" in files
    private = re.compile(r"tokenspeed_kernel(\.\w+)*\._[a-z]\w*|tokenspeed_kernel_(nvidia|triton|amd)\b")
    for path in files:
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            assert not private.search(line), f"{path.relative_to(root)}:{lineno}: {line.strip()}"


def test_host_cost_times_every_piece_of_the_step_and_restores_the_model():
    """``examples.gpt_oss.host_cost`` on the tiny model: each piece is called as often per step
    as the model calls it (2 layers: 2 decode runs, 2 MoE applies, one rotary table per step and
    one rotation of q and k per layer, 5 norms with the final one), the pieces and the rest add up to the step's wall time, the model's module
    and plans are restored afterwards, and the op count covers every piece."""
    import examples.gpt_oss.model as model_module
    from examples.gpt_oss import host_cost

    before = (model_module.rms_norm, model_module.store_kvcache, model_module.F)
    cost, plain_ms = host_cost.measure("cpu", ctx=40, steps=3, layers=2, tiny=True, count_steps=2)
    assert (model_module.rms_norm, model_module.store_kvcache, model_module.F) == before
    calls = {name: p.calls // cost.steps for name, p in cost.pieces.items()}
    assert calls == {
        "rms_norm (torch)": 5,
        "rope_tables (torch)": 1,
        "apply_rope (torch)": 2,
        "store_kvcache": 2,
        "moe_topk": 2,
        "F.linear (torch)": 6,
        "F.embedding (torch)": 1,
        "DecodePlan.run": 2,
        "MoEPlan.apply": 2,
    }
    rows = cost.rows()
    assert abs(sum(us for _, us, _, _ in rows) - cost.wall_s / cost.steps * 1e6) < 1e-3
    assert rows[-1][1] >= 0 and plain_ms > 0
    assert "our public calls" in cost.table()
    # --count-ops: every piece and the rest counted, whole operators per step (each step the same)
    ops = cost.ops_per_step()
    assert set(ops) == set(cost.pieces) | {rows[-1][0]}
    assert all(n == int(n) for n in ops.values()) and ops["F.embedding (torch)"] == 1 and ops["F.linear (torch)"] == 6
    assert min(ops[name] for name in cost.pieces) > 0 and "aten ops per step" in cost.table()
