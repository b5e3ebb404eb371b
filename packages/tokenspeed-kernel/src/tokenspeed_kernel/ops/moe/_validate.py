"""Host-side validation of the MoE operators (``moe_topk``, ``moe_apply``, ``moe_plan``,
``MoEPlan.apply``, and the expert-parallel ``moe_dispatch``, ``moe_combine``,
``moe_dispatch_plan`` with its steps), and their selector requests.

Everything here reads only metadata (shapes, dtypes, devices, layouts); the value checks
that need a device sync (expert ids, expert map entries) run only under ``config.debug()``.
The expert-parallel checks come in two parts: each rank's own (this file, raising the usual
``TypeError``/``ValueError``), which ``ops/moe/_collective.py`` turns into one verdict every
rank of the group raises; and the checks across ranks (``check_agreement``,
``check_expert_owners``), made by every rank on the same gathered facts, so every rank
decides alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tokenspeed_kernel import config
from tokenspeed_kernel.ops._checks import (
    ACT_DTYPES,
    check_choice,
    check_index_tensor,
    check_int,
    check_optional_tensor,
    check_override,
    check_same_device,
    check_tensor,
    dtype_name,
    pow2_bucket,
)
from tokenspeed_kernel.ops.moe.args import (
    ACTIVATION_QUANT_WEIGHTS,
    ACTIVATION_QUANTS,
    ACTIVATIONS,
    MoEDispatchHandle,
    Weight,
)
from tokenspeed_kernel.quant import FP8Weight, MXFP4Weight
from tokenspeed_kernel.registry import Request

__all__ = [
    "EP_DTYPES",
    "SCORINGS",
    "EPFacts",
    "WeightInfo",
    "apply_signature",
    "check_activation_quant",
    "check_agreement",
    "check_apply",
    "check_combine",
    "check_dispatch",
    "check_dispatch_agreement",
    "check_dispatch_plan",
    "check_expert_owners",
    "check_group",
    "check_handle",
    "check_handle_state",
    "check_ids_in_range",
    "check_out",
    "check_plan",
    "check_plan_apply",
    "check_plan_dispatch",
    "check_routing",
    "check_topk",
    "check_weights",
    "combine_request",
    "dispatch_request",
    "ep_dtype_code",
    "group_has_device",
]

SCORINGS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class WeightInfo:
    """Facts read from validated expert weights.

    Attributes:
        num_experts: ``E``, the experts held by the weights (local experts with a map).
        hidden: ``H``. intermediate: ``I`` (``w13`` holds ``2I`` rows).
        weight_format: ``"plain"``, ``"mxfp4"``, ``"fp8_per_tensor"``, ``"fp8_per_channel"``
            or ``"fp8_block"``.
        storage_dtype: the dtype the weight values are stored in (uint8 for mxfp4).
        num_global_experts: ``len(expert_map)`` with a map, else ``num_experts``.
    """

    num_experts: int
    hidden: int
    intermediate: int
    weight_format: str
    storage_dtype: torch.dtype
    num_global_experts: int

    def features(self, activation: str, has_bias: bool, has_map: bool, activation_quant: str | None = None) -> set[str]:
        """The request features of a call with these weights."""
        feats = {activation}
        if activation_quant is not None:
            feats.add(ACTIVATION_QUANTS[activation_quant])
        if has_bias:
            feats.add("bias")
        if has_map:
            feats.add("expert_map")
        if self.weight_format != "plain":
            feats.add(self.weight_format)
        return feats


def _weight_format(name: str, w: object, x_dtype: torch.dtype) -> tuple[str, torch.dtype, torch.device]:
    if isinstance(w, MXFP4Weight):
        check_tensor(f"{name}.packed", w.packed, ndim=3)
        check_tensor(f"{name}.scales", w.scales, ndim=3)
        if w.scales.device != w.packed.device:
            raise ValueError(f"{name}.scales is on {w.scales.device} but {name}.packed is on {w.packed.device}")
        return "mxfp4", torch.uint8, w.packed.device
    if isinstance(w, FP8Weight):
        check_tensor(f"{name}.data", w.data, ndim=3)
        check_tensor(f"{name}.scale", w.scale, ndim=3)
        if w.scale.device != w.data.device:
            raise ValueError(f"{name}.scale is on {w.scale.device} but {name}.data is on {w.data.device}")
        return w.format, torch.float8_e4m3fn, w.data.device
    if isinstance(w, torch.Tensor):
        check_tensor(name, w, ndim=3)
        if w.dtype != x_dtype:
            raise TypeError(
                f"{name} must be in x's dtype ({dtype_name(x_dtype)}) or an MXFP4Weight/FP8Weight, "
                f"got {dtype_name(w.dtype)}"
            )
        return "plain", w.dtype, w.device
    raise TypeError(f"{name} must be a torch.Tensor, MXFP4Weight or FP8Weight, got {type(w).__name__}")


def check_weights(
    w13: Weight,
    w2: Weight,
    *,
    x_dtype: torch.dtype,
    device: torch.device | None,
    activation: str,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    expert_map: torch.Tensor | None,
) -> WeightInfo:
    """Validate expert weights, biases, map and activation; ``device`` None = w13's device."""
    if x_dtype not in ACT_DTYPES:
        raise TypeError(f"x must have dtype in {{bfloat16, float16, float32}}, got {dtype_name(x_dtype)}")
    check_choice("activation", activation, ACTIVATIONS)
    fmt13, storage, dev13 = _weight_format("w13", w13, x_dtype)
    fmt2, _, dev2 = _weight_format("w2", w2, x_dtype)
    if fmt13 != fmt2:
        raise TypeError(f"w13 and w2 must have the same weight format, got {fmt13} and {fmt2}")
    device = dev13 if device is None else device
    if dev13 != device:
        raise ValueError(f"w13 is on {dev13} but x is on {device}")
    if dev2 != device:
        raise ValueError(f"w2 is on {dev2} but x is on {device}")
    e, two_i, h = w13.shape
    if e < 1 or two_i < 2 or two_i % 2 or h < 1:
        raise ValueError(f"w13 must have shape [E, 2I, H] with E >= 1, I >= 1, H >= 1, got {list(w13.shape)}")
    i = two_i // 2
    if tuple(w2.shape) != (e, h, i):
        raise ValueError(
            f"w2 must have shape [E, H, I] = [{e}, {h}, {i}] (from w13 {list(w13.shape)}), got {list(w2.shape)}"
        )
    bias_dtypes = tuple(dict.fromkeys((x_dtype, torch.float32)))
    check_optional_tensor("w13_bias", w13_bias, ndim=2, dtypes=bias_dtypes, shape=(e, two_i))
    check_optional_tensor("w2_bias", w2_bias, ndim=2, dtypes=bias_dtypes, shape=(e, h))
    num_global = e
    if expert_map is not None:
        check_index_tensor("expert_map", expert_map, ndim=1, dtype=torch.int32)
        if expert_map.numel() < 1:
            raise ValueError("expert_map must hold at least one expert, got an empty tensor")
        num_global = expert_map.numel()
    for name, t in (("w13_bias", w13_bias), ("w2_bias", w2_bias), ("expert_map", expert_map)):
        if t is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device} but x is on {device}")
    return WeightInfo(e, h, i, fmt13, storage, num_global)


