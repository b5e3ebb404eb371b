"""The kernel registry: every implementation with its metadata, as data.

A kernel author writes::

    from tokenspeed_kernel.registry import register_kernel, Priority

    @register_kernel(
        "attention.decode",
        name="my_decode",
        solution="my_dsl",
        vendors=("cuda", "rocm"),
        capabilities=("bf16",),
        dtypes={"q": (torch.bfloat16, torch.float16), "kv": (torch.bfloat16, torch.float16)},
        shapes={"head_dim": (64, 128)},
        features=("sinks", "sliding_window"),
        priority=Priority.PORTABLE,
    )
    def my_decode(args: DecodeArgs) -> None: ...

Optional hooks ride along with the metadata: ``prepare`` (weights, called once by
``moe_plan``), ``prepare_layout`` (batch layout, called by ``mha_decode_plan`` and
``DecodePlan.update`` outside CUDA-graph capture), ``bind`` (called once by
``mha_decode_plan`` and per token count by ``MoEPlan``: returns the runner that serves the
plan's runs, its launch work done and the plan's tensors bound) and ``step_runner`` (called
once per step plan: the runner of the step's layout, every tensor passed per run).
``graph_safe=False`` declares that the kernel cannot be captured in a CUDA graph (it reads
device values on the host, or plans per call): the selector then refuses it for a ``capturable`` request, and a call made while
the stream is capturing raises ``RuntimeError`` before launching it. ``unseen_safe=False``
(attention) declares that a NaN/inf in a key or value a query cannot see (outside its window,
causally later, another sequence's, a stale cache slot) may still reach it, against the
contract (docs/api.md); it changes no selection, ``list`` shows it, and the edge-input tests
report such a kernel's leak instead of failing it.

``vendor_capabilities={"cpu": ("triton_interpreter",)}`` adds capabilities required on one
vendor's platforms only: a GPU kernel that also runs on CPU tensors under an interpreter lists
the CPU among its vendors and needs the interpreter there (a capability the CPU platform
reports while it is on), nothing more on a GPU.

``rank_when=({"batch_bucket": (1, 2, 4, 8)}, Priority.PERFORMANT)`` ranks a kernel at another
priority for the requests whose shapes all fall in the given sets (a kernel measured fastest
at small batches only, still reachable by override everywhere else); it never rejects. A
``None`` in a set accepts a request without that key: ``{"window_left": (None,)}`` means
unwindowed calls only. Several rules, a tuple of such pairs, are tried in order and the first
that holds gives the rank (a kernel measured faster from 2048 queries at head dim 64 but from
512 at head dim 128).

The decorated function is returned unchanged. It receives the operator's typed argument
object (see ``tokenspeed_kernel.ops.<family>``) and writes its outputs into it.

Backends (vendor wheels and out-of-tree plugins) are Python entry points in the group
``tokenspeed_kernel.backends``. Each names a module (imported) or a function (called) that
registers kernels. They are loaded lazily on the first selection, once; one that fails to
load is recorded with its error, its partial registrations are withdrawn, and the others
carry on. ``TOKENSPEED_KERNEL_DISABLE_BACKENDS`` skips backends by entry-point name.
"""

from __future__ import annotations

import contextlib
import enum
import importlib
import logging
import operator
import threading
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import torch

from tokenspeed_kernel import config
from tokenspeed_kernel.operators import OPERATORS, operator_schema

__all__ = [
    "ENTRY_POINT_GROUP",
    "HOOKS",
    "BackendStatus",
    "KernelSpec",
    "Priority",
    "Request",
    "backends",
    "backends_loaded",
    "get_kernel",
    "isolated",
    "kernels",
    "load_backend",
    "load_backends",
    "register_kernel",
    "unload_backend",
    "unregister_kernel",
]

log = logging.getLogger("tokenspeed_kernel")

ENTRY_POINT_GROUP = "tokenspeed_kernel.backends"
BUILTIN_BACKEND = "reference"
_BUILTIN_MODULE = "tokenspeed_kernel.reference"


