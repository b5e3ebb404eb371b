"""The selector: filter registered kernels for a platform and a request, rank, return one.

Every candidate is judged by the same checks, in this order, and each failed check gives a
reason in words: backend availability, vendor, architecture, capabilities, dtypes, shapes,
features, graph safety (for a ``capturable`` request), then the kernel's own predicate.
The accepted candidates are ranked by priority (highest first; equal priorities by name,
so the choice is deterministic, and the selection records such a tie as a
:class:`TieBreak`); a kernel registered with ``rank_when`` ranks at its other priority for
the requests whose shapes match it.

A kernel's ``predicate`` or ``available`` hook that raises (or returns something other than
a reason string or None) is a bug in that kernel, not in the request: it becomes that
kernel's rejection reason (``"predicate raised ZeroDivisionError: division by zero"``),
logged once per kernel and hook as a warning on the ``tokenspeed_kernel`` logger, and the
other kernels are judged as usual. Like any rejection it is cached with the selection.

Overrides: a per-call ``override="name"`` wins over ``TOKENSPEED_KERNEL_OVERRIDE``, which
wins over ranking. An override naming a kernel that cannot serve the request raises
:class:`KernelOverrideError` with that kernel's reasons; so does an environment override
naming an operator that does not exist, an unknown kernel or another operator's kernel
(:func:`env_overrides`: checked on the first selection, not per call).

Results are cached per (platform, request, override): a hot call pays one dict lookup.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from tokenspeed_kernel import config, registry
from tokenspeed_kernel.operators import OPERATORS
from tokenspeed_kernel.platform import Platform, current_platform
from tokenspeed_kernel.registry import KernelSpec, Priority, Request

__all__ = [
    "NOT_GRAPH_SAFE",
    "TIE_RULE",
    "Candidate",
    "KernelOverrideError",
    "NoKernelFoundError",
    "Selection",
    "TieBreak",
    "clear_cache",
    "env_overrides",
    "evaluate",
    "explain",
    "platform_reasons",
    "request_reasons",
    "select",
]


NOT_GRAPH_SAFE = "synchronizes with the host; cannot be captured in a CUDA graph"
TIE_RULE = "name"  # equal priorities: the name first in string order wins (KernelSpec.rank_key)

log = logging.getLogger("tokenspeed_kernel")


@dataclass(frozen=True)
class Candidate:
    """One kernel judged against one request: accepted, or rejected with reasons."""

    spec: KernelSpec
    reasons: tuple[str, ...]

    @property
    def accepted(self) -> bool:
        return not self.reasons


@dataclass(frozen=True)
class TieBreak:
    """The winner shared its priority with other accepted kernels and ``rule`` decided.

    ``priority``: the priority they tied at (for this request); ``losers``: the accepted
    kernels at that priority that lost, in rank order; ``rule``: what broke the tie
    (:data:`TIE_RULE`, ``"name"``: the name first in string order wins).
    """

    priority: int
    losers: tuple[str, ...]
    rule: str = TIE_RULE

    def describe(self) -> str:
        band = f"{Priority.band(self.priority).name.lower()}({self.priority})"
        return f"tied at {band} with {', '.join(self.losers)}; broken by {self.rule}: the first in string order wins"


@dataclass(frozen=True)
class Selection:
    """The full verdict for one request: every candidate and the winner (or None).

    ``tie_break`` is set when ranking (not an override) chose the winner among accepted
    kernels of equal priority.
    """

    request: Request
    platform: Platform
    candidates: tuple[Candidate, ...]
    winner: KernelSpec | None
    override: str | None = None
    tie_break: TieBreak | None = None

    def table(self) -> str:
        """A human-readable table: each candidate, ACCEPTED/REJECTED, reasons, the winner."""
        lines = [f"request:  {self.request.describe()}", f"platform: {self.platform.describe()}"]
        if self.override:
            lines.append(f"override: {self.override}")
        if not self.candidates:
            lines.append("  (no kernels are registered for this operator)")
        for cand in self.candidates:
            spec = cand.spec
            mark = "WINNER  " if self.winner is spec else ("ACCEPTED" if cand.accepted else "REJECTED")
            priority = spec.priority_for(self.request)
            head = f"  {mark} {spec.name:<32} {spec.solution:<10} {Priority.band(priority).name.lower()}({priority})"
            if cand.accepted and not spec.graph_safe:
                head += " [not graph-safe]"
            miss = spec.rank_miss(self.request) if cand.accepted else ""
            if miss:
                head += f" ({miss})"
            if self.tie_break is not None and spec.name in self.tie_break.losers:
                head += f" (tied with the winner; lost by {self.tie_break.rule})"
            lines.append(head + ("" if cand.accepted else f": {'; '.join(cand.reasons)}"))
        if self.winner is None:
            lines.append("  => no kernel can serve this request")
        else:
            tie = f" ({self.tie_break.describe()})" if self.tie_break is not None else ""
            lines.append(f"  => {self.winner.name}{tie}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


class NoKernelFoundError(RuntimeError):
    """No registered kernel can serve a request; ``.selection`` holds every reason."""

    def __init__(self, selection: Selection):
        self.selection = selection
        super().__init__("no kernel can serve this request\n" + selection.table())


class KernelOverrideError(ValueError):
    """An override named an unknown kernel or one that cannot serve the request."""


_warned: dict[tuple[int, str], KernelSpec] = {}  # (id(spec), hook) -> spec, kept so the id stays its own


def _warn_once(spec: KernelSpec, hook: str, hook_fn: Callable[..., object], reason: str, exc: Exception | None) -> None:
    if (id(spec), hook) in _warned:
        return
    _warned[(id(spec), hook)] = spec
    module = getattr(hook_fn, "__module__", None) or getattr(spec.fn, "__module__", None) or "?"
    log.warning(
        "tokenspeed_kernel: kernel %r (backend %r, module %s) is rejected: its %s; other kernels serve its "
        "requests (logged once)",
        spec.name,
        spec.backend,
        module,
        reason,
        exc_info=exc,
    )


def _hook_reason(spec: KernelSpec, hook: str, hook_fn: Callable[..., object], *args: object) -> str | None:
    """Call a kernel's ``predicate``/``available`` hook: its reason, or None to accept.

    A falsy result accepts and a string rejects. An exception, or any other truthy result,
    is a bug in that kernel: it becomes the kernel's rejection reason (the exception's type
    and message), logged once per kernel and hook (:func:`_warn_once`), and never escapes,
    so other kernels still serve the request.
    """
    try:
        why = hook_fn(*args)
    except Exception as exc:  # a plugin's bug must not break selection for every kernel
        try:
            detail = f": {exc}" if str(exc) else ""
        except Exception:  # an exception whose message cannot be built
            detail = ": <message unavailable>"
        reason = f"{hook} raised {type(exc).__name__}{detail}"
        _warn_once(spec, hook, hook_fn, reason, exc)
        return reason
    if not why:
        return None
    if isinstance(why, str):
        return why
    reason = f"{hook} returned {why!r}, not a reason string or None"
    _warn_once(spec, hook, hook_fn, reason, None)
    return reason


def _unavailable(spec: KernelSpec) -> str | None:
    return _hook_reason(spec, "available", spec.available) if spec.available is not None else None


def _platform_misses(spec: KernelSpec, platform: Platform) -> tuple[str, ...]:
    reasons: list[str] = []
    if platform.vendor not in spec.vendors:
        reasons.append(f"vendor {platform.vendor} not in {{{', '.join(sorted(spec.vendors))}}}")
    if spec.archs is not None and platform.arch not in spec.archs:
        reasons.append(f"arch {platform.arch} not in {{{', '.join(sorted(spec.archs))}}}")
    missing_caps = spec.capabilities_on(platform.vendor) - platform.capabilities
    if missing_caps:
        reasons.append(f"platform lacks capabilities {{{', '.join(sorted(missing_caps))}}}")
    return tuple(reasons)


def platform_reasons(spec: KernelSpec, platform: Platform) -> tuple[str, ...]:
    """Why ``spec`` cannot run on ``platform`` at all, whatever the request: the reason its
    ``available`` hook gives (alone), else vendor, architecture and missing capabilities;
    ``()`` when it can run there."""
    missing = _unavailable(spec)
    return (missing,) if missing else _platform_misses(spec, platform)


def request_reasons(spec: KernelSpec, request: Request, *, predicate: bool = True) -> tuple[str, ...]:
    """Why ``spec``'s metadata refuses ``request`` on any platform: dtypes, shapes, features,
    graph safety, then (``predicate``, and only when nothing else failed) its predicate (one
    that raises gives ``"predicate raised <type>: <message>"``); ``()`` when the registration
    claims to serve it."""
    reasons: list[str] = []
    for role, allowed in spec.dtypes:
        dtype = request.dtype(role)
        if dtype is not None and dtype not in allowed:
            names = ", ".join(sorted(str(d).removeprefix("torch.") for d in allowed))
            reasons.append(f"{role} dtype {str(dtype).removeprefix('torch.')} not in {{{names}}}")
    for key, values in spec.shapes:
        value = request.shape(key)
        if value is not None and value not in values:
            shown = ", ".join(map(str, sorted(values)))
            reasons.append(f"{key}={value} not in {{{shown}}}")
    unsupported = request.features - spec.features
    if unsupported:
        reasons.append(f"does not support {{{', '.join(sorted(unsupported))}}}")
    if request.capturable and not spec.graph_safe:
        reasons.append(NOT_GRAPH_SAFE)
    if predicate and not reasons and spec.predicate is not None:
        why = _hook_reason(spec, "predicate", spec.predicate, request)
        if why:
            reasons.append(why)
    return tuple(reasons)


def _reasons(spec: KernelSpec, request: Request, platform: Platform) -> tuple[str, ...]:
    missing = _unavailable(spec)
    if missing:
        return (missing,)  # a missing library or device: that reason alone
    where = _platform_misses(spec, platform)
    return where + request_reasons(spec, request, predicate=not where)


def evaluate(request: Request, platform: Platform | None = None) -> tuple[Candidate, ...]:
    """Judge every kernel registered for ``request.op``; ranked for ``request``, highest
    priority first."""
    platform = platform or current_platform()
    specs = sorted(registry.kernels(request.op), key=lambda spec: spec.rank_key(request))
    return tuple(Candidate(spec, _reasons(spec, request, platform)) for spec in specs)


_checked_env: dict[str, str] | None = None  # the config.kernel_overrides() value last found valid


def env_overrides() -> dict[str, str]:
    """``TOKENSPEED_KERNEL_OVERRIDE`` as ``{operator: kernel}``, checked against the registry.

    Raises :class:`KernelOverrideError` (a ``ValueError``, one line naming the variable, the
    operator and its kernels) for an unknown operator, an unknown kernel or a kernel of
    another operator: a misspelt entry would otherwise be silently ignored, or fail only when
    that operator is first called. Checked once per value of the variable
    (:func:`tokenspeed_kernel.config.refresh`) and registry change, not per call.
    """
    global _checked_env
    overrides = config.kernel_overrides()
    if overrides is _checked_env or not overrides:
        return overrides
    unknown = sorted(set(overrides) - set(OPERATORS))
    if unknown:
        raise KernelOverrideError(
            f"{config.OVERRIDE_ENV} names unknown operators {unknown}; known operators: {', '.join(OPERATORS)}"
        )
    for op, name in overrides.items():
        mine = [spec.name for spec in registry.kernels(op)]
        if name in mine:
            continue
        other = registry.kernel_op(name)
        where = f"{name!r} is a kernel of {other}, not of {op}" if other else f"no kernel named {name!r} is registered"
        raise KernelOverrideError(
            f"{config.OVERRIDE_ENV}: {op}={name}: {where}; {op} kernels: {', '.join(mine) or 'none'}"
        )
    _checked_env = overrides
    return overrides


def _override_for(request: Request, override: str | None) -> str | None:
    return override or env_overrides().get(request.op)


def _decide(request: Request, platform: Platform, override: str | None) -> Selection:
    candidates = evaluate(request, platform)
    chosen = _override_for(request, override)
    if chosen is None:
        accepted = [c.spec for c in candidates if c.accepted]
        if not accepted:
            return Selection(request, platform, candidates, None)
        winner, top = accepted[0], accepted[0].priority_for(request)
        losers = tuple(spec.name for spec in accepted[1:] if spec.priority_for(request) == top)
        tie = TieBreak(top, losers) if losers else None
        return Selection(request, platform, candidates, winner, tie_break=tie)
    match = next((c for c in candidates if c.spec.name == chosen), None)
    if match is None:
        names = ", ".join(c.spec.name for c in candidates) or "none"
        raise KernelOverrideError(
            f"override {chosen!r} is not a kernel registered for {request.op}; registered: {names}"
        )
    if not match.accepted:
        raise KernelOverrideError(
            f"override {chosen!r} cannot serve {request.describe()} on {platform.arch}: {'; '.join(match.reasons)}"
        )
    return Selection(request, platform, candidates, match.spec, override=chosen)


_cache: dict[tuple[Platform, Request, str | None], KernelSpec] = {}


def clear_cache() -> None:
    """Drop cached selections (done automatically when kernels are (un)registered)."""
    global _checked_env
    _cache.clear()
    _checked_env = None


registry.on_change(clear_cache)


def select(request: Request, platform: Platform | None = None, override: str | None = None) -> KernelSpec:
    """The kernel that serves ``request`` on ``platform`` (default: the current one).

    Raises :class:`NoKernelFoundError` (with the full table) or :class:`KernelOverrideError`.
    """
    platform = platform or current_platform()
    key = (platform, request, override)
    spec = _cache.get(key)
    if spec is not None:
        return spec
    selection = _decide(request, platform, override)
    if selection.winner is None:
        raise NoKernelFoundError(selection)
    _cache[key] = selection.winner
    return selection.winner


def explain(
    op: str | Request,
    *,
    dtypes: Mapping[str, torch.dtype] | None = None,
    shapes: Mapping[str, int] | None = None,
    features: Iterable[str] = (),
    capturable: bool = False,
    platform: Platform | None = None,
    override: str | None = None,
) -> Selection:
    """The selection verdict for a request, every candidate with its reasons.

    ``op`` is an operator name (then ``dtypes``/``shapes``/``features``/``capturable``
    describe the request) or a :class:`Request` (e.g. from ``attention_request``).
    ``print(explain(...))`` shows the table. Never raises for "no kernel": the returned
    selection's ``winner`` is None instead.
    """
    request = op if isinstance(op, Request) else Request.make(op, dtypes, shapes, features, capturable)
    return _decide(request, platform or current_platform(), override)