def check_activation_quant(activation_quant: object, info: WeightInfo) -> str | None:
    """``activation_quant`` is None or one of :data:`ACTIVATION_QUANTS`: ``"mxfp8"`` only with
    MXFP4 weights (whose K dims are multiples of 32, the MX block), ``"fp8"`` only with FP8
    weights (:data:`ACTIVATION_QUANT_WEIGHTS`)."""
    if activation_quant is None:
        return None
    if not isinstance(activation_quant, str):
        raise TypeError(f"activation_quant must be a str or None, got {type(activation_quant).__name__}")
    check_choice("activation_quant", activation_quant, tuple(ACTIVATION_QUANTS))
    if info.weight_format not in ACTIVATION_QUANT_WEIGHTS[activation_quant]:
        needs = (
            "MXFP4 weights (MXFP4Weight w13/w2)" if activation_quant == "mxfp8" else "FP8 weights (FP8Weight w13/w2)"
        )
        raise ValueError(f"activation_quant={activation_quant!r} needs {needs}, got {info.weight_format} weights")
    return activation_quant


def check_routing(
    x: object,
    topk_weights: object,
    topk_ids: object,
    *,
    hidden: int,
    num_global_experts: int,
    top_k: int | None = None,
) -> tuple[int, int]:
    """Validate ``x [T, H]`` and the routing tensors; returns ``(T, top_k)``."""
    x = check_tensor("x", x, ndim=2, dtypes=ACT_DTYPES)
    if x.shape[1] != hidden:
        raise ValueError(f"x must have shape [T, H] with H = {hidden} (the weights' hidden size), got {list(x.shape)}")
    t = x.shape[0]
    topk_weights = check_tensor("topk_weights", topk_weights, ndim=2, dtypes=(torch.float32,))
    topk_ids = check_index_tensor("topk_ids", topk_ids, ndim=2, dtype=torch.int32)
    k = topk_ids.shape[1]
    if top_k is not None and k != top_k:
        raise ValueError(
            f"topk_ids must have shape [T, top_k] = [{t}, {top_k}] (the plan's top_k), got {list(topk_ids.shape)}"
        )
    if topk_ids.shape[0] != t or not 1 <= k <= num_global_experts:
        raise ValueError(
            f"topk_ids must have shape [T, k] with T = {t} and 1 <= k <= {num_global_experts}, got {list(topk_ids.shape)}"
        )
    if tuple(topk_weights.shape) != (t, k):
        raise ValueError(f"topk_weights must have shape [{t}, {k}] like topk_ids, got {list(topk_weights.shape)}")
    check_same_device("x", x, topk_weights=topk_weights, topk_ids=topk_ids)
    return t, k