_TOP_BAND_WIDTH = 100  # the top band (plugin) spans [400, 500), as wide as the bands below it


class Priority(enum.IntEnum):
    """Named priority bands, lowest first. Add an offset to rank within a band
    (``Priority.PERFORMANT + 10``); the band is the largest one not above the value.

    A registered priority (and a ``rank_when`` priority) must lie in a band's range,
    :meth:`ranges`: from the band up to the next band, exclusive (``portable``: 100 to 199),
    and ``plugin`` from 400 to 499; anything else is a ``ValueError`` at registration.
    """

    REFERENCE = 0
    # Built and tested off the device but not yet shown correct and faster on a GPU: chosen
    # only by an override or where no portable kernel serves the request.
    OPT_IN = 50
    PORTABLE = 100
    PERFORMANT = 200
    SPECIALIZED = 300
    PLUGIN = 400

    @classmethod
    def band(cls, value: int) -> Priority:
        return max((b for b in cls if b <= value), default=cls.REFERENCE)

    @classmethod
    def ranges(cls) -> dict[Priority, range]:
        """The priorities each band admits at registration: ``[band, next band)``, the top
        band as wide as the one below it (``plugin``: ``range(400, 500)``)."""
        bands = sorted(cls)
        ends = [*bands[1:], bands[-1] + _TOP_BAND_WIDTH]
        return {band: range(band, end) for band, end in zip(bands, ends)}

    @classmethod
    def highest(cls) -> int:
        """The highest priority a kernel may register (the top of the ``plugin`` band)."""
        return max(cls) + _TOP_BAND_WIDTH - 1


@dataclass(frozen=True)
class Request:
    """What a call needs from a kernel; hashable, so selections are cached per request.

    Attributes:
        op: operator name, e.g. ``"attention.decode"``.
        dtypes: ``((role, dtype), ...)`` sorted by role, e.g. ``(("kv", bf16), ("q", bf16))``.
        shapes: ``((key, value), ...)`` sorted by key; small bounded integers only.
        features: optional behaviours the call needs, e.g. ``{"sinks", "sliding_window"}``.
        capturable: the call will be captured in a CUDA graph, so only ``graph_safe``
            kernels may serve it.
    """

    op: str
    dtypes: tuple[tuple[str, torch.dtype], ...] = ()
    shapes: tuple[tuple[str, int], ...] = ()
    features: frozenset[str] = frozenset()
    capturable: bool = False

    @classmethod
    def make(
        cls,
        op: str,
        dtypes: Mapping[str, torch.dtype] | None = None,
        shapes: Mapping[str, int] | None = None,
        features: Iterable[str] = (),
        capturable: bool = False,
    ) -> Request:
        return cls(
            op,
            tuple(sorted((dtypes or {}).items())),
            tuple(sorted((shapes or {}).items())),
            frozenset(features),
            capturable,
        )

    def dtype(self, role: str) -> torch.dtype | None:
        return next((d for r, d in self.dtypes if r == role), None)

    def shape(self, key: str) -> int | None:
        return next((v for k, v in self.shapes if k == key), None)

    def describe(self) -> str:
        dts = " ".join(f"{r}={str(d).removeprefix('torch.')}" for r, d in self.dtypes)
        shp = " ".join(f"{k}={v}" for k, v in self.shapes)
        feats = ",".join(sorted(self.features)) or "-"
        return f"{self.op} [{dts}] [{shp}] features={feats}" + (" capturable" if self.capturable else "")


Predicate = Callable[[Request], "str | None"]
Availability = Callable[[], "str | None"]
# One ranking rule: ``(shapes, priority)`` (the module docstring's ``rank_when``).
RankWhen = tuple[Mapping[str, Iterable["int | None"]], int]


# The optional hooks a kernel may register (``KernelSpec``'s docstring says who calls each).
HOOKS = ("prepare", "prepare_layout", "bind", "step_runner")


