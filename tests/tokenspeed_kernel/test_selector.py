"""Selection: filtering with reasons, ranking, overrides, caching, explain tables."""

import dataclasses

import pytest
import torch

from tokenspeed_kernel import config, platform, registry, selector
from tokenspeed_kernel.registry import Priority, Request
from tokenspeed_kernel.selector import KernelOverrideError, NoKernelFoundError, explain, select

pytestmark = pytest.mark.usefixtures("only_reference")

H100 = platform.platform_from_arch("sm_90")
MI355 = platform.platform_from_arch("gfx950")
MI300 = platform.platform_from_arch("gfx942")
CPU = platform.platform_from_arch("cpu", overridden=False)

REQ = Request.make(
    "attention.decode",
    {"q": torch.bfloat16, "kv": torch.bfloat16},
    {"head_dim": 64, "head_dim_v": 64, "num_q_heads": 64, "num_kv_heads": 8, "page_size": 16, "q_len": 1},
    ["sinks", "sliding_window"],
)


def test_reference_wins_when_nothing_else_serves():
    assert select(REQ, CPU).name == "torch_decode"


def test_priority_ranks_accepted_candidates(temp_kernels):
    temp_kernels("attention.decode", name="t_portable", vendors=("cuda",), features=("sinks", "sliding_window"))
    temp_kernels(
        "attention.decode",
        name="t_special",
        vendors=("cuda",),
        priority=Priority.SPECIALIZED,
        features=("sinks", "sliding_window"),
    )
    assert select(REQ, H100).name == "t_special"
    assert select(REQ, CPU).name == "torch_decode"


def test_ties_are_broken_by_name(temp_kernels):
    temp_kernels("attention.decode", name="t_tie_b", features=("sinks", "sliding_window"))
    temp_kernels("attention.decode", name="t_tie_a", features=("sinks", "sliding_window"))
    assert select(REQ, H100).name == "t_tie_a"


def test_rank_when_ranks_by_shape_and_never_rejects(temp_kernels):
    """A kernel with ``rank_when`` ranks at its other priority only for matching requests
    (here small batches); elsewhere it keeps its own rank and stays reachable by override."""
    feats = ("sinks", "sliding_window")
    temp_kernels("attention.decode", name="t_default", vendors=("cuda",), features=feats)
    temp_kernels(
        "attention.decode",
        name="t_small_batch",
        vendors=("cuda",),
        features=feats,
        priority=Priority.OPT_IN,
        rank_when=({"batch_bucket": (1, 2, 4, 8)}, Priority.PERFORMANT),
    )
    shapes = dict(REQ.shapes)
    small = Request.make(REQ.op, dict(REQ.dtypes), {**shapes, "batch_bucket": 4}, REQ.features)
    large = Request.make(REQ.op, dict(REQ.dtypes), {**shapes, "batch_bucket": 64}, REQ.features)
    assert select(small, H100).name == "t_small_batch"
    assert select(large, H100).name == "t_default"
    assert select(REQ, H100).name == "t_default"  # no batch_bucket in the request: its own rank
    assert select(large, H100, override="t_small_batch").name == "t_small_batch"
    table = explain(small, platform=H100).table()
    assert "WINNER   t_small_batch" in table and "performant(200)" in table
    assert "opt_in(50)" in explain(large, platform=H100).table()
    # explain says which rule did not hold, and why (the request's value and the rule's set)
    missed = "opt_in(50) (not ranked performant(200): batch_bucket {} not in {{1,2,4,8}})"
    assert missed.format(64) in explain(large, platform=H100).table()
    assert missed.format("absent") in explain(REQ, platform=H100).table()
    assert "not ranked" not in table
    listed = registry.get_kernel("t_small_batch").summary()  # what `tokenspeed-kernel list` prints
    assert "ranks=performant(200) when batch_bucket in {1,2,4,8}" in listed