def check_out(out: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """``out`` (or a new tensor) of x's shape, dtype and device, not overlapping ``x``."""
    if out is None:
        return torch.empty_like(x)
    check_tensor("out", out, ndim=2, dtypes=(x.dtype,), shape=tuple(x.shape))
    check_same_device("x", x, out=out)
    if out.numel() and out.data_ptr() == x.data_ptr():
        raise ValueError("out must not alias x")
    return out


def check_ids_in_range(
    topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_experts: int, num_global_experts: int
) -> None:
    """Debug-mode value checks (device sync): ids in ``[0, E_global)``, map entries in ``[-1, E)``."""
    if topk_ids.numel():
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < 0 or hi >= num_global_experts:
            what = "len(expert_map)" if expert_map is not None else "E"
            raise ValueError(f"topk_ids must lie in [0, {what} = {num_global_experts}), got values in [{lo}, {hi}]")
    if expert_map is not None:
        lo, hi = int(expert_map.min()), int(expert_map.max())
        if lo < -1 or hi >= num_experts:
            raise ValueError(f"expert_map values must lie in [-1, E = {num_experts}), got values in [{lo}, {hi}]")


def check_apply(
    x: object,
    w13: Weight,
    w2: Weight,
    topk_weights: object,
    topk_ids: object,
    activation: str,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    expert_map: torch.Tensor | None,
    out: torch.Tensor | None,
    override: object,
    activation_quant: object,
) -> tuple[WeightInfo, int, str | None]:
    """Every host check of ``moe_apply``, in order; the weights' facts, ``top_k`` and the
    validated ``activation_quant``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    info = check_weights(
        w13,
        w2,
        x_dtype=x.dtype,
        device=x.device,
        activation=activation,
        w13_bias=w13_bias,
        w2_bias=w2_bias,
        expert_map=expert_map,
    )
    _, top_k = check_routing(x, topk_weights, topk_ids, hidden=info.hidden, num_global_experts=info.num_global_experts)
    activation_quant = check_activation_quant(activation_quant, info)
    if out is not None:
        check_out(out, x)
    check_override(override)
    return info, top_k, activation_quant


def check_plan(
    w13: Weight,
    w2: Weight,
    *,
    x_dtype: object,
    top_k: object,
    activation: str,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    expert_map: torch.Tensor | None,
    override: object,
    activation_quant: object,
) -> tuple[WeightInfo, str | None]:
    """Every check of ``moe_plan``, in order (the map's values under ``TOKENSPEED_KERNEL_DEBUG``);
    the weights' facts and the validated ``activation_quant``."""
    if not isinstance(x_dtype, torch.dtype):
        raise TypeError(f"x_dtype must be a torch.dtype, got {type(x_dtype).__name__}")
    info = check_weights(
        w13,
        w2,
        x_dtype=x_dtype,
        device=None,
        activation=activation,
        w13_bias=w13_bias,
        w2_bias=w2_bias,
        expert_map=expert_map,
    )
    activation_quant = check_activation_quant(activation_quant, info)
    top_k = check_int("top_k", top_k, min_value=1)
    if top_k > info.num_global_experts:
        raise ValueError(f"top_k must be <= the number of (global) experts {info.num_global_experts}, got {top_k}")
    check_override(override)
    if config.debug() and expert_map is not None:
        check_ids_in_range(expert_map.new_zeros((0,)), expert_map, info.num_experts, info.num_global_experts)
    return info, activation_quant


def check_plan_apply(
    x: object,
    topk_weights: object,
    topk_ids: object,
    out: object,
    *,
    info: WeightInfo,
    top_k: int,
    x_dtype: torch.dtype,
    device: torch.device,
) -> int:
    """Every host check of ``MoEPlan.apply`` against its plan's facts, in order; the token count."""
    num_tokens, _ = check_routing(
        x, topk_weights, topk_ids, hidden=info.hidden, num_global_experts=info.num_global_experts, top_k=top_k
    )
    assert isinstance(x, torch.Tensor)
    if x.dtype != x_dtype:
        raise TypeError(f"x must have the plan's dtype {dtype_name(x_dtype)}, got {dtype_name(x.dtype)}")
    if x.device != device:
        raise ValueError(f"x is on {x.device} but the plan's weights are on {device}")
    if out is not None:
        check_out(out, x)  # type: ignore[arg-type]
    return num_tokens


def apply_signature(
    info: WeightInfo,
    num_tokens: int,
    top_k: int,
    x_dtype: torch.dtype,
    activation: str,
    has_bias: bool,
    has_map: bool,
    activation_quant: str | None = None,
) -> dict[str, object]:
    """The capture signature of one ``moe.apply`` call (``MoECase`` field names;
    ``activation_quant`` only when set)."""
    signature: dict[str, object] = {
        "num_tokens": num_tokens,
        "hidden": info.hidden,
        "intermediate": info.intermediate,
        "num_experts": info.num_global_experts,
        "num_local_experts": info.num_experts,
        "top_k": top_k,
        "dtype": dtype_name(x_dtype),
        "weight_format": info.weight_format,
        "activation": activation,
        "bias": has_bias,
        "expert_map": has_map,
    }
    if activation_quant is not None:
        signature["activation_quant"] = activation_quant
    return signature


def apply_request(
    info: WeightInfo,
    *,
    x_dtype: torch.dtype,
    top_k: int,
    num_tokens: int | None,
    activation: str,
    has_bias: bool,
    has_map: bool,
    activation_quant: str | None = None,
) -> Request:
    """The selector request of a ``moe.apply`` call (``num_tokens=None``: a plan, no token bucket)."""
    shapes = {
        "num_experts": info.num_experts,
        "top_k": top_k,
        "hidden": info.hidden,
        "intermediate": info.intermediate,
    }
    if num_tokens is not None:
        shapes["num_tokens_bucket"] = pow2_bucket(num_tokens)
    return Request.make(
        "moe.apply",
        dtypes={"x": x_dtype, "weight": info.storage_dtype},
        shapes=shapes,
        features=info.features(activation, has_bias, has_map, activation_quant),
    )


def topk_request(
    *, logits_dtype: torch.dtype, num_experts: int, top_k: int, scoring: str, renormalize: bool
) -> Request:
    """The selector request of a ``moe.topk`` call."""
    return Request.make(
        "moe.topk",
        dtypes={"logits": logits_dtype},
        shapes={"num_experts": num_experts, "top_k": top_k},
        features=(scoring, "renormalize") if renormalize else (scoring,),
    )


def check_topk(router_logits: object, top_k: object, scoring: object, renormalize: object, override: object) -> None:
    """Every host check of ``moe_topk``, in order."""
    router_logits = check_tensor("router_logits", router_logits, ndim=2, dtypes=ACT_DTYPES)
    num_experts = router_logits.shape[1]
    if num_experts < 1:
        raise ValueError(f"router_logits must have at least one expert column, got shape {list(router_logits.shape)}")
    top_k = check_int("top_k", top_k, min_value=1)
    if top_k > num_experts:
        raise ValueError(f"top_k must be <= the number of experts E = {num_experts}, got {top_k}")
    check_choice("scoring", scoring, SCORINGS)
    if not isinstance(renormalize, bool):
        raise TypeError(f"renormalize must be a bool, got {type(renormalize).__name__}")
    check_override(override)


# --- expert parallelism: moe_dispatch / moe_combine / moe_dispatch_plan -----------------------

# The activation dtypes of the exchange, numbered for the facts ranks compare (0: unknown).
EP_DTYPES: tuple[torch.dtype, ...] = ACT_DTYPES


@dataclass(frozen=True)
class EPFacts:
    """What one rank's checks of a dispatch (or a dispatch plan) read, as the ranks compare them.

    Attributes:
        num_tokens: T (a plan: its capacity C, the most tokens of any step).
        hidden: H. top_k: k. num_experts: E, ``len(expert_map)``.
        dtype: the activation dtype's index in :data:`EP_DTYPES` + 1 (0 when unknown).
    """

    num_tokens: int = 0
    hidden: int = 0
    top_k: int = 0
    num_experts: int = 0
    dtype: int = 0

    def values(self) -> tuple[int, ...]:
        return (self.num_tokens, self.hidden, self.top_k, self.num_experts, self.dtype)


def ep_dtype_code(dtype: torch.dtype) -> int:
    """``dtype``'s number in :data:`EP_DTYPES` (1-based; 0 for any other dtype)."""
    return EP_DTYPES.index(dtype) + 1 if dtype in EP_DTYPES else 0


def check_group(group: object) -> tuple[int, int]:
    """``group`` must be a ``torch.distributed.ProcessGroup`` this process belongs to; returns
    ``(rank, world_size)``. Raised on this rank alone: without a group no other rank can be told."""
    if not dist.is_available():
        raise RuntimeError("expert parallelism needs torch.distributed, which this torch build lacks")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group must be a torch.distributed.ProcessGroup this rank belongs to, got {type(group).__name__}"
        )
    return group.rank(), group.size()


def group_has_device(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether ``group`` has a backend for ``device``'s type (True when the group cannot say)."""
    types = getattr(group, "_device_types", None)  # torch >= 2.2; a private attribute
    return types is None or device.type in {d.type for d in types}


def _check_group_device(group: dist.ProcessGroup, name: str, device: torch.device) -> None:
    if not group_has_device(group, device):
        raise ValueError(
            f"{name} is on {device} but the process group {group.name()!r} has no backend for {device.type}"
        )


def check_dispatch(
    x: object, topk_ids: object, topk_weights: object, group: dist.ProcessGroup, expert_map: object, override: object
) -> EPFacts:
    """This rank's host checks of ``moe_dispatch``, in order (the group's were made first)."""
    x = check_tensor("x", x, ndim=2, dtypes=ACT_DTYPES)
    expert_map = check_index_tensor("expert_map", expert_map, ndim=1, dtype=torch.int32)
    num_experts = expert_map.numel()
    if num_experts < 1:
        raise ValueError("expert_map must hold at least one expert, got an empty tensor")
    if x.shape[1] < 1:
        raise ValueError(f"x must have shape [T, H] with H >= 1, got {list(x.shape)}")
    num_tokens, top_k = check_routing(x, topk_weights, topk_ids, hidden=x.shape[1], num_global_experts=num_experts)
    check_same_device("x", x, expert_map=expert_map)
    _check_group_device(group, "x", x.device)
    check_override(override)
    return EPFacts(num_tokens, x.shape[1], top_k, num_experts, ep_dtype_code(x.dtype))


def check_dispatch_plan(
    group: dist.ProcessGroup,
    expert_map: object,
    *,
    max_tokens: object,
    hidden: object,
    top_k: object,
    x_dtype: object,
    capturable: object,
    override: object,
) -> EPFacts:
    """This rank's host checks of ``moe_dispatch_plan``, in order (the group's were made first)."""
    expert_map = check_index_tensor("expert_map", expert_map, ndim=1, dtype=torch.int32)
    num_experts = expert_map.numel()
    if num_experts < 1:
        raise ValueError("expert_map must hold at least one expert, got an empty tensor")
    _check_group_device(group, "expert_map", expert_map.device)
    capacity = check_int("max_tokens", max_tokens, min_value=1)
    hidden = check_int("hidden", hidden, min_value=1)
    top_k = check_int("top_k", top_k, min_value=1)
    if top_k > num_experts:
        raise ValueError(f"top_k must be <= len(expert_map) = {num_experts}, got {top_k}")
    if not isinstance(x_dtype, torch.dtype):
        raise TypeError(f"x_dtype must be a torch.dtype, got {type(x_dtype).__name__}")
    if x_dtype not in ACT_DTYPES:
        raise TypeError(f"x_dtype must be one of {{bfloat16, float16, float32}}, got {dtype_name(x_dtype)}")
    if not isinstance(capturable, bool):
        raise TypeError(f"capturable must be a bool, got {type(capturable).__name__}")
    check_override(override)
    return EPFacts(capacity, hidden, top_k, num_experts, ep_dtype_code(x_dtype))


def check_plan_dispatch(
    x: object,
    topk_ids: object,
    topk_weights: object,
    *,
    facts: EPFacts,
    x_dtype: torch.dtype,
    device: torch.device,
) -> int:
    """Every host check of a plan's ``dispatch`` against the plan, in order; the token count."""
    x = check_tensor("x", x, ndim=2, dtypes=ACT_DTYPES)
    if x.dtype != x_dtype:
        raise TypeError(f"x must have the plan's dtype {dtype_name(x_dtype)}, got {dtype_name(x.dtype)}")
    if x.device != device:
        raise ValueError(f"x is on {x.device} but the plan's expert_map is on {device}")
    num_tokens, _ = check_routing(
        x,
        topk_weights,
        topk_ids,
        hidden=facts.hidden,
        num_global_experts=facts.num_experts,
        top_k=facts.top_k,
    )
    if num_tokens > facts.num_tokens:
        raise ValueError(
            f"x has {num_tokens} tokens, more than the plan's max_tokens = {facts.num_tokens} (its capacity per rank)"
        )
    return num_tokens


def check_handle(handle: object) -> MoEDispatchHandle:
    """``handle`` must be the handle of a dispatch."""
    if not isinstance(handle, MoEDispatchHandle):
        raise TypeError(f"handle must be the MoEDispatchHandle of a dispatch, got {type(handle).__name__}")
    return handle


def check_combine(y: object, handle: object, override: object) -> MoEDispatchHandle:
    """This rank's host checks of ``moe_combine``, in order (the handle's state is checked per
    call by :func:`check_handle_state`)."""
    handle = check_handle(handle)
    y = check_tensor("y", y, ndim=2, dtypes=(handle.dtype,), shape=(handle.num_rows, handle.hidden))
    if y.device != handle.device:
        raise ValueError(f"y is on {y.device} but the dispatch's x was on {handle.device}")
    check_override(override)
    return handle


def check_handle_state(handle: MoEDispatchHandle, *, plan: int = 0, step: int | None = None) -> None:
    """A handle serves one combine, of the dispatch that made it: not combined yet, from this
    plan (``plan``: its id; 0 for ``moe_combine``) and, for a plan, of its latest step ``step``
    (a later dispatch has overwritten the plan's receive buffers)."""
    if handle.combined:
        raise ValueError(
            f"handle was combined already (dispatch step {handle.step}): each dispatch's handle serves one combine"
        )
    if handle.plan != plan:
        made = f"plan {handle.plan}'s dispatch" if handle.plan else "moe_dispatch"
        wanted = f"plan {plan}'s combine" if plan else "moe_combine"
        raise ValueError(f"handle was made by {made}; {wanted} takes only its own dispatches' handles")
    if step is not None and handle.step != step:
        raise ValueError(
            f"handle is from the plan's dispatch step {handle.step}, but the plan has dispatched step {step} since "
            "and its receive buffers now hold that step: combine each step's handle before the next dispatch"
        )


# The facts the ranks of a dispatch must share, by position in EPFacts.values(), with what each is.
_DTYPE_FACT = "the activation dtype"
_SHARED_DISPATCH_FACTS = (
    (1, "the hidden size H (x.shape[1] / hidden)"),
    (2, "top_k (topk_ids.shape[1])"),
    (3, "the number of global experts E (len(expert_map))"),
    (4, _DTYPE_FACT),
)


def _shown_fact(name: str, value: int) -> str:
    """A gathered fact as the error shows it (the dtype by name)."""
    if name == _DTYPE_FACT:
        return dtype_name(EP_DTYPES[value - 1]) if 0 < value <= len(EP_DTYPES) else "unknown"
    return str(value)


def check_agreement(what: str, rows: Sequence[Sequence[int]], shared: Sequence[tuple[int, str]]) -> None:
    """Every rank's facts (``rows[r]``, gathered) must agree at each position of ``shared``;
    ``ValueError`` naming the fact and every rank's value otherwise. Every rank calls it on
    the same rows, so every rank raises alike."""
    for index, name in shared:
        values = [row[index] for row in rows]
        if len(set(values)) > 1:
            listed = ", ".join(f"rank {r}: {_shown_fact(name, v)}" for r, v in enumerate(values))
            raise ValueError(f"{what}: {name} must be the same on every rank of the group, got {listed}")


def check_dispatch_agreement(what: str, rows: Sequence[Sequence[int]], *, plan: bool) -> None:
    """The facts every rank of a dispatch (a plan: also its capacity) must share."""
    shared = ((0, "max_tokens (the capacity per rank)"), *_SHARED_DISPATCH_FACTS) if plan else _SHARED_DISPATCH_FACTS
    check_agreement(what, rows, shared)


def _ids(ids: Sequence[int], limit: int = 8) -> str:
    shown = ", ".join(map(str, ids[:limit]))
    return f"[{shown}{', ...' if len(ids) > limit else ''}] ({len(ids)})"


def check_expert_owners(maps: Sequence[Sequence[int]]) -> list[int]:
    """The gathered expert maps (``maps[r]`` is rank r's ``expert_map``, global -> local id, -1
    = elsewhere) must give every global expert to exactly one rank; returns the rank holding
    each expert. ``ValueError`` naming ``expert_map`` otherwise (every rank gets the same maps
    and raises alike): experts held by no rank (the maps do not cover E), experts held twice,
    values below -1; with the experts each rank holds, which shows maps made for another
    world size."""
    world, num_experts = len(maps), len(maps[0])
    bad = sorted({r for r, row in enumerate(maps) if min(row) < -1})
    if bad:
        raise ValueError(f"expert_map values must be >= -1 (-1: held by another rank), got lower ones on ranks {bad}")
    holders = [[r for r in range(world) if maps[r][e] >= 0] for e in range(num_experts)]
    orphans = [e for e, held in enumerate(holders) if not held]
    twice = [e for e, held in enumerate(holders) if len(held) > 1]
    if orphans or twice:
        counts = [sum(v >= 0 for v in row) for row in maps]
        problems = []
        if orphans:
            problems.append(f"experts {_ids(orphans)} are held by no rank (the maps do not cover E = {num_experts})")
        if twice:
            problems.append(
                f"experts {_ids(twice)} are held by more than one rank (expert {twice[0]}: ranks {holders[twice[0]]})"
            )
        raise ValueError(
            "expert_map must give each global expert to exactly one rank of the group: "
            + "; ".join(problems)
            + f". The {world} ranks hold {counts} experts of E = {num_experts}"
            + (" (maps made for another world size?)" if sum(counts) != num_experts else "")
        )
    return [held[0] for held in holders]


def dispatch_request(facts: EPFacts, world_size: int, dtype: torch.dtype, *, capturable: bool = False) -> Request:
    """The selector request of a dispatch (``moe_dispatch``, or a plan's, ``capturable`` when asked)."""
    shapes = {"world_size": world_size, "num_experts": facts.num_experts, "top_k": facts.top_k, "hidden": facts.hidden}
    return Request.make("moe.dispatch", dtypes={"x": dtype}, shapes=shapes, capturable=capturable)


def combine_request(world_size: int, hidden: int, dtype: torch.dtype, *, capturable: bool = False) -> Request:
    """The selector request of a combine."""
    shapes = {"world_size": world_size, "hidden": hidden}
    return Request.make("moe.combine", dtypes={"x": dtype}, shapes=shapes, capturable=capturable)