@dataclass(frozen=True)
class KernelSpec:
    """One registered implementation and everything the selector needs to know about it.

    ``vendors``/``archs``/``capabilities`` gate by platform, and ``vendor_capabilities``
    (``(vendor, tags)`` pairs) adds the capabilities required on one vendor's platforms only
    (:meth:`capabilities_on`); ``dtypes`` maps a dtype role to
    the dtypes accepted (a role left out accepts any); ``shapes`` maps a shape key to the
    accepted values (a key left out accepts any); ``features`` lists the optional behaviours
    the kernel supports; ``predicate(request)`` returns a reason string to reject what the
    metadata cannot express; ``available()`` returns a reason when something the kernel
    needs at run time is missing (a library, a device). ``prepare`` (optional) is the weight
    plan hook: ``prepare(plan_inputs) -> prepared`` for kernels that repack weights once
    (``moe_plan``). ``prepare_layout`` (optional, operators whose schema has
    ``layout_hook``) is the batch-layout plan hook: ``prepare_layout(args) -> None``, called
    with the operator's typed arguments outside CUDA-graph capture whenever the layout
    tensors changed (``mha_decode_plan``, ``DecodePlan.update``). ``bind`` (optional,
    operators whose schema ``binds``) is the run binder: ``bind(args) -> run``; ``run(args)``
    then serves the plan's later calls in place of ``fn``, with the launch work that depends
    only on the plan (grid, launch configuration, workspaces, the compiled kernel) done once.
    ``DecodePlan`` binds once per layout, with the arguments ``prepare_layout`` gets (its caches,
    tables and sinks bound; q, out and lse per run); ``MoEPlan`` binds once per token count,
    on the first eager ``apply`` with that count outside CUDA-graph capture, and a MoE
    ``bind`` may return None to leave that count to ``fn`` (see
    :mod:`tokenspeed_kernel.ops.moe.plan`). ``step_runner`` (optional, operators whose schema
    ``step_runs``) is the step plans' hook: ``step_runner(args) -> run``, the runner of
    ``args``' layout; ``run(args')`` serves any call whose arguments differ from ``args`` only
    in the per-layer tensors, out and lse (their addresses, never their layout): every tensor
    is passed per run, nothing is bound. ``PrefillPlan``, ``ExtendPlan`` and
    ``DecodeStepPlan`` ask for it once, on their first run outside CUDA-graph capture.
    ``graph_safe`` says whether a call can be captured
    in a CUDA graph: False for kernels that read device values on the host or plan per call.
    ``rank_rules``: ``(shapes, priority)`` pairs tried in order: for a request whose shapes are
    all in a rule's sets (``None`` in a set: the key may be absent), the kernel ranks at that
    rule's ``priority`` instead of its own (:meth:`priority_for`); ranking only, never a
    rejection.
    """

    op: str
    name: str
    fn: Callable[..., Any]
    solution: str
    backend: str
    vendors: frozenset[str]
    archs: frozenset[str] | None
    capabilities: frozenset[str]
    dtypes: tuple[tuple[str, frozenset[torch.dtype]], ...]
    shapes: tuple[tuple[str, frozenset[int]], ...]
    features: frozenset[str]
    priority: int
    predicate: Predicate | None = None
    available: Availability | None = None
    prepare: Callable[..., Any] | None = None
    prepare_layout: Callable[[Any], None] | None = None
    bind: Callable[[Any], Callable[[Any], None]] | None = None
    step_runner: Callable[[Any], Callable[[Any], None]] | None = None
    graph_safe: bool = True
    unseen_safe: bool = True
    description: str = ""
    rank_rules: tuple[tuple[tuple[tuple[str, frozenset[int | None]], ...], int], ...] = ()
    vendor_capabilities: tuple[tuple[str, frozenset[str]], ...] = ()

    def hooks(self) -> tuple[str, ...]:
        """The names of the optional hooks this kernel registers, in :data:`HOOKS` order."""
        return tuple(name for name in HOOKS if getattr(self, name) is not None)

    def capabilities_on(self, vendor: str) -> frozenset[str]:
        """The capabilities a platform of ``vendor`` must report for this kernel:
        ``capabilities`` plus that vendor's ``vendor_capabilities``."""
        for name, tags in self.vendor_capabilities:
            if name == vendor:
                return self.capabilities | tags
        return self.capabilities

    @property
    def band(self) -> Priority:
        return Priority.band(self.priority)

    def priority_for(self, request: Request) -> int:
        """The priority this kernel ranks at for ``request``: the first ``rank_rules`` priority
        whose every shape key has an accepted value in the request (``None``: absent), else
        ``priority``."""
        for shapes, priority in self.rank_rules:
            if all(request.shape(k) in values for k, values in shapes):
                return priority
        return self.priority

    def rank_key(self, request: Request | None = None) -> tuple[int, str]:
        """Sort key: highest priority first (for ``request`` when given), then name
        (deterministic tie-break)."""
        return (-(self.priority if request is None else self.priority_for(request)), self.name)

    def summary(self) -> str:
        vendors = ",".join(sorted(self.vendors))
        archs = ",".join(sorted(self.archs)) if self.archs else "any"
        caps = ",".join(sorted(self.capabilities)) or "-"
        caps += "".join(f" caps_on_{vendor}={','.join(sorted(tags))}" for vendor, tags in self.vendor_capabilities)
        feats = ",".join(sorted(self.features)) or "-"
        dts = "; ".join(
            f"{role}: {','.join(sorted(str(d).removeprefix('torch.') for d in ds))}" for role, ds in self.dtypes
        )
        shp = "; ".join(f"{k}: {','.join(map(str, sorted(v)))}" for k, v in self.shapes)
        hooks = ",".join(
            n for n in ("prepare", "prepare_layout", "bind", "step_runner") if getattr(self, n) is not None
        )
        rank = self.describe_rank()
        return (
            f"{self.name} [{self.solution}, backend={self.backend}, priority={self.band.name.lower()}"
            f"({self.priority})] vendors={vendors} archs={archs} caps={caps} dtypes=({dts or 'any'}) "
            f"shapes=({shp or 'any'}) features={feats} graph_safe={'yes' if self.graph_safe else 'no'}"
            + ("" if self.unseen_safe else " unseen_safe=no")
            + (f" hooks={hooks}" if hooks else "")
            + (f" ranks={rank}" if rank else "")
        )

    def rank_miss(self, request: Request) -> str:
        """Why no ``rank_when`` rule holds for ``request`` ("" when one holds or there is
        none): per rule, each key whose value in the request is not in the rule's set."""
        misses = []
        for shapes, priority in self.rank_rules:
            missed = [
                f"{k} {_shown(request.shape(k))} not in {_shown_set(v)}" for k, v in shapes if request.shape(k) not in v
            ]
            if not missed:
                return ""
            misses.append(f"not ranked {_band(priority)}: " + "; ".join(missed))
        return "; ".join(misses)

    def describe_rank(self) -> str:
        """``band(priority) when key in {...}`` per rule (``or`` between them), or "" without
        a ``rank_when``."""
        return " or ".join(
            f"{_band(priority)} when " + " and ".join(f"{k} in {_shown_set(v)}" for k, v in shapes)
            for shapes, priority in self.rank_rules
        )


