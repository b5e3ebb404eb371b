"""One :class:`Operator` object per operator, and the one call path every public call takes.

An operator (a family and mode: ``attention.decode``, ``moe.apply``, ...) is one object that
owns everything the core knows about it:

- ``schema``: its request vocabulary (dtype roles, shape keys, features), from
  :data:`tokenspeed_kernel.operators.OPERATORS`;
- ``args``: the typed argument object its kernels receive (``ops/<family>/args.py``);
- ``reference``: the name of its pure-PyTorch reference kernel (``reference/<family>.py``);
- ``custom_op``: the name of its ``torch.library`` custom op in ``torch.ops.tokenspeed_kernel``
  (``ops/<family>/_custom_ops.py``; the public function's name), which stands for the call
  under ``torch.compile``; an operator made with ``traceable=False`` has none (the
  expert-parallel exchange: its calls validate collectively, synchronizing with the host, and
  return a handle object), and its plan's ``trace`` raises, saying so;
- ``plan``: the :class:`Plan` class of one call, which gives the call's ``key`` (which facts
  of a call its checks read, and whether the values they leave out are still fine), its
  ``check`` (every host check, in order, raising ``TypeError``/``ValueError`` naming the
  argument; they live in ``ops/<family>/_validate.py``), its ``run`` and its ``trace``;
- ``plans``: its plan cache, call key -> plan (bounded; ``ops/_checks.py``).

The public function keeps its signature and docstring and only forwards its arguments, in
their public order (the **call**), to :meth:`Operator.call`, which is the same for every
operator::

    tracing under torch.compile?  return check(True, *call).trace(*call)    # the custom op
    key = key(*call)            # None: check in full and remember nothing
    plan = plans.get(key)       # a hit: the full checks passed for a call with this key
    if plan is None:            # a miss: every check, in full (raises the precise error)
        plan = check(False, *call), remembered under key
    return plan.run(*call)      # value checks (debug), dispatch, outputs, typed args, kernel

**Keys.** ``key(*call)`` returns :func:`~tokenspeed_kernel.ops._checks.call_key` of the
arguments the checks read (tensors, weights, options), or None when the call cannot be
remembered (an argument of another kind, a tensor subclass) or when a value the key leaves out
(``max_seqlen_*``, ``out`` aliasing ``x``) fails its quick per-call check: the full checks then
run and raise what is wrong. Every outcome of the full checks is a function of the key, so a
hit never lets a bad call through.

**Plans.** A :class:`Plan` is what validation derived, so the per-call work does not derive it
again: the selector request, head geometry, resolved scales, output shapes, the device. Its
``run(*call)`` is the eager call: debug-mode value checks, ``dispatch`` (selection: one
dict lookup), output allocation, the typed arguments, the kernel. Its ``trace(*call)`` is
the call while ``torch.compile`` traces: the custom op, whose real implementation runs the
eager path. A call's plan is made by its operator and kept in the plan cache; the plan steps
(``mha_decode_plan``, ``moe_plan``) make user-held plans of the same kind, with some
arguments fixed and the kernel selected once (``DecodePlan.run``, ``MoEPlan.apply``).

Adding an operator: its schema in ``operators.py``, its typed args, its checks
(``ops/<family>/_validate.py``), its plan class (``run``/``trace``), its custom op, its
reference kernel, and one ``Operator(...)`` next to the public function that forwards to it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch

from tokenspeed_kernel.operators import OPERATORS, OperatorSchema, operator_schema
from tokenspeed_kernel.ops._checks import call_table, remember
from tokenspeed_kernel.registry import KernelSpec, get_kernel

__all__ = ["Calls", "Operator", "Plan", "operator", "operators"]

_is_compiling = torch.compiler.is_compiling


class Plan:
    """The plan of one call: what its checks derived, and the per-call work that is left.

    A subclass is a dataclass of facts (no tensors: plans live in a cache keyed by shapes;
    never changed once made, but not frozen, which would add ~60 ns per field to every miss)
    that defines, with the parameters of its operator's public call (``*call``):

    - ``key(*call) -> Hashable | None`` (static): the call key, or None to check in full and
      remember nothing (see the module docstring);
    - ``check(compiling, *call) -> plan`` (class method): every host check of the call, in
      order (``ops/<family>/_validate.py``), then the plan; while tracing (``compiling``) it
      holds no selector request;
    - ``run(*call)``: the eager call: value checks under ``TOKENSPEED_KERNEL_DEBUG``,
      ``dispatch``, outputs, typed arguments, the kernel; returns the public result;
    - ``trace(*call)``: the call while ``torch.compile`` traces: the custom op.

    ``run`` passes sizes unpacked (``q.new_empty(*self.out_shape)``, ``out.view(*shape)``):
    torch parses separate ints about 0.3 µs faster than one tuple.
    """

    __slots__ = ()
    key: Callable[..., Hashable | None]
    check: Callable[..., Plan]
    run: Callable[..., Any]
    trace: Callable[..., Any]


class Calls:
    """A plan class and its plan cache: the call path (see the module docstring).

    Each :class:`Operator` is one, for its public function; a user-held plan whose per-step
    call is served the same way (``MoEPlan.apply``: its call key holds the plan's handle)
    has one of its own.

    Attributes:
        plan: the :class:`Plan` class of one call; it gives the call's ``key`` and ``check``.
        plans: call key -> plan, bounded (``ops/_checks.remember``; emptied by
            ``clear_call_tables``).
    """

    __slots__ = ("_check", "_key", "plan", "plans")

    def __init__(self, plan: type[Plan]) -> None:
        self.plan = plan
        self.plans: dict[Hashable, Plan] = call_table()
        self._key = plan.key
        self._check = plan.check

    def call(self, *call: Any) -> Any:
        """One call, ``call`` being its arguments in the public order."""
        if _is_compiling():
            return self._check(True, *call).trace(*call)
        key = self._key(*call)
        plan = self.plans.get(key)
        if plan is None:  # not seen yet, or not to be remembered: every check, in full
            plan = remember(self.plans, key, self._check(False, *call))
        return plan.run(*call)


_BY_NAME: dict[str, Operator] = {}


class Operator(Calls):
    """One operator: its schema, typed args, reference kernel, custom op, and the plan class and
    plan cache of its public function (:class:`Calls`).

    Attributes:
        name: the operator, e.g. ``"attention.decode"`` (a key of ``OPERATORS``).
        args: the typed argument class its kernels receive.
        reference: the name of its reference kernel.
        custom_op: its custom op's name in ``torch.ops.tokenspeed_kernel``, which is also its
            public function's name in ``tokenspeed_kernel``.
        traceable: False for an operator without a custom op (``torch.compile`` cannot trace
            it; its plan's ``trace`` raises ``RuntimeError`` saying why).
        plan, plans: as in :class:`Calls`.
    """

    __slots__ = ("args", "custom_op", "name", "reference", "traceable")

    def __init__(
        self, name: str, args: type, reference: str, custom_op: str, plan: type[Plan], *, traceable: bool = True
    ) -> None:
        operator_schema(name)  # a ValueError naming the known operators for a typo
        if name in _BY_NAME:
            raise ValueError(f"operator {name!r} is defined twice")
        if traceable and not hasattr(torch.ops.tokenspeed_kernel, custom_op):
            raise ValueError(f"operator {name!r}: no custom op torch.ops.tokenspeed_kernel.{custom_op} is defined")
        super().__init__(plan)
        self.name, self.args, self.reference, self.custom_op = name, args, reference, custom_op
        self.traceable = traceable
        _BY_NAME[name] = self

    def __repr__(self) -> str:
        return f"Operator({self.name!r}, {self.args.__name__}, {self.reference!r}, {self.custom_op!r})"

    @property
    def schema(self) -> OperatorSchema:
        """The operator's request vocabulary (dtype roles, shape keys, features)."""
        return operator_schema(self.name)

    def reference_kernel(self) -> KernelSpec:
        """The registered reference kernel (the float64 ground truth of ``check``)."""
        return get_kernel(self.reference)


def operator(name: str) -> Operator:
    """The :class:`Operator` called ``name`` (``ValueError`` naming the known ones otherwise).
    Every family defines its operators on import, and ``tokenspeed_kernel`` imports them all."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown operator {name!r}; known operators: {', '.join(_BY_NAME)}") from None


def operators() -> tuple[Operator, ...]:
    """Every operator, in the order of ``OPERATORS``."""
    return tuple(_BY_NAME[name] for name in OPERATORS if name in _BY_NAME)
