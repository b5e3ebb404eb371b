"""Registration metadata is validated as data; kernels are listed in rank order."""

import pytest
import torch

from tokenspeed_kernel import registry
from tokenspeed_kernel.registry import Priority, Request

pytestmark = pytest.mark.usefixtures("only_reference")


def test_reference_backend_registers_every_operator():
    ops = {spec.op for spec in registry.kernels() if spec.backend == "reference"}
    assert ops == {
        "attention.prefill",
        "attention.extend",
        "attention.decode",
        "kvcache.store",
        "moe.topk",
        "moe.apply",
        "moe.dispatch",
        "moe.combine",
    }
    # Every one a reference, but the fixed-size expert-parallel exchange: torch.distributed
    # only, so it ships with the core, opt-in until measured on GPUs.
    not_reference = {"torch_moe_dispatch_padded"}
    for spec in registry.kernels():
        if spec.backend == "reference":
            assert spec.solution == "torch"
            assert spec.band is (Priority.OPT_IN if spec.name in not_reference else Priority.REFERENCE), spec.name
    for op in {spec.op for spec in registry.kernels()}:
        assert registry.kernels(op)[-1].band is Priority.REFERENCE, f"{op}: a reference kernel ranks last"


def test_registration_records_metadata_and_returns_function(temp_kernels):
    fn = temp_kernels(
        "attention.decode",
        name="t_meta",
        vendors=("cuda",),
        archs=("sm_90",),
        capabilities=("wgmma",),
        dtypes={"q": (torch.bfloat16,)},
        shapes={"head_dim": (64, 128)},
        features=("sinks",),
        priority=Priority.PERFORMANT + 5,
    )
    spec = registry.get_kernel("t_meta")
    assert spec.fn is fn
    assert spec.vendors == frozenset({"cuda"}) and spec.archs == frozenset({"sm_90"})
    assert spec.band is Priority.PERFORMANT and spec.priority == 205
    assert dict(spec.shapes) == {"head_dim": frozenset({64, 128})}
    assert "t_meta" in spec.summary() and "performant(205)" in spec.summary()


def test_vendor_capabilities_are_recorded_per_vendor(temp_kernels):
    temp_kernels(
        "attention.decode",
        name="t_vendor_caps",
        vendors=("cuda", "rocm", "cpu"),
        capabilities=("bf16",),
        vendor_capabilities={"cpu": iter(["triton_interpreter"]), "rocm": ()},  # any iterable; empty dropped
    )
    spec = registry.get_kernel("t_vendor_caps")
    assert spec.vendor_capabilities == (("cpu", frozenset({"triton_interpreter"})),)
    assert spec.capabilities_on("cpu") == {"bf16", "triton_interpreter"}
    assert spec.capabilities_on("cuda") == spec.capabilities_on("rocm") == {"bf16"}
    assert "caps=bf16 caps_on_cpu=triton_interpreter dtypes=" in spec.summary()
    assert registry.get_kernel("torch_decode").vendor_capabilities == ()


@pytest.mark.parametrize(
    ("meta", "message"),
    [
        ({"features": ("sink",)}, "unknown features \\['sink'\\]"),
        ({"dtypes": {"query": (torch.bfloat16,)}}, "unknown dtype role 'query'"),
        ({"shapes": {"headdim": (64,)}}, "unknown shape key 'headdim'"),
        ({"vendors": ("tpu",)}, "vendors must be a non-empty subset"),
        ({"dtypes": {"q": ("bf16",)}}, "must hold torch.dtype values"),
        (
            {"vendors": ("cuda",), "vendor_capabilities": {"cpu": ("x",)}},
            "vendor_capabilities names 'cpu', not one of its vendors cuda",
        ),
        ({"vendor_capabilities": {"cpu": "triton_interpreter"}}, "must be a collection of strings"),
    ],
)
def test_bad_metadata_is_rejected_at_registration(meta, message):
    with pytest.raises((ValueError, TypeError), match=message):
        registry.register_kernel("attention.decode", name="t_bad", solution="test", **meta)
    assert "t_bad" not in {s.name for s in registry.kernels()}


def test_unknown_operator_is_rejected():
    with pytest.raises(ValueError, match="unknown operator 'attention.decod'"):
        registry.register_kernel("attention.decod", name="t_bad_op", solution="test")


def test_duplicate_name_is_rejected(temp_kernels):
    temp_kernels("attention.decode", name="t_dup")
    with pytest.raises(ValueError, match="'t_dup' is already registered"):
        registry.register_kernel("attention.prefill", name="t_dup", solution="test")(lambda args: None)


def test_kernels_are_listed_highest_priority_first(temp_kernels):
    temp_kernels("attention.decode", name="t_low", priority=Priority.PORTABLE)
    temp_kernels("attention.decode", name="t_high", priority=Priority.SPECIALIZED)
    names = [s.name for s in registry.kernels("attention.decode")]
    assert names.index("t_high") < names.index("t_low") < names.index("torch_decode")


def test_priority_bands():
    assert Priority.band(0) is Priority.REFERENCE
    assert Priority.band(250) is Priority.PERFORMANT
    assert Priority.band(10_000) is Priority.PLUGIN
    assert (
        Priority.REFERENCE
        < Priority.OPT_IN
        < Priority.PORTABLE
        < Priority.PERFORMANT
        < Priority.SPECIALIZED
        < Priority.PLUGIN
    )