def _band(priority: int) -> str:
    """``performant(300)``: a priority with its band's name."""
    return f"{Priority.band(priority).name.lower()}({priority})"


@dataclass
class BackendStatus:
    """How loading one backend went: ``loaded``, ``failed`` or ``disabled``."""

    name: str
    target: str
    state: str
    error: str = ""
    kernels: list[str] = field(default_factory=list)


_kernels: dict[str, KernelSpec] = {}
_by_op: dict[str, list[KernelSpec]] = {}
_backends: dict[str, BackendStatus] = {}
_invalidation_hooks: list[Callable[[], None]] = []
_lock = threading.RLock()
_loaded = False
_current_backend: str | None = None


def _frozen_dtypes(
    dtypes: Mapping[str, Iterable[torch.dtype]] | None, roles: tuple[str, ...], name: str
) -> tuple[tuple[str, frozenset[torch.dtype]], ...]:
    out = []
    for role, values in sorted((dtypes or {}).items()):
        if role not in roles:
            raise ValueError(f"kernel {name!r}: unknown dtype role {role!r}; expected one of {roles}")
        values = frozenset(values)
        if not all(isinstance(v, torch.dtype) for v in values):
            raise TypeError(f"kernel {name!r}: dtypes[{role!r}] must hold torch.dtype values")
        out.append((role, values))
    return tuple(out)