def test_rank_when_none_accepts_requests_without_the_key(temp_kernels):
    """``None`` in a ``rank_when`` set stands for "key absent": here long, unwindowed
    prefills only (a windowed request carries ``window_left``, a dense one does not)."""
    feats = ("sinks", "sliding_window")
    temp_kernels("attention.prefill", name="t_prefill_default", vendors=("cuda",), features=feats)
    temp_kernels(
        "attention.prefill",
        name="t_long_dense",
        vendors=("cuda",),
        features=feats,
        priority=Priority.OPT_IN,
        rank_when=({"max_seqlen_q_bucket": (4096, 8192), "window_left": (None,)}, Priority.PERFORMANT),
    )
    base = {"head_dim": 64, "head_dim_v": 64, "num_q_heads": 8, "num_kv_heads": 2}
    dtypes = {"q": torch.bfloat16, "kv": torch.bfloat16}

    def winner(features=("sinks",), **shapes):
        return select(Request.make("attention.prefill", dtypes, {**base, **shapes}, features), H100).name

    assert winner(max_seqlen_q_bucket=8192) == "t_long_dense"
    assert winner(max_seqlen_q_bucket=1024) == "t_prefill_default"
    assert winner(feats, max_seqlen_q_bucket=8192, window_left=127) == "t_prefill_default"
    assert winner() == "t_prefill_default"  # no length key: None accepts absence of window_left only
    listed = registry.get_kernel("t_long_dense").summary()
    assert "max_seqlen_q_bucket in {4096,8192} and window_left in {absent}" in listed


def test_rank_when_is_checked_at_registration(temp_kernels):
    with pytest.raises(ValueError, match="unknown shape key 'batch'"):
        temp_kernels("attention.decode", name="t_bad_rank", rank_when=({"batch": (1,)}, Priority.PERFORMANT))
    with pytest.raises(ValueError, match="rank_when needs at least one shape key"):
        temp_kernels("attention.decode", name="t_empty_rank", rank_when=({}, Priority.PERFORMANT))


@pytest.mark.parametrize(
    ("meta", "plat", "reason"),
    [
        ({"vendors": ("rocm",)}, H100, "vendor cuda not in {rocm}"),
        ({"vendors": ("cuda",), "archs": ("sm_100",)}, H100, "arch sm_90 not in {sm_100}"),
        ({"vendors": ("rocm",), "capabilities": ("mxfp4_mma",)}, MI300, "platform lacks capabilities {mxfp4_mma}"),
        ({"dtypes": {"q": (torch.float16,)}}, H100, "q dtype bfloat16 not in {float16}"),
        ({"shapes": {"head_dim": (128, 256)}}, H100, "head_dim=64 not in {128, 256}"),
        ({"features": ("sinks",)}, H100, "does not support {sliding_window}"),
        (
            {"predicate": lambda req: "needs page_size >= 64" if req.shape("page_size") < 64 else None},
            H100,
            "needs page_size >= 64",
        ),
        ({"available": lambda: "somelib not installed"}, H100, "somelib not installed"),
    ],
)
def test_each_rejection_states_its_reason(temp_kernels, meta, plat, reason):
    meta.setdefault("features", ("sinks", "sliding_window"))
    temp_kernels("attention.decode", name="t_rejected", priority=Priority.PLUGIN, **meta)
    sel = explain(REQ, platform=plat)
    cand = next(c for c in sel.candidates if c.spec.name == "t_rejected")
    assert not cand.accepted
    assert reason in "; ".join(cand.reasons)
    assert sel.winner is not None and sel.winner.name == "torch_decode"
    table = sel.table()
    assert "REJECTED t_rejected" in table and reason in table and "WINNER   torch_decode" in table


