"""Inputs engines really send (issue 27), across EVERY kernel that serves each op here.

Each test asks the selector which registered kernels can serve its request on this machine's
device (``DEVICE``: the GPU when torch sees one, else the CPU) and drives all of them through
the public call with ``override=``: on the CPU the reference kernels and the Triton kernels
under ``TRITON_INTERPRET=1``; on a GPU the reference kernels, the compiled Triton kernels and
any vendor kernel that serves the request. Every input lives on ``DEVICE``.

- padding rows of ``moe_topk`` (all ``-inf``, NaN, ``+inf``): ids ``0..k-1``, weight 0,
  the same in every kernel; ``moe_apply`` consumes them in range;
- a NaN/inf key or value that a query cannot see (outside its window, causally later, stale
  cache slots) leaves that query's output and LSE exactly as without it;
- the fp8 store keeps NaN and saturates ±inf;
- empty batches return empty outputs and launch nothing;
- zero head counts and integers past int32 are ``ValueError`` naming the argument;
- device errors name the argument that is on the wrong device;
- a store that raises has written nothing;
- a loose ``max_seqlen_q`` bound does not size the Triton grid.
"""

from __future__ import annotations

import math

import pytest
import torch

from tokenspeed_kernel import (
    mha_decode_plan,
    mha_decode_with_kvcache,
    mha_extend_with_kvcache,
    mha_prefill,
    moe_apply,
    moe_plan,
    moe_topk,
    registry,
    store_kvcache,
)
from tokenspeed_kernel.ops.moe.api import moe_apply_request, moe_topk_request
from tokenspeed_kernel.platform import platform_for
from tokenspeed_kernel.selector import evaluate
from tokenspeed_kernel.tools.cases import attention as cases

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NAN, INF = float("nan"), float("inf")


def serving(request) -> list[str]:
    """Every kernel that can serve ``request`` for tensors on ``DEVICE``."""
    return [c.spec.name for c in evaluate(request, platform_for(DEVICE)) if c.accepted]


def _inputs(case: cases.AttentionCase, seed: int = 0) -> dict:
    """``case``'s public-call arguments, drawn on ``DEVICE``."""
    return cases.make_inputs(case, DEVICE, seed=seed)


def _triton_present() -> bool:
    return any(spec.backend == "triton" for spec in registry.kernels())


def _expect_all(names: list[str], op_kernels: tuple[str, ...]) -> None:
    """The kernels the test must cover: the reference always, Triton's when it is installed."""
    want = {op_kernels[0]} | ({op_kernels[1]} if _triton_present() else set())
    assert want <= set(names), f"expected {sorted(want)} among the kernels serving the request, got {names}"


# --- 1. moe_topk padding rows ------------------------------------------------------------------

E, K = 8, 3


def _router_logits(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [12, E] mixing normal rows and padding rows; the padding mask [12]; both
    on ``DEVICE`` (drawn on the CPU, so every machine tests the same values)."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(12, E, generator=gen)
    pad = torch.zeros(12, dtype=torch.bool)
    logits[1] = -INF  # fully masked padding token
    logits[3, 2] = NAN  # one NaN logit
    logits[5, 6] = INF  # one +inf logit
    logits[7] = NAN  # all NaN
    logits[8, :4] = -INF  # some -inf, finite rest: a normal row
    logits[9, :4], logits[9, 4:] = -INF, NAN  # -inf and NaN
    logits[10, 0], logits[10, 1] = INF, -INF  # +inf next to -inf
    pad[[1, 3, 5, 7, 9, 10]] = True
    return logits.to(dtype).to(DEVICE), pad.to(DEVICE)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_topk_padding_rows_every_kernel(scoring, renormalize, dtype):
    logits, pad = _router_logits(dtype)
    names = serving(
        moe_topk_request(logits_dtype=dtype, num_experts=E, top_k=K, scoring=scoring, renormalize=renormalize)
    )
    _expect_all(names, ("torch_moe_topk", "triton_moe_topk"))
    results = {name: moe_topk(logits, K, scoring=scoring, renormalize=renormalize, override=name) for name in names}
    ref_w, ref_ids = results["torch_moe_topk"]
    assert torch.equal(ref_ids[pad], torch.arange(K, dtype=torch.int32, device=DEVICE).expand(int(pad.sum()), K))
    assert torch.equal(ref_w[pad], torch.zeros(int(pad.sum()), K, device=DEVICE))
    for name, (w, ids) in results.items():
        assert torch.isfinite(w).all(), name
        assert ((ids >= 0) & (ids < E)).all(), f"{name} returned expert ids outside [0, {E})"
        assert torch.equal(ids, ref_ids), name
        torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=1e-5, msg=name)
    # Row 8 (-inf on four experts) is a normal row: its choices come from the finite four.
    assert set(ref_ids[8].tolist()) <= {4, 5, 6, 7}