def _frozen_vendor_capabilities(
    vendor_capabilities: Mapping[str, Iterable[str]] | None, vendors: frozenset[str], name: str
) -> tuple[tuple[str, frozenset[str]], ...]:
    """``vendor_capabilities`` as sorted ``(vendor, frozenset)`` pairs (empty sets dropped);
    ``ValueError`` for a vendor the kernel does not list, ``TypeError`` for tags given as one
    string instead of a collection of strings."""
    out = []
    for vendor, tags in sorted((vendor_capabilities or {}).items()):
        if vendor not in vendors:
            raise ValueError(
                f"kernel {name!r}: vendor_capabilities names {vendor!r}, not one of its vendors "
                f"{', '.join(sorted(vendors))}"
            )
        tag_set = frozenset(() if isinstance(tags, str) else tags)
        if isinstance(tags, str) or not all(isinstance(tag, str) for tag in tag_set):
            raise TypeError(f"kernel {name!r}: vendor_capabilities[{vendor!r}] must be a collection of strings")
        if tag_set:
            out.append((vendor, tag_set))
    return tuple(out)


def _checked_priority(value: Any, name: str, what: str) -> int:
    """``value`` as an int inside a band's range (:meth:`Priority.ranges`); ``TypeError`` for
    a non-integer, ``ValueError`` naming the kernel, the value and the ranges otherwise."""
    if isinstance(value, bool):
        raise TypeError(f"kernel {name!r}: {what} must be an int (a Priority band plus an offset), got bool")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(
            f"kernel {name!r}: {what} must be an int (a Priority band plus an offset), got {type(value).__name__}"
        ) from None
    ranges = Priority.ranges()
    if not any(number in span for span in ranges.values()):
        allowed = ", ".join(f"{band.name.lower()} {span.start}..{span.stop - 1}" for band, span in ranges.items())
        raise ValueError(f"kernel {name!r}: {what} {number} is in no priority band; allowed: {allowed}")
    return number


def _absent_first(value: int | None) -> tuple[bool, int]:
    return (value is not None, value or 0)


def _shown(value: int | None) -> str:
    return "absent" if value is None else str(value)


def _shown_set(values: frozenset[int | None]) -> str:
    """A ``rank_when`` set as ``{absent,1,2}``: absent first, then ascending."""
    return "{" + ",".join(map(_shown, sorted(values, key=_absent_first))) + "}"


def _frozen_shapes(
    shapes: Mapping[str, Iterable[int | None]] | None, keys: tuple[str, ...], name: str, *, absent: bool = False
) -> tuple[tuple[str, frozenset[Any]], ...]:
    """``shapes`` as sorted ``(key, frozenset)`` pairs; ``absent``: ``None`` may be a value
    (a ``rank_when`` set accepting requests without the key)."""
    out = []
    for key, values in sorted((shapes or {}).items()):
        if key not in keys:
            raise ValueError(f"kernel {name!r}: unknown shape key {key!r}; expected one of {keys}")
        out.append((key, frozenset(_shape_value(v, absent, name, key) for v in values)))
    return tuple(out)


def _shape_value(value: int | None, absent: bool, name: str, key: str) -> int | None:
    if value is not None:
        return int(value)
    if absent:
        return None
    raise TypeError(f"kernel {name!r}: shape {key!r} lists None; only a rank_when set may (the key absent)")