def test_a_vendor_capability_gates_that_vendor_only(temp_kernels):
    """``vendor_capabilities={"cpu": ("triton_interpreter",)}``: a CPU platform without the
    interpreter rejects the kernel with that reason; with it, and on every GPU, it is accepted."""
    temp_kernels(
        "attention.decode",
        name="t_interpreted",
        vendors=("cuda", "rocm", "cpu"),
        vendor_capabilities={"cpu": (platform.INTERPRETER_CAPABILITY,)},
        features=("sinks", "sliding_window"),
        priority=Priority.PLUGIN,
    )
    bare_cpu = dataclasses.replace(CPU, capabilities=CPU.capabilities - {platform.INTERPRETER_CAPABILITY})
    interpreter_cpu = dataclasses.replace(CPU, capabilities=CPU.capabilities | {platform.INTERPRETER_CAPABILITY})
    sel = explain(REQ, platform=bare_cpu)
    cand = next(c for c in sel.candidates if c.spec.name == "t_interpreted")
    assert cand.reasons == ("platform lacks capabilities {triton_interpreter}",)
    assert sel.winner.name == "torch_decode" and "platform lacks capabilities {triton_interpreter}" in sel.table()
    for plat in (interpreter_cpu, H100, MI355, MI300):
        assert select(REQ, platform=plat).name == "t_interpreted", plat.arch


def test_all_reasons_are_listed_not_just_the_first(temp_kernels):
    temp_kernels("attention.decode", name="t_many", vendors=("rocm",), dtypes={"q": (torch.float16,)}, features=())
    cand = next(c for c in explain(REQ, platform=H100).candidates if c.spec.name == "t_many")
    assert len(cand.reasons) == 3


def test_no_kernel_found_carries_the_table(temp_kernels):
    req = Request.make("moe.apply", {"x": torch.bfloat16, "weight": torch.bfloat16}, {}, ["silu", "no_such_feature"])
    with pytest.raises(NoKernelFoundError) as info:
        select(req, CPU)
    assert info.value.selection.winner is None
    assert "REJECTED torch_moe" in str(info.value) and "no_such_feature" in str(info.value)


def test_per_call_override_wins_and_explains_refusal(temp_kernels):
    temp_kernels("attention.decode", name="t_fast", priority=Priority.SPECIALIZED, features=("sinks", "sliding_window"))
    assert select(REQ, H100).name == "t_fast"
    assert select(REQ, H100, override="torch_decode").name == "torch_decode"
    temp_kernels("attention.decode", name="t_nosinks", features=())
    with pytest.raises(KernelOverrideError, match="'t_nosinks' cannot serve .* does not support"):
        select(REQ, H100, override="t_nosinks")
    with pytest.raises(KernelOverrideError, match="'nope' is not a kernel registered for attention.decode"):
        select(REQ, H100, override="nope")


def test_env_override(temp_kernels, env):
    temp_kernels(
        "attention.decode", name="t_fast2", priority=Priority.SPECIALIZED, features=("sinks", "sliding_window")
    )
    env(config.OVERRIDE_ENV, "attention.decode=torch_decode, moe.apply=torch_moe")
    assert select(REQ, H100).name == "torch_decode"
    assert select(REQ, H100, override="t_fast2").name == "t_fast2"  # per call beats env


def test_malformed_env_override(env):
    env(config.OVERRIDE_ENV, "attention.decode")
    with pytest.raises(ValueError, match="expected 'operator=kernel'"):
        select(REQ, H100)


def test_env_override_naming_an_unknown_operator_is_an_error(env):
    env(config.OVERRIDE_ENV, "attention.decod=torch_decode")
    with pytest.raises(KernelOverrideError, match=r"names unknown operators \['attention.decod'\]"):
        select(REQ, H100)
    assert select(REQ, H100, override="torch_decode").name == "torch_decode"  # a per-call override wins


def test_platform_override_env_drives_selection(temp_kernels, env):
    temp_kernels(
        "attention.decode",
        name="t_amd_only",
        vendors=("rocm",),
        archs=("gfx950",),
        priority=Priority.SPECIALIZED,
        features=("sinks", "sliding_window"),
    )
    env(config.PLATFORM_ENV, "gfx950")
    assert select(REQ).name == "t_amd_only"
    env(config.PLATFORM_ENV, "gfx942")
    assert select(REQ).name == "torch_decode"


