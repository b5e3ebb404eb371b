"""Selection: filtering with reasons, ranking, overrides, caching, explain tables."""

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
        "attention.decode", name="t_small_batch", vendors=("cuda",), features=feats, priority=Priority.OPT_IN,
        rank_when=({"batch_bucket": (1, 2, 4, 8)}, Priority.PERFORMANT),
    )  # fmt: skip
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
        "attention.prefill", name="t_long_dense", vendors=("cuda",), features=feats, priority=Priority.OPT_IN,
        rank_when=({"max_seqlen_q_bucket": (4096, 8192), "window_left": (None,)}, Priority.PERFORMANT),
    )  # fmt: skip
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