def register_kernel(
    op: str,
    *,
    name: str,
    solution: str,
    vendors: Iterable[str] = ("cuda", "rocm", "cpu"),
    archs: Iterable[str] | None = None,
    capabilities: Iterable[str] = (),
    vendor_capabilities: Mapping[str, Iterable[str]] | None = None,
    dtypes: Mapping[str, Iterable[torch.dtype]] | None = None,
    shapes: Mapping[str, Iterable[int]] | None = None,
    features: Iterable[str] = (),
    priority: int = Priority.PORTABLE,
    predicate: Predicate | None = None,
    available: Availability | None = None,
    prepare: Callable[..., Any] | None = None,
    prepare_layout: Callable[[Any], None] | None = None,
    bind: Callable[[Any], Callable[[Any], None]] | None = None,
    step_runner: Callable[[Any], Callable[[Any], None]] | None = None,
    graph_safe: bool = True,
    rank_when: RankWhen | tuple[RankWhen, ...] | None = None,
    unseen_safe: bool = True,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register the decorated function as a kernel for ``op`` (see the module docstring).

    ``graph_safe`` defaults to True because the kernel contract already forbids host
    synchronization on the hot path (docs/adding-a-kernel.md); a kernel that breaks it
    (reads lengths with ``.tolist()``, masks with data-dependent shapes, plans per call)
    must say ``graph_safe=False``.

    ``vendor_capabilities``: ``{vendor: capabilities}`` required on that vendor's platforms
    only, on top of ``capabilities``; each vendor must be one of ``vendors``.

    ``rank_when=(shapes, priority)``: rank at ``priority`` for requests whose ``shapes``
    keys all have accepted values, ``None`` accepting an absent key
    (``KernelSpec.priority_for``); a tuple of such pairs: the first that holds.

    ``priority`` and the ``rank_when`` priority must each lie in a band's range
    (:meth:`Priority.ranges`: ``[band, next band)``, ``plugin`` 400..499).

    Raises ``ValueError`` for an unknown operator, dtype role, shape key or feature, for a
    ``vendor_capabilities`` vendor outside ``vendors``, for a
    ``prepare_layout`` (``bind``, ``step_runner``) hook on an operator without a layout plan
    step (a plan that binds, a step plan), for a ``rank_when``
    without shapes, for a priority outside every band, and for a name already taken by
    another kernel; ``TypeError`` for a non-bool ``graph_safe`` or a non-integer priority.
    """
    schema = operator_schema(op)
    feature_set = frozenset(features)
    unknown = feature_set - set(schema.features)
    if unknown:
        raise ValueError(
            f"kernel {name!r}: unknown features {sorted(unknown)} for {op}; expected some of {schema.features}"
        )
    vendor_set = frozenset(vendors)
    bad_vendors = vendor_set - {"cuda", "rocm", "cpu"}
    if bad_vendors or not vendor_set:
        raise ValueError(f"kernel {name!r}: vendors must be a non-empty subset of cuda, rocm, cpu")
    frozen_vendor_caps = _frozen_vendor_capabilities(vendor_capabilities, vendor_set, name)
    frozen_dtypes = _frozen_dtypes(dtypes, schema.dtype_roles, name)
    frozen_shapes = _frozen_shapes(shapes, schema.shape_keys, name)
    for flag, value in (("graph_safe", graph_safe), ("unseen_safe", unseen_safe)):
        if not isinstance(value, bool):
            raise TypeError(f"kernel {name!r}: {flag} must be a bool, got {type(value).__name__}")
    checked_priority = _checked_priority(priority, name, "priority")
    rules = () if rank_when is None else (rank_when,) if isinstance(rank_when[0], Mapping) else rank_when
    rank_rules = []
    for when, rank_priority in rules:
        rank_shapes = _frozen_shapes(when, schema.shape_keys, name, absent=True)
        if not rank_shapes:
            raise ValueError(f"kernel {name!r}: rank_when needs at least one shape key, got {when!r}")
        rank_rules.append((rank_shapes, _checked_priority(rank_priority, name, "rank_when priority")))
    for hook_name, hook, allowed, step in (
        ("prepare_layout", prepare_layout, "layout_hook", "no layout plan step"),
        ("bind", bind, "binds", "no plan that binds a run"),
        ("step_runner", step_runner, "step_runs", "no step plan"),
    ):
        if hook is not None and not getattr(schema, allowed):
            with_hook = ", ".join(s.name for s in OPERATORS.values() if getattr(s, allowed))
            raise ValueError(
                f"kernel {name!r}: {op} has {step}, so {hook_name} would never be called (operators with one: {with_hook})"
            )

    def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
        spec = KernelSpec(
            op=op,
            name=name,
            fn=fn,
            solution=solution,
            backend=_current_backend or _backend_for_module(getattr(fn, "__module__", "") or "user"),
            vendors=vendor_set,
            archs=frozenset(archs) if archs is not None else None,
            capabilities=frozenset(capabilities),
            dtypes=frozen_dtypes,
            shapes=frozen_shapes,
            features=feature_set,
            priority=checked_priority,
            predicate=predicate,
            available=available,
            prepare=prepare,
            prepare_layout=prepare_layout,
            bind=bind,
            step_runner=step_runner,
            graph_safe=graph_safe,
            unseen_safe=unseen_safe,
            description=((fn.__doc__ or "").strip().splitlines() or [""])[0],
            rank_rules=tuple(rank_rules),
            vendor_capabilities=frozen_vendor_caps,
        )
        with _lock:
            existing = _kernels.get(name)
            if existing is not None:
                raise ValueError(
                    f"kernel name {name!r} is already registered for {existing.op} by backend "
                    f"{existing.backend!r}; kernel names must be unique"
                )
            _kernels[name] = spec
            _by_op.setdefault(op, []).append(spec)
            _by_op[op].sort(key=KernelSpec.rank_key)
            _invalidate()
        return fn

    return decorator


def _backend_for_module(module: str) -> str:
    """The backend a kernel registered outside a backend load belongs to: the one whose
    entry-point module contains ``module`` (a test or tool may import a kernel module before
    the backends load), else the module's top-level package (in-process registration)."""
    targets = [(BUILTIN_BACKEND, _BUILTIN_MODULE)]
    targets += [(ep.name, ep.value.partition(":")[0]) for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)]
    for name, prefix in targets:
        if module == prefix or module.startswith(prefix + "."):
            return name
    return module.split(".")[0]