def test_moe_topk_zero_weight_sum_stays_zero_every_kernel():
    # Sigmoid of very negative logits underflows to 0 in float32: renormalizing 0 / 0 would
    # give NaN; the rule keeps the weights 0.
    logits = torch.full((2, E), -200.0, device=DEVICE)
    logits[1] = torch.linspace(-1, 1, E, device=DEVICE)
    names = serving(moe_topk_request(logits_dtype=torch.float32, num_experts=E, top_k=K, scoring="sigmoid"))
    _expect_all(names, ("torch_moe_topk", "triton_moe_topk"))
    for name in names:
        w, ids = moe_topk(logits, K, scoring="sigmoid", override=name)
        assert torch.equal(w[0], torch.zeros(K, device=DEVICE)), name
        assert torch.equal(ids[0], torch.arange(K, dtype=torch.int32, device=DEVICE)), name
        torch.testing.assert_close(w[1].sum(), torch.tensor(1.0, device=DEVICE), msg=name)


def test_moe_apply_consumes_padding_rows_in_range_every_kernel(monkeypatch):
    from tokenspeed_kernel import config

    monkeypatch.setenv(config.DEBUG_ENV, "1")  # expert ids are range-checked (a sync)
    config.refresh()
    try:
        logits, pad = _router_logits(torch.float32)
        hidden, inter = 32, 16
        gen = torch.Generator().manual_seed(2)
        x = torch.randn(12, hidden, generator=gen).to(DEVICE)
        w13 = (torch.randn(E, 2 * inter, hidden, generator=gen) / 8).to(DEVICE)
        w2 = (torch.randn(E, hidden, inter, generator=gen) / 8).to(DEVICE)
        request = moe_apply_request(
            x_dtype=torch.float32, num_experts=E, top_k=K, hidden=hidden, intermediate=inter, num_tokens=12
        )
        apply_names = serving(request)
        _expect_all(apply_names, ("torch_moe", "triton_fused_moe"))
        topk_names = serving(moe_topk_request(logits_dtype=torch.float32, num_experts=E, top_k=K))
        ref_weights, ref_ids = moe_topk(logits, K, override="torch_moe_topk")
        expected = moe_apply(x, w13, w2, ref_weights, ref_ids, override="torch_moe")  # the reference pair
        for topk_name in topk_names:
            weights, ids = moe_topk(logits, K, override=topk_name)
            for name in apply_names:
                y = moe_apply(x, w13, w2, weights, ids, override=name)
                assert torch.equal(y[pad], torch.zeros(int(pad.sum()), hidden, device=DEVICE)), f"{topk_name} -> {name}"
                # float32 everywhere (Triton's fp32 dots are IEEE): 1e-4 covers a GPU's summation order
                torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-4, msg=f"{topk_name} -> {name}")
    finally:
        monkeypatch.undo()
        config.refresh()


# --- 2. invisible NaN/inf keys and values --------------------------------------------------------


def _sees(case: cases.AttentionCase, q_pos: int, k_pos: int) -> bool:
    """docs/api.md: query at position i sees key j iff j <= i (causal) and i - j <= window."""
    causal = case.causal or case.op == "attention.decode"
    if causal and k_pos > q_pos:
        return False
    return case.window_left < 0 or q_pos - k_pos <= case.window_left