def test_selection_is_cached_and_invalidated_on_registration(temp_kernels):
    calls = []
    temp_kernels(
        "attention.decode",
        name="t_counted",
        priority=Priority.SPECIALIZED,
        features=("sinks", "sliding_window"),
        predicate=lambda req: calls.append(req),
    )
    for _ in range(5):
        assert select(REQ, H100).name == "t_counted"
    assert len(calls) == 1
    temp_kernels("attention.decode", name="t_newer", priority=Priority.PLUGIN, features=("sinks", "sliding_window"))
    assert select(REQ, H100).name == "t_newer"


def test_clear_cache_and_explain_by_keywords():
    selector.clear_cache()
    sel = explain(
        "attention.decode",
        dtypes={"q": torch.bfloat16, "kv": torch.bfloat16},
        shapes={"head_dim": 64},
        features=["sinks"],
        platform=CPU,
    )
    assert sel.winner is not None and sel.winner.name == "torch_decode"
    assert "request:  attention.decode" in str(sel)


def test_env_override_naming_a_foreign_or_unknown_kernel_is_an_error_on_any_operator(env):
    env(config.OVERRIDE_ENV, "moe.topk=torch_decode")
    message = (
        r"^TOKENSPEED_KERNEL_OVERRIDE: moe.topk=torch_decode: 'torch_decode' is a kernel of attention.decode, "
        r"not of moe.topk; moe.topk kernels: .*torch_moe_topk$"
    )
    with pytest.raises(KernelOverrideError, match=message):
        select(REQ, H100)  # an attention.decode request: the whole variable is checked
    env(config.OVERRIDE_ENV, "attention.decode=nope")
    with pytest.raises(
        ValueError, match=r"attention.decode=nope: no kernel named 'nope' is registered; .*torch_decode"
    ):
        select(REQ, H100)


def test_a_valid_env_override_is_checked_once_not_per_call(env, monkeypatch):
    from tokenspeed_kernel import selector

    env(config.OVERRIDE_ENV, "attention.decode=torch_decode")
    assert selector.env_overrides() == {"attention.decode": "torch_decode"}

    def no_lookup(*args, **kwargs):
        raise AssertionError("the registry was read again")

    monkeypatch.setattr(selector.registry, "kernels", no_lookup)
    assert selector.env_overrides() == {"attention.decode": "torch_decode"}  # cached for this value


# A plugin with a bug: its predicate or available hook raises. It is rejected with the
# exception as its reason, warned about once, and every other kernel is judged as usual.
ALL_DECODE = ("sinks", "sliding_window", "logit_cap", "return_lse", "fp8_kv", "spec_decode", "strided_kv")


def _divide_by_heads(request):
    """The doc's old example, broken: a request without ``num_q_heads`` divides by zero."""
    return None if 64 // (request.shape("num_q_heads") or 0) else "never"


def _warnings_about(caplog, name):
    return [r for r in caplog.records if r.levelname == "WARNING" and repr(name) in r.getMessage()]


def test_a_raising_predicate_is_the_kernels_reason_logged_once(temp_kernels, caplog):
    calls = []

    def boom(request):
        calls.append(request)
        return 1 // 0

    temp_kernels("attention.decode", name="t_boom", priority=Priority.PLUGIN, features=ALL_DECODE, predicate=boom)
    with caplog.at_level("WARNING", logger="tokenspeed_kernel"):
        assert select(REQ, CPU).name == "torch_decode"
        assert select(REQ, CPU).name == "torch_decode"  # cached like any rejection: not judged again
        assert len(calls) == 1
        sel = explain(REQ, platform=CPU)
        other = Request.make(REQ.op, dict(REQ.dtypes), {**dict(REQ.shapes), "page_size": 32}, REQ.features)
        assert select(other, CPU).name == "torch_decode"
    cand = next(c for c in sel.candidates if c.spec.name == "t_boom")
    reason = "predicate raised ZeroDivisionError: integer division or modulo by zero"
    assert cand.reasons == (reason,) and sel.winner.name == "torch_decode"
    assert "REJECTED t_boom" in sel.table() and reason in sel.table()
    (record,) = _warnings_about(caplog, "t_boom")  # three requests judged, one warning
    message = record.getMessage()
    assert "backend " in message and f"module {__name__}" in message and reason in message
    assert record.exc_info is not None and record.exc_info[0] is ZeroDivisionError  # the plugin's traceback
    with pytest.raises(KernelOverrideError, match="'t_boom' cannot serve .*predicate raised ZeroDivisionError"):
        select(REQ, CPU, override="t_boom")
    assert selector.request_reasons(registry.get_kernel("t_boom"), REQ) == (reason,)