def unregister_kernel(name: str) -> None:
    """Remove a kernel (tests, plugin unloading). ``KeyError`` if it is not registered."""
    with _lock:
        spec = _kernels.pop(name)
        _by_op[spec.op].remove(spec)
        _invalidate()


def kernels(op: str | None = None) -> list[KernelSpec]:
    """Registered kernels (of ``op``, or all), highest priority first. Loads backends."""
    load_backends()
    if op is not None:
        operator_schema(op)
        return list(_by_op.get(op, ()))
    return sorted(_kernels.values(), key=lambda s: (s.op, *s.rank_key()))


def get_kernel(name: str) -> KernelSpec:
    """The kernel called ``name``; ``ValueError`` listing the registered names otherwise."""
    load_backends()
    try:
        return _kernels[name]
    except KeyError:
        raise ValueError(f"no kernel named {name!r}; registered: {', '.join(sorted(_kernels))}") from None


def kernel_op(name: str) -> str | None:
    """The operator the kernel called ``name`` is registered for, or None when none is."""
    load_backends()
    spec = _kernels.get(name)
    return spec.op if spec is not None else None


def backends() -> list[BackendStatus]:
    """How each backend's loading went (loads them first if needed)."""
    load_backends()
    return list(_backends.values())


def on_change(hook: Callable[[], None]) -> None:
    """Call ``hook`` whenever the set of kernels changes (the selector drops its cache)."""
    _invalidation_hooks.append(hook)


def _invalidate() -> None:
    for hook in _invalidation_hooks:
        hook()


@contextlib.contextmanager
def _loading(backend: str) -> Iterator[None]:
    global _current_backend
    previous, _current_backend = _current_backend, backend
    try:
        yield
    finally:
        _current_backend = previous