def test_each_band_admits_up_to_the_next_band():
    assert Priority.ranges() == {
        Priority.REFERENCE: range(0, 50),
        Priority.OPT_IN: range(50, 100),
        Priority.PORTABLE: range(100, 200),
        Priority.PERFORMANT: range(200, 300),
        Priority.SPECIALIZED: range(300, 400),
        Priority.PLUGIN: range(400, 500),
    }
    assert Priority.highest() == 499
    assert all(Priority.band(value) is band for band, span in Priority.ranges().items() for value in span)


ALLOWED = "allowed: reference 0..49, opt_in 50..99, portable 100..199, performant 200..299, specialized 300..399, plugin 400..499"


@pytest.mark.parametrize(
    ("meta", "what"),
    [
        ({"priority": 10**9}, "priority 1000000000"),
        ({"priority": Priority.PLUGIN + 100}, "priority 500"),
        ({"priority": -1}, "priority -1"),
        ({"rank_when": ({"batch_bucket": (1,)}, 10**9)}, "rank_when priority 1000000000"),
        ({"rank_when": ({"batch_bucket": (1,)}, -5)}, "rank_when priority -5"),
    ],
)
def test_a_priority_outside_every_band_is_rejected_at_registration(meta, what):
    with pytest.raises(ValueError) as info:
        registry.register_kernel("attention.decode", name="t_band", solution="test", **meta)
    assert str(info.value) == f"kernel 't_band': {what} is in no priority band; {ALLOWED}"
    assert "t_band" not in {s.name for s in registry.kernels()}


@pytest.mark.parametrize("priority", [200.5, "200", True, None])
def test_a_priority_that_is_not_an_integer_is_a_type_error(priority):
    with pytest.raises(TypeError, match=r"kernel 't_band_type': priority must be an int \(a Priority band plus"):
        registry.register_kernel("attention.decode", name="t_band_type", solution="test", priority=priority)


def test_the_edges_of_the_bands_are_accepted(temp_kernels):
    temp_kernels("attention.decode", name="t_edge_low", priority=0, rank_when=({"batch_bucket": (1,)}, 499))
    temp_kernels("attention.decode", name="t_edge_high", priority=Priority.highest())
    assert registry.get_kernel("t_edge_low").rank_rules[0][1] == 499
    assert registry.get_kernel("t_edge_high").band is Priority.PLUGIN


def test_unseen_safe_is_a_bool_shown_only_when_false(temp_kernels):
    temp_kernels("attention.prefill", name="t_safe")
    temp_kernels("attention.prefill", name="t_leaky", unseen_safe=False)
    assert registry.get_kernel("t_safe").unseen_safe and "unseen_safe" not in registry.get_kernel("t_safe").summary()
    assert "unseen_safe=no" in registry.get_kernel("t_leaky").summary()
    with pytest.raises(TypeError, match="unseen_safe must be a bool"):
        temp_kernels("attention.prefill", name="t_bad", unseen_safe="no")


def test_several_rank_rules_are_tried_in_order(temp_kernels):
    """``rank_when`` as a tuple of rules: the first that holds gives the rank; none: the
    priority; ``rank_miss`` lists every rule's misses, ``describe_rank`` joins them with ``or``."""
    rules = (({"head_dim": (128,), "batch_bucket": (1, 2)}, 480), ({"batch_bucket": (1,)}, 320))
    temp_kernels("attention.decode", name="t_rules", priority=100, rank_when=rules)
    spec = registry.get_kernel("t_rules")

    def request(head_dim, batch_bucket):
        return Request.make(
            "attention.decode", {"q": torch.bfloat16}, {"head_dim": head_dim, "batch_bucket": batch_bucket}
        )

    assert [spec.priority_for(request(d, b)) for d, b in ((128, 2), (128, 1), (64, 1), (64, 2))] == [480, 480, 320, 100]
    assert spec.rank_miss(request(128, 1)) == "" and spec.rank_miss(request(64, 1)) == ""
    assert spec.rank_miss(request(64, 2)) == (
        "not ranked plugin(480): head_dim 64 not in {128}; not ranked specialized(320): batch_bucket 2 not in {1}"
    )
    assert spec.describe_rank() == (
        "plugin(480) when batch_bucket in {1,2} and head_dim in {128} or specialized(320) when batch_bucket in {1}"
    )


def test_every_installed_backend_loads_inside_the_bands():
    """The in-tree registrations (and any installed wheel's) pass the band check: a priority
    outside every band would fail its backend's load."""
    statuses = registry.backends()
    assert [f"{b.name}: {b.error}" for b in statuses if b.state == "failed"] == []
    assert all(b.kernels for b in statuses if b.state == "loaded")


def test_request_make_is_canonical_and_hashable():
    a = Request.make("attention.decode", {"q": torch.bfloat16, "kv": torch.bfloat16}, {"head_dim": 64}, ["sinks"])
    b = Request.make("attention.decode", {"kv": torch.bfloat16, "q": torch.bfloat16}, {"head_dim": 64}, ("sinks",))
    assert a == b and hash(a) == hash(b)
    assert a.dtype("q") is torch.bfloat16 and a.shape("head_dim") == 64 and a.shape("page_size") is None