def test_the_docs_broken_predicate_example_no_longer_breaks_selection(temp_kernels, caplog):
    temp_kernels(
        "attention.decode",
        name="t_doc_example",
        priority=Priority.PLUGIN,
        features=ALL_DECODE,
        predicate=_divide_by_heads,
    )
    headless = Request.make(REQ.op, dict(REQ.dtypes), {"head_dim": 64, "page_size": 16}, REQ.features)
    with caplog.at_level("WARNING", logger="tokenspeed_kernel"):
        assert select(REQ, CPU).name == "t_doc_example"  # with num_q_heads it serves
        assert select(headless, CPU).name == "torch_decode"  # without, the next kernel does
    assert len(_warnings_about(caplog, "t_doc_example")) == 1


def test_a_raising_available_hook_is_the_kernels_only_reason(temp_kernels, caplog):
    def missing_library():
        raise ImportError("libfoo.so: cannot open shared object file")

    temp_kernels(
        "attention.decode",
        name="t_no_lib",
        priority=Priority.PLUGIN,
        features=ALL_DECODE,
        vendors=("rocm",),
        available=missing_library,
    )
    reason = "available raised ImportError: libfoo.so: cannot open shared object file"
    with caplog.at_level("WARNING", logger="tokenspeed_kernel"):
        assert select(REQ, H100).name == "torch_decode"
        cand = next(c for c in explain(REQ, platform=H100).candidates if c.spec.name == "t_no_lib")
        assert cand.reasons == (reason,)  # alone, as a missing library's reason is
        assert selector.platform_reasons(registry.get_kernel("t_no_lib"), MI355) == (reason,)
        assert registry.kernels("attention.decode")[0].name == "t_no_lib"  # still listed
    (record,) = _warnings_about(caplog, "t_no_lib")
    assert record.exc_info[0] is ImportError and reason in record.getMessage()


def test_a_hook_returning_a_non_string_is_a_reason_too(temp_kernels, caplog):
    temp_kernels(
        "attention.decode", name="t_true", priority=Priority.PLUGIN, features=ALL_DECODE, predicate=lambda r: True
    )
    temp_kernels(
        "attention.decode",
        name="t_false",
        priority=Priority.SPECIALIZED,
        features=ALL_DECODE,
        predicate=lambda r: False,
    )
    with caplog.at_level("WARNING", logger="tokenspeed_kernel"):
        sel = explain(REQ, platform=CPU)
    assert sel.winner.name == "t_false"  # a falsy result accepts
    cand = next(c for c in sel.candidates if c.spec.name == "t_true")
    assert cand.reasons == ("predicate returned True, not a reason string or None",)
    assert "REJECTED t_true" in sel.table()
    assert len(_warnings_about(caplog, "t_true")) == 1 and not _warnings_about(caplog, "t_false")