def _load_one(name: str, target: str, loader: Callable[[], Any]) -> None:
    if name in config.disabled_backends():
        _backends[name] = BackendStatus(name, target, "disabled", f"disabled by {config.DISABLE_BACKENDS_ENV}")
        return
    before = set(_kernels)
    try:
        with _loading(name):
            obj = loader()
            if callable(obj):  # an entry point naming a function: call it to register
                obj()
    except Exception as exc:  # a broken backend must never take the library down
        for added in set(_kernels) - before:
            unregister_kernel(added)
        detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        _backends[name] = BackendStatus(name, target, "failed", detail)
        log.warning("tokenspeed_kernel: backend %r (%s) failed to load and is skipped: %s", name, target, detail)
        return
    mine = sorted(kernel for kernel, spec in _kernels.items() if spec.backend == name)
    _backends[name] = BackendStatus(name, target, "loaded", kernels=mine)


def backends_loaded() -> bool:
    """Whether :func:`load_backends` has run (settings read at a backend's import, such as
    an interpreter switch, must be made before)."""
    return _loaded


def load_backends(*, force: bool = False) -> None:
    """Load the built-in reference backend and every entry-point backend, once.

    Never called at ``import tokenspeed_kernel``; the first selection, ``kernels()`` or
    ``backends()`` triggers it. ``force=True`` loads entry points not seen before (tests).
    """
    global _loaded
    if _loaded and not force:
        return
    with _lock:
        if _loaded and not force:
            return
        _loaded = True
        if BUILTIN_BACKEND not in _backends:
            _load_one(BUILTIN_BACKEND, _BUILTIN_MODULE, lambda: importlib.import_module(_BUILTIN_MODULE))
        found = sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name)
        for ep in found:
            if ep.name in _backends or ep.name == BUILTIN_BACKEND:
                continue
            _load_one(ep.name, ep.value, ep.load)
        _warn_unknown_disabled([BUILTIN_BACKEND, *(ep.name for ep in found), *_backends])


_warned_disabled: set[str] = set()


def _warn_unknown_disabled(known: Iterable[str]) -> None:
    """Log a warning, once per name, for each ``TOKENSPEED_KERNEL_DISABLE_BACKENDS`` entry
    that names no backend (a misspelt name would otherwise leave that backend enabled)."""
    names = sorted(set(known))
    unknown = sorted(config.disabled_backends() - set(names) - _warned_disabled)
    if unknown:
        _warned_disabled.update(unknown)
        log.warning(
            "tokenspeed_kernel: %s names unknown backends %s (ignored); known backends: %s",
            config.DISABLE_BACKENDS_ENV,
            ", ".join(unknown),
            ", ".join(names),
        )


def load_backend(name: str, target: str) -> BackendStatus:
    """Load one backend by hand from ``"module"`` or ``"module:function"`` (plugins, tests)."""
    load_backends()
    module_name, _, attr = target.partition(":")

    def loader() -> Any:
        module = importlib.import_module(module_name)
        return getattr(module, attr) if attr else module

    with _lock:
        _load_one(name, target, loader)
    return _backends[name]


def unload_backend(name: str) -> None:
    """Withdraw every kernel a backend registered and forget it (tests, plugin reloads).

    A later ``load_backends(force=True)`` loads it again if its entry point still exists.
    """
    with _lock:
        status = _backends.pop(name, None)
        for kernel in list(_kernels.values()):
            if kernel.backend == name:
                unregister_kernel(kernel.name)
        if status is None:
            raise KeyError(f"no backend named {name!r} was loaded")


@contextlib.contextmanager
def isolated(keep_backends: Iterable[str] = (BUILTIN_BACKEND,)) -> Iterator[None]:
    """Within the block, only kernels of ``keep_backends`` are registered; the full set is
    restored afterwards. For tests that must not depend on which wheels are installed."""
    load_backends()
    keep = frozenset(keep_backends)
    with _lock:
        saved = dict(_kernels)
        for name, spec in saved.items():
            if spec.backend not in keep:
                unregister_kernel(name)
    try:
        yield
    finally:
        with _lock:
            _kernels.clear()
            _kernels.update(saved)
            _by_op.clear()
            for spec in saved.values():
                _by_op.setdefault(spec.op, []).append(spec)
            for specs in _by_op.values():
                specs.sort(key=KernelSpec.rank_key)
            _invalidate()