def _poison_plan(case: cases.AttentionCase) -> tuple[dict[int, list[int]], list[bool]]:
    """Poisoned key positions per sequence (of the first, a middle and the last key, those
    that some query of the sequence cannot see) and, per query row in output order, whether
    that row sees one of them."""
    poisoned, row_sees = {}, []
    for b, (lq, lk) in enumerate(zip(case.seqlens_q, case.seqlens_k)):
        positions = range(lk - lq, lk)
        keys = [j for j in sorted({0, lk // 2, lk - 1}) if j < lk and not all(_sees(case, i, j) for i in positions)]
        poisoned[b] = keys
        row_sees += [any(_sees(case, i, j) for j in keys) for i in positions]
    return poisoned, row_sees


def _poison(case: cases.AttentionCase, inputs: dict, value: float) -> dict:
    """A copy of ``inputs`` with ``value`` in K and V at the poisoned keys and, for a paged
    cache, in every slot that holds no key of any sequence (stale pages, tails of pages)."""
    poisoned, _ = _poison_plan(case)
    out = dict(inputs)
    if case.op == "attention.prefill":
        k, v = inputs["k"].clone(), inputs["v"].clone()
        starts = inputs["cu_seqlens_k"].tolist()
        for b, keys in poisoned.items():
            for j in keys:
                k[starts[b] + j] = value
                v[starts[b] + j] = value
        return out | {"k": k, "v": v}
    k_cache, v_cache = inputs["k_cache"].float(), inputs["v_cache"].float()  # fp8 -> fp32 -> fp8 is exact
    page = case.page_size
    live = torch.zeros(k_cache.shape[0] * page, dtype=torch.bool)
    table = inputs["page_table"].cpu()  # read on the host: no sync per slot
    for b, lk in enumerate(case.seqlens_k):
        for j in range(lk):
            live[int(table[b, j // page]) * page + j % page] = True
    stale = (~live).to(k_cache.device)
    kf, vf = k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:])
    kf[stale] = value
    vf[stale] = value
    for b, keys in poisoned.items():
        for j in keys:
            slot = int(table[b, j // page]) * page + j % page
            kf[slot] = value
            vf[slot] = value
    dtype = inputs["k_cache"].dtype
    return out | {"k_cache": k_cache.to(dtype), "v_cache": v_cache.to(dtype)}


ATTENTION_CASES = [
    # Ragged prefill with fewer queries than keys, a window of 3 and a sequence long enough
    # for left-edge, middle and diagonal key tiles.
    cases.AttentionCase("attention.prefill", (5, 9, 1, 70), (7, 9, 12, 90), 4, 2, 16, window_left=3, name="win"),
    cases.AttentionCase("attention.prefill", (5, 9, 70), (7, 9, 70), 4, 2, 16, name="causal"),
    cases.AttentionCase("attention.prefill", (5, 9), (7, 9), 4, 2, 16, causal=False, window_left=2, name="noncausal"),
    cases.AttentionCase(
        "attention.extend", (3, 1, 5, 40), (3, 9, 40, 75), 4, 1, 16, page_size=4, window_left=6, name="win"
    ),
    cases.AttentionCase("attention.extend", (3, 5), (9, 13), 4, 2, 16, page_size=8, kv_dtype=torch.float8_e4m3fn),
    cases.AttentionCase("attention.decode", (1,) * 4, (1, 7, 33, 90), 8, 2, 16, page_size=4, window_left=5, name="w"),
    cases.AttentionCase("attention.decode", (2,) * 3, (2, 9, 70), 4, 2, 16, page_size=16, name="spec"),
    cases.AttentionCase("attention.decode", (1,) * 2, (5, 20), 4, 2, 16, page_size=4, kv_dtype=torch.float8_e4m3fn),
]
REFERENCE = {
    "attention.prefill": "torch_prefill",
    "attention.extend": "torch_extend",
    "attention.decode": "torch_decode",
}
TRITON = {
    "attention.prefill": "triton_prefill",
    "attention.extend": "triton_extend",
    "attention.decode": "triton_decode",
}


# float8_e4m3fn has no infinity: fp8 caches are poisoned with NaN only.
POISON = [
    pytest.param(case, value, id=f"{case.op[10:]}-{case.name or 'fp8'}-{label}")
    for case in ATTENTION_CASES
    for value, label in ((NAN, "nan"), (INF, "inf"), (-INF, "-inf"))
    if case.cache_dtype != torch.float8_e4m3fn or math.isnan(value)
]


@pytest.mark.parametrize(("case", "value"), POISON)
def test_invisible_nan_keys_and_values_never_reach_a_query_every_kernel(case, value):
    case = cases.AttentionCase(**{**case.__dict__, "return_lse": True, "dtype": torch.float32})
    names = serving(cases.request(case))
    _expect_all(names, (REFERENCE[case.op], TRITON[case.op]))
    _assert_unseen_poison_changes_nothing(case, names, _inputs(case, seed=4), value)


def _assert_unseen_poison_changes_nothing(case: cases.AttentionCase, names: list[str], inputs: dict, value: float):
    """Every kernel in ``names``, on ``inputs`` and on them poisoned with ``value``: rows
    that see no poisoned key stay finite and keep every bit of their output and LSE
    (a kernel registered ``unseen_safe=False``, which says it breaks the promise (docs/api.md),
    is checked all the same and a leak is printed instead of failing; every other kernel must
    keep it)."""
    bad = _poison(case, inputs, value)
    _, row_sees = _poison_plan(case)
    clean_rows = ~torch.tensor(row_sees, device=DEVICE)
    assert clean_rows.any(), "the case must have rows that see no poisoned key"
    for name in names:
        out, lse = cases.call(case, inputs, override=name)
        bad_out, bad_lse = cases.call(case, bad, override=name)
        out, bad_out = out.reshape(-1, *out.shape[-2:]), bad_out.reshape(-1, *bad_out.shape[-2:])
        if not registry.get_kernel(name).unseen_safe and not torch.isfinite(bad_out[clean_rows]).all():
            print(f"{name}: leaks an unseen NaN/inf, as registered (unseen_safe=False)")
            continue
        assert torch.isfinite(bad_out[clean_rows]).all(), f"{name}: a NaN/inf no query can see leaked"
        # The same kernel on the same shapes: a key it masks changes no bit of those rows.
        assert torch.equal(bad_out[clean_rows], out[clean_rows]), f"{name}: output changed by an unseen key"
        assert torch.equal(bad_lse[clean_rows], lse[clean_rows]), f"{name}: LSE changed by an unseen key"


# GPT-OSS's head layout (GQA 8, head dim 64, sinks, a window) in bf16: on an H100 the Gluon
# decode and window-prefill kernels serve these too, so they meet the same poison. The causal
# cases without a window reach the dense FA3-style kernel (gluon_prefill_fa3_sm90; served here
# as an accepted kernel whatever its rank): one key tile holding the diagonal and the next
# sequence's (poisoned) keys past the first one's end; then 300 tokens (three 128-key tiles, the
# poisoned key 150 on a diagonal tile, invisible to the rows before it; 192-row work tiles at
# head dim 64 since 2026-11-28, 128-row ones before).
GPT_OSS_LAYOUT = [
    cases.AttentionCase("attention.prefill", (40, 9), (40, 9), 16, 2, 64, window_left=5, sinks=True, name="prefill"),
    cases.AttentionCase("attention.prefill", (40, 9), (40, 9), 16, 2, 64, sinks=True, name="prefill-causal"),
    cases.AttentionCase("attention.prefill", (300, 129), (300, 129), 16, 2, 64, sinks=True, name="prefill-tiles"),
    cases.AttentionCase(
        "attention.extend", (5, 3), (40, 70), 16, 2, 64, page_size=16, window_left=5, sinks=True, name="extend"
    ),
    cases.AttentionCase(
        "attention.decode", (1,) * 3, (40, 70, 9), 16, 2, 64, page_size=16, window_left=5, sinks=True, name="decode"
    ),
]


@pytest.mark.parametrize("case", GPT_OSS_LAYOUT, ids=lambda c: c.name)
def test_invisible_nan_at_gpt_oss_head_layout_every_kernel(case):
    case = cases.AttentionCase(**{**case.__dict__, "return_lse": True, "dtype": torch.bfloat16})
    names = serving(cases.request(case))
    _expect_all(names, (REFERENCE[case.op], TRITON[case.op]))
    _assert_unseen_poison_changes_nothing(case, names, _inputs(case, seed=9), NAN)
    print(f"{case.op}: {names}")


def test_reference_gives_nan_to_a_query_that_sees_a_nan_value():
    case = ATTENTION_CASES[0]
    inputs = _inputs(case, seed=4)
    out = cases.call(case, _poison(case, inputs, NAN), override="torch_prefill")
    _, row_sees = _poison_plan(case)
    assert torch.isnan(out[torch.tensor(row_sees, device=DEVICE)]).all(-1).all(-1).all()


# --- 3. the fp8 store keeps NaN --------------------------------------------------------------------


def test_fp8_store_keeps_nan_and_saturates_inf_every_kernel():
    case = cases.AttentionCase("kvcache.store", (6,), (6,), 2, 2, 16, page_size=4, kv_dtype=torch.float8_e4m3fn)
    names = serving(cases.request(case))
    _expect_all(names, ("torch_store_kvcache", "triton_store_kvcache"))
    base = _inputs(case, seed=1)
    k = base["k"].clone()
    k[0, 0, :4] = torch.tensor([NAN, INF, -INF, -NAN], device=DEVICE)
    k[2, 1, 5] = NAN
    v = base["v"].clone()
    v[1, 0, 0] = NAN
    slots = torch.arange(6, dtype=torch.int64, device=DEVICE)  # every row written
    written = {}
    for name in names:
        inputs = {**base, "k": k, "v": v, "slot_mapping": slots}
        inputs["k_cache"], inputs["v_cache"] = base["k_cache"].clone(), base["v_cache"].clone()
        cases.call(case, inputs, override=name)
        k_rows = inputs["k_cache"].flatten(0, 1)[:6].float()
        v_rows = inputs["v_cache"].flatten(0, 1)[:6].float()
        assert torch.equal(torch.isnan(k_rows), torch.isnan(k)), name
        assert torch.equal(torch.isnan(v_rows), torch.isnan(v)), name
        assert k_rows[0, 0, 1] == 448.0 and k_rows[0, 0, 2] == -448.0, name
        written[name] = (k_rows, v_rows)
    ref_k, ref_v = written["torch_store_kvcache"]
    for name, (k_rows, v_rows) in written.items():
        assert torch.equal(k_rows.nan_to_num(0.5), ref_k.nan_to_num(0.5)), name
        assert torch.equal(v_rows.nan_to_num(0.5), ref_v.nan_to_num(0.5)), name


# --- 4. empty batches -----------------------------------------------------------------------------


@pytest.fixture
def launches():
    """``launches(names)`` wraps those kernels' launch function and, where a kernel has one,
    its ``prepare_layout`` hook (a vendor kernel's per-batch plan, which may launch work on a
    GPU), so each call is recorded in the returned list; restored afterwards."""
    saved: list[tuple[object, str, object]] = []
    calls: list[str] = []

    def wrap(names):
        for name in names:
            spec = registry.get_kernel(name)
            for attr in ("fn", "prepare_layout"):
                fn = getattr(spec, attr)
                if fn is None:
                    continue
                saved.append((spec, attr, fn))

                def recorder(*args, _label=f"{name}.{attr}", _fn=fn, **kwargs):
                    calls.append(_label)
                    return _fn(*args, **kwargs)

                object.__setattr__(spec, attr, recorder)
        return calls

    yield wrap
    for spec, attr, fn in reversed(saved):
        object.__setattr__(spec, attr, fn)


EMPTY_CASES = {
    "attention.prefill": cases.AttentionCase("attention.prefill", (3,), (3,), 4, 2, 16),
    "attention.extend": cases.AttentionCase("attention.extend", (3,), (5,), 4, 2, 16, page_size=4),
    "attention.decode": cases.AttentionCase("attention.decode", (1,), (5,), 4, 2, 16, page_size=4),
}


def _empty_inputs(op: str, batch: int) -> dict:
    """Inputs of ``op`` with zero query tokens: ``batch`` sequences without queries (prefill,
    extend) or zero sequences (decode when ``batch`` is 0)."""
    inputs = _inputs(EMPTY_CASES[op], seed=0)
    cu = torch.zeros(batch + 1, dtype=torch.int32, device=DEVICE)
    q = inputs["q"][:0]
    if op == "attention.prefill":
        return inputs | {"q": q, "k": inputs["k"][:0], "v": inputs["v"][:0], "cu_seqlens_q": cu, "cu_seqlens_k": cu}
    if op == "attention.extend":
        table = inputs["page_table"][:1].expand(batch, -1).contiguous()
        return inputs | {
            "q": q,
            "cu_seqlens_q": cu,
            "page_table": table,
            "cache_seqlens": torch.zeros(batch, dtype=torch.int32, device=DEVICE),
        }
    return inputs | {"q": q, "page_table": inputs["page_table"][:0], "cache_seqlens": inputs["cache_seqlens"][:0]}


CALLS = {
    "attention.prefill": mha_prefill,
    "attention.extend": mha_extend_with_kvcache,
    "attention.decode": mha_decode_with_kvcache,
}


# (op, batch): batch 0, or sequences without queries (decode has one query per sequence:
# zero queries means zero sequences).
EMPTY = [("attention.prefill", 0), ("attention.prefill", 2), ("attention.extend", 0), ("attention.extend", 2),
         ("attention.decode", 0)]  # fmt: skip


@pytest.mark.parametrize(("op", "batch"), EMPTY, ids=[f"{o[10:]}-B{b}" for o, b in EMPTY])
def test_empty_attention_batches_launch_nothing_every_kernel(op, batch, launches):
    names = serving(cases.request(EMPTY_CASES[op]))
    _expect_all(names, (REFERENCE[op], TRITON[op]))
    calls = launches(names)
    inputs = _empty_inputs(op, batch)
    for name in names:
        for return_lse in (False, True):
            result = CALLS[op](**(inputs | {"return_lse": return_lse}), override=name)
            out, lse = result if return_lse else (result, None)
            assert out.shape == (*inputs["q"].shape[:-1], 16), name
            if lse is not None:
                assert lse.shape == (0, 4), name
    assert calls == [], f"kernels were called for an empty batch: {calls}"


def test_empty_decode_plan_every_kernel(launches):
    names = serving(cases.request(EMPTY_CASES["attention.decode"]))
    calls = launches(names)
    inputs = _empty_inputs("attention.decode", 0)
    for name in names:
        plan = mha_decode_plan(
            inputs["k_cache"],
            inputs["v_cache"],
            inputs["page_table"],
            inputs["cache_seqlens"],
            5,
            num_q_heads=4,
            override=name,
            return_lse=True,
        )
        plan.update()
        out, lse = plan.run(inputs["q"])
        assert out.shape == (0, 4, 16) and lse.shape == (0, 4), name
    assert calls == [], f"kernels were called for an empty batch: {calls}"


def test_empty_store_every_kernel(launches):
    case = cases.AttentionCase("kvcache.store", (3,), (3,), 2, 2, 16, page_size=4)
    names = serving(cases.request(case))
    _expect_all(names, ("torch_store_kvcache", "triton_store_kvcache"))
    calls = launches(names)
    inputs = _inputs(case)
    before = inputs["k_cache"].clone()
    empty = inputs | {"k": inputs["k"][:0], "v": inputs["v"][:0], "slot_mapping": inputs["slot_mapping"][:0]}
    for name in names:
        store_kvcache(**empty, override=name)
    assert calls == [] and torch.equal(inputs["k_cache"], before)


def test_empty_moe_every_kernel(launches):
    hidden, inter = 32, 16
    topk_names = serving(moe_topk_request(logits_dtype=torch.float32, num_experts=E, top_k=K))
    apply_names = serving(
        moe_apply_request(
            x_dtype=torch.float32, num_experts=E, top_k=K, hidden=hidden, intermediate=inter, num_tokens=0
        )
    )
    _expect_all(topk_names, ("torch_moe_topk", "triton_moe_topk"))
    _expect_all(apply_names, ("torch_moe", "triton_fused_moe"))
    calls = launches(topk_names + apply_names)
    w13 = torch.randn(E, 2 * inter, hidden, device=DEVICE)
    w2 = torch.randn(E, hidden, inter, device=DEVICE)
    x = torch.randn(0, hidden, device=DEVICE)
    for name in topk_names:
        weights, ids = moe_topk(torch.randn(0, E, device=DEVICE), K, override=name)
        assert weights.shape == ids.shape == (0, K)
    for name in apply_names:
        assert moe_apply(x, w13, w2, weights, ids, override=name).shape == (0, hidden)
        plan = moe_plan(w13, w2, x_dtype=torch.float32, top_k=K, override=name)
        assert plan.apply(x, weights, ids).shape == (0, hidden)
    assert calls == [], f"kernels were called for an empty batch: {calls}"


# --- 5. zero head counts and integer ranges ------------------------------------------------------


def _attention_inputs(op: str) -> tuple[cases.AttentionCase, dict]:
    case = EMPTY_CASES[op]
    return case, _inputs(case, seed=0)


ZERO_HEADS = [
    ("attention.prefill", "q", "q must have at least one query head"),
    ("attention.prefill", "k", "k must have at least one KV head"),
    ("attention.extend", "q", "q must have at least one query head"),
    ("attention.extend", "k_cache", "k_cache must have at least one KV head"),
    ("attention.decode", "q", "q must have at least one query head"),
    ("attention.decode", "k_cache", "k_cache must have at least one KV head"),
]


@pytest.mark.parametrize(("op", "arg", "match"), ZERO_HEADS, ids=[f"{o[10:]}-{a}" for o, a, _ in ZERO_HEADS])
def test_zero_heads_are_value_errors_every_kernel(op, arg, match, cold_and_warm):
    case, inputs = _attention_inputs(op)
    bad = dict(inputs)
    bad[arg] = inputs[arg][..., :0, :]
    if arg == "k":
        bad["v"] = inputs["v"][..., :0, :]
    if arg == "k_cache":
        bad["v_cache"] = inputs["v_cache"][..., :0, :]
    for name in serving(cases.request(case)):
        cold_and_warm(
            lambda name=name: CALLS[op](**inputs, override=name),
            lambda name=name: CALLS[op](**bad, override=name),
            ValueError,
            match,
        )


def test_zero_heads_in_plan_and_store_are_value_errors():
    _, inputs = _attention_inputs("attention.decode")
    tables = (inputs["k_cache"], inputs["v_cache"], inputs["page_table"], inputs["cache_seqlens"], 5)
    with pytest.raises(ValueError, match="num_q_heads must be >= 1, got 0"):
        mha_decode_plan(*tables, num_q_heads=0)
    store = cases.AttentionCase("kvcache.store", (3,), (3,), 2, 2, 16, page_size=4)
    s = _inputs(store)
    for name in serving(cases.request(store)):
        with pytest.raises(ValueError, match="k must have at least one KV head"):
            store_kvcache(
                s["k"][:, :0],
                s["v"][:, :0],
                s["k_cache"][:, :, :0],
                s["v_cache"][:, :, :0],
                s["slot_mapping"],
                override=name,
            )
        with pytest.raises(ValueError, match="v must have a head dim >= 1"):
            store_kvcache(
                s["k"], s["v"][..., :0], s["k_cache"], s["v_cache"][..., :0], s["slot_mapping"], override=name
            )


TOO_BIG = [2**31, 2**40, 2**64]
INT_ARGS = [
    ("attention.prefill", "window_left"),
    ("attention.prefill", "max_seqlen_q"),
    ("attention.prefill", "max_seqlen_k"),
    ("attention.extend", "window_left"),
    ("attention.extend", "max_seqlen_q"),
    ("attention.extend", "max_seqlen_k"),
    ("attention.decode", "window_left"),
    ("attention.decode", "max_seqlen_k"),
]


@pytest.mark.parametrize("value", TOO_BIG)
@pytest.mark.parametrize(("op", "arg"), INT_ARGS, ids=[f"{o[10:]}-{a}" for o, a in INT_ARGS])
def test_integers_past_int32_are_value_errors_naming_them_every_kernel(op, arg, value, cold_and_warm):
    case, inputs = _attention_inputs(op)
    for name in serving(cases.request(case)):
        cold_and_warm(
            lambda name=name: CALLS[op](**inputs, override=name),
            lambda name=name: CALLS[op](**(inputs | {arg: value}), override=name),
            ValueError,
            f"{arg} must be <= 2147483647",
        )


@pytest.mark.parametrize(
    ("arg", "value"), [("num_q_heads", 2**31), ("q_len", 2**40), ("window_left", 2**64), ("max_seqlen_k", 2**31)]
)
def test_plan_integers_past_int32_are_value_errors(arg, value):
    _, inputs = _attention_inputs("attention.decode")
    kwargs = {"num_q_heads": 4, "max_seqlen_k": 5, arg: value}
    with pytest.raises(ValueError, match=f"{arg} must be <= 2147483647"):
        mha_decode_plan(inputs["k_cache"], inputs["v_cache"], inputs["page_table"], inputs["cache_seqlens"], **kwargs)


@pytest.mark.parametrize("op", list(EMPTY_CASES))
def test_the_largest_int32_window_is_no_window_every_kernel(op):
    # window_left = 2**31 - 1 is valid: as wide as no window; kernels get it capped at the
    # keys a sequence can hold, so position - window never wraps around in int32.
    lengths_q = (1, 1) if op == "attention.decode" else (2, 1)
    case = cases.AttentionCase(**{**EMPTY_CASES[op].__dict__, "seqlens_q": lengths_q, "seqlens_k": (2, 6)})
    inputs = _inputs(case, seed=3)
    windowed = cases.AttentionCase(**{**case.__dict__, "window_left": 2**31 - 1})
    for name in serving(cases.request(windowed)):
        wide = cases.call(windowed, inputs | {"window_left": 2**31 - 1}, override=name)
        torch.testing.assert_close(wide, cases.call(case, inputs, override=name), msg=name)


def test_noncausal_prefill_with_more_queries_than_keys_and_widest_window_every_kernel():
    case = cases.AttentionCase("attention.prefill", (9,), (3,), 4, 2, 16, causal=False)
    windowed = cases.AttentionCase(**{**case.__dict__, "window_left": 2**31 - 1})
    inputs = _inputs(case, seed=3)
    for name in serving(cases.request(windowed)):
        wide = cases.call(windowed, inputs | {"window_left": 2**31 - 1}, override=name)
        torch.testing.assert_close(wide, cases.call(case, inputs, override=name), msg=name)


# --- 6. device errors name the argument on the wrong device -------------------------------------


# The wrong device: meta everywhere (no memory, and a kernel cannot read it); on a GPU machine
# also the CPU (an engine that left a table on the host).
WRONG_DEVICES = ["meta", "cpu"]


@pytest.mark.parametrize("wrong", WRONG_DEVICES)
def test_device_errors_name_the_right_argument(wrong):
    if torch.device(wrong) == DEVICE:
        pytest.skip(f"the tensors already live on {wrong}: it is no wrong device on this machine (no GPU)")
    _, inputs = _attention_inputs("attention.decode")
    home = str(inputs["q"].device)  # e.g. "cpu" or "cuda:0", as the messages spell it
    tables = ("k_cache", "v_cache", "page_table", "cache_seqlens")
    moved = {name: inputs[name].to(wrong) for name in tables}

    def plan(**changed):
        args = [changed.get(n, inputs[n]) for n in tables]
        return mha_decode_plan(*args, 5, num_q_heads=4)

    with pytest.raises(ValueError, match=f"^v_cache is on {home} but k_cache is on {wrong}$"):
        plan(k_cache=moved["k_cache"])
    for name in ("v_cache", "page_table", "cache_seqlens"):
        with pytest.raises(ValueError, match=f"^{name} is on {wrong} but k_cache is on {home}$"):
            plan(**{name: moved[name]})
    for name in tables:
        with pytest.raises(ValueError, match=f"^{name} is on {wrong} but q is on {home}$"):
            mha_decode_with_kvcache(**(inputs | {name: moved[name]}))
    store = cases.AttentionCase("kvcache.store", (3,), (3,), 2, 2, 16, page_size=4)
    s = _inputs(store)
    for name in ("v", "k_cache", "v_cache", "slot_mapping"):
        with pytest.raises(ValueError, match=f"^{name} is on {wrong} but k is on {home}$"):
            store_kvcache(**(s | {name: s[name].to(wrong)}))


# --- 7. a store that raises has written nothing --------------------------------------------------


@pytest.mark.parametrize("slot", [16, 2**40])
def test_out_of_range_slot_writes_nothing_every_kernel(slot, env):
    if DEVICE.type != "cpu":
        # Slots on the host are range-checked on every call; on a GPU only under debug (the
        # check is a device sync), which is what an engine turns on to catch a bad slot.
        from tokenspeed_kernel import config

        env(config.DEBUG_ENV, "1")
    case = cases.AttentionCase("kvcache.store", (3,), (3,), 2, 2, 16, page_size=4)  # 4 pages x 4 = 16 slots
    names = serving(cases.request(case))
    _expect_all(names, ("torch_store_kvcache", "triton_store_kvcache"))
    for name in names:
        inputs = _inputs(case, seed=2)
        assert inputs["k_cache"].shape[0] * 4 == 16
        inputs["slot_mapping"] = torch.tensor([0, 1, slot], dtype=torch.int64, device=DEVICE)
        before = inputs["k_cache"].clone(), inputs["v_cache"].clone()
        with pytest.raises(ValueError, match=f"slot_mapping holds slot {slot} but the cache has 16 slots"):
            store_kvcache(**inputs, override=name)
        assert torch.equal(inputs["k_cache"], before[0]) and torch.equal(inputs["v_cache"], before[1]), name


def test_reference_store_checks_every_slot_before_writing():
    # The reference kernel itself (what serves GPU tensors when selected) checks the range
    # before its first write: no partial write even where the public call cannot check.
    from tokenspeed_kernel.ops.kvcache.args import StoreArgs

    case = cases.AttentionCase("kvcache.store", (3,), (3,), 2, 2, 16, page_size=4)
    inputs = _inputs(case, seed=2)
    before = inputs["k_cache"].clone()
    args = StoreArgs(
        inputs["k"],
        inputs["v"],
        inputs["k_cache"],
        inputs["v_cache"],
        torch.tensor([0, 1, 2**40], device=DEVICE),
        None,
        None,
    )
    with pytest.raises(ValueError, match="slot_mapping holds slot"):
        registry.get_kernel("torch_store_kvcache").fn(args)
    assert torch.equal(inputs["k_cache"], before)


# --- 8. a loose max_seqlen_q bound does not size the grid -----------------------------------------


@pytest.mark.parametrize("op", ["attention.prefill", "attention.extend"])
def test_largest_max_seqlen_q_bound_runs_like_the_tight_one_every_kernel(op):
    case = cases.AttentionCase(**{**EMPTY_CASES[op].__dict__, "seqlens_q": (3, 2), "seqlens_k": (3, 5)})
    inputs = _inputs(case, seed=6)
    loose = inputs | {"max_seqlen_q": 2**31 - 1, "max_seqlen_k": 2**31 - 1}
    names = serving(cases.request(case))
    _expect_all(names, (REFERENCE[op], TRITON[op]))
    for name in names:
        torch.testing.assert_close(cases.call(case, loose, override=name), cases.call(case, inputs, override=name))