def test_a_raising_plugin_never_breaks_the_public_calls_or_plans(temp_kernels, caplog):
    """Every operator's public call and both plans are served by the next kernel; one warning
    per broken kernel however many calls judged it. (The expert-parallel exchange runs across
    the ranks of a process group, so it has no single-process case here:
    support/ep_worker.py checks the same for it on gloo ranks.)"""
    from tokenspeed_kernel import last_kernel
    from tokenspeed_kernel.operators import OPERATORS
    from tokenspeed_kernel.ops.attention import mha_decode_plan
    from tokenspeed_kernel.tools import cases

    for op, schema in OPERATORS.items():
        temp_kernels(
            op, name=f"t_boom.{op}", priority=Priority.PLUGIN, features=schema.features, predicate=lambda r: 1 / 0
        )
    served = {}
    with caplog.at_level("WARNING", logger="tokenspeed_kernel"):
        for op in cases.OPS:
            case = cases.awkward_cases(op, torch.float32)[0]
            inputs = cases.make_inputs(case)
            got = cases.planned_call(case, inputs)()  # moe.apply: moe_plan, then plan.apply
            served[op] = last_kernel()
            out = got[0] if isinstance(got, tuple) else got
            want = cases.reference(case, inputs)[0]
            if out is not None:  # kvcache.store writes the cache in place
                torch.testing.assert_close(out.double(), want.double(), atol=1e-4, rtol=1e-4)
            cases.call(case, inputs)
            assert last_kernel() == served[op]
        decode = cases.AttentionCase(
            "attention.decode", (1, 1, 1), (10, 7, 3), 4, 2, 16, page_size=4, dtype=torch.float32
        )
        d = cases.make_inputs(decode)
        plan = mha_decode_plan(
            d["k_cache"],
            d["v_cache"],
            d["page_table"],
            d["cache_seqlens"],
            d["max_seqlen_k"],
            num_q_heads=decode.num_q_heads,
            window_left=d["window_left"],
            sinks=d["sinks"],
        )
    assert served == {op: registry.kernels(op)[-1].name for op in cases.OPS}  # the reference kernels
    assert plan.kernel == "torch_decode"
    for op in cases.OPS:
        assert len(_warnings_about(caplog, f"t_boom.{op}")) == 1, op


# Ties: equal priorities are broken by name, and the selection says so.


def test_explain_says_when_a_tie_was_broken_by_name(temp_kernels):
    feats = ("sinks", "sliding_window")
    temp_kernels("attention.decode", name="t_tie_b", priority=Priority.PERFORMANT, features=feats)
    temp_kernels("attention.decode", name="t_tie_a", priority=Priority.PERFORMANT, features=feats)
    temp_kernels("attention.decode", name="t_tie_c", priority=Priority.PERFORMANT, features=())  # rejected
    sel = explain(REQ, platform=H100)
    assert sel.winner.name == "t_tie_a"
    assert sel.tie_break == selector.TieBreak(Priority.PERFORMANT, ("t_tie_b",), "name")
    table = sel.table()
    assert "=> t_tie_a (tied at performant(200) with t_tie_b; broken by name: the first in string order wins)" in table
    loser = next(line for line in table.splitlines() if "t_tie_b" in line and "ACCEPTED" in line)
    assert loser.endswith("(tied with the winner; lost by name)")
    assert "t_tie_c" not in str(sel.tie_break.losers)  # a rejected kernel is not in the tie
    assert explain(REQ, platform=H100, override="t_tie_b").tie_break is None  # the override chose


def test_no_tie_break_without_a_tie(temp_kernels):
    feats = ("sinks", "sliding_window")
    temp_kernels("attention.decode", name="t_top", priority=Priority.PERFORMANT + 1, features=feats)
    temp_kernels("attention.decode", name="t_next", priority=Priority.PERFORMANT, features=feats)
    sel = explain(REQ, platform=H100)
    assert sel.winner.name == "t_top" and sel.tie_break is None
    assert "tied" not in sel.table()
    assert explain(REQ, platform=CPU).tie_break is None  # the reference alone


def test_a_tie_is_judged_at_the_priority_ranked_for_the_request(temp_kernels):
    """A ``rank_when`` kernel ties at the priority it ranks at for this request."""
    feats = ("sinks", "sliding_window")
    temp_kernels("attention.decode", name="t_b_default", priority=Priority.PERFORMANT, features=feats)
    temp_kernels(
        "attention.decode",
        name="t_a_small",
        priority=Priority.OPT_IN,
        features=feats,
        rank_when=({"batch_bucket": (1, 2)}, Priority.PERFORMANT),
    )
    small = Request.make(REQ.op, dict(REQ.dtypes), {**dict(REQ.shapes), "batch_bucket": 2}, REQ.features)
    sel = explain(small, platform=H100)
    assert sel.winner.name == "t_a_small" and sel.tie_break.losers == ("t_b_default",)
    assert explain(REQ, platform=H100).tie_break is None  # no batch: t_a_small ranks opt_in
