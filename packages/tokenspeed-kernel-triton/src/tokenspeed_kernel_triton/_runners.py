"""Runner caches of the functional calls: a kernel's launches bound once per call key, then
launched with each call's tensors.

A public call (``mha_decode_with_kvcache``, ``moe_apply``, ...) hands its kernel new tensors
every time, but a model repeats a handful of call shapes (every layer of a step has the same
one). Binding a call (tile and split choice, strides, constexpr dicts, the launch cache's key
of 30 arguments) costs tens of microseconds of host time; a :class:`RunnerCache` binds once per
*key* and later calls of the key only launch, every tensor of the call passed per run through
:class:`~tokenspeed_kernel_triton._launcher.BoundLaunch` (direct launches on a GPU; under the
interpreter and on other backends each launch takes ``jit_launch`` with its full arguments, as
before).

**Key contract.** ``key(args)`` is a hashable of everything the kernel's launch building reads
of a call besides its tensors' addresses:

- the shape, strides, dtype and device of every tensor it reads them of (shapes and strides
  become scalar arguments, grids and constexprs);
- which optional tensors are present (a placeholder takes an absent one's place, and the
  launches' tensor positions differ);
- every scalar option it passes or branches on (scale, window, cap, causal, activation, ...);
- every derived number that picks a configuration, a grid or a split count (decode's split
  count, the query-tile count). A per-step value (decode's ``max_seqlen_k``) is keyed through
  what it picks (the split count), not itself, so that the steps share a runner.

Not keyed: the tensors' addresses (every call tensor varies per run) and their 16-byte
alignment (``BoundLaunch`` checks each launch's tensors against its first launch and takes
``jit_launch`` on a difference: correct, only slower). A key the contract misses would launch
a configuration of another call: the kernels' tests compare every cached launch's arguments
with a fresh bind's.

**Pipeline contract.** :class:`Pipeline` binds a call's launches (``Launch`` objects, built by
the same code that launches an uncached call) given where each tensor argument comes from:

- ``inputs``: the call's tensors, in an order the runner reproduces per run (``None`` for an
  absent one). Each launch argument that *is* one of them varies per run; a runner must never
  launch with a stale tensor, so no input is held.
- ``scratch``: buffers the launches fill and read within one call (uninitialized at its start:
  ``torch.empty``, contiguous, not views); each run allocates new ones of the same shape, dtype
  and device, as an uncached call does (stream-ordered by torch's caching allocator, and from
  the graph's pool under CUDA-graph capture).
- ``keep``: objects that persist across calls (workspaces the kernel resets itself, a
  placeholder that is never read, a plan's own caches): bound.
- ``derived``: launch arguments computed from the run's inputs (:class:`Derived`, made by
  :func:`derive`: ``fn(*args)``, each tensor among ``args`` an input or a scratch buffer, the
  rest bound), computed anew at every run as the uncached call computes them: a Gluon TMA
  ``TensorDescriptor`` over an input (a varying descriptor of ``BoundLaunch``), a view of one.
  A descriptor made by :func:`derive_descriptor` (``fn`` reads its tensors' address, shape,
  strides, dtype and device, never their contents) is not built per run: over one input, the
  run hands the launch that input and the launch derives the descriptor (a derived slot,
  ``_launcher.DerivedSlot``: a direct launch checks the tensor's layout against its first
  launch's and takes its own encoding of that address when it made one, building and encoding
  it otherwise); over anything else (several tensors, a scratch buffer) the run passes a
  ``PendingDescriptor`` keyed on those and on the bound arguments, and a direct launch takes
  its encoded tensor map from the launch cache's descriptor memo when that key was encoded
  before (``_launcher``'s module docstring), building and encoding it otherwise.

A pipeline with no scratch buffer and no value derived per run (a derived slot is none: the
Gluon TMA kernels' runners) runs as one generated function (``Pipeline.run``: inputs unpacked,
each launch called with its values), the same launches as the generic loop's.

Any other tensor or descriptor in a launch is an error at bind time (a view of an input, a
tensor computed from one, not declared derived: it would go stale). A runner maps each launch position to an input
by identity, so :func:`bind_runner` builds the launches from stand-ins (one distinct tensor
object per input): inputs that are one tensor in the bind call (``cu_seqlens_q is
cu_seqlens_k``) keep positions of their own.

A runner also keeps what the launch building read from module globals (the kernel objects, a
tile table): code that swaps those at run time (``ci/device/tiles_sweep.py``, tests that
record launches) calls :func:`clear_runners` around the swap.

``TOKENSPEED_KERNEL_LAUNCH_CACHE=0`` (``_launcher.set_enabled(False)``) turns the runner caches
off too: every call binds afresh and launches through Triton's path (the GPU tests' baseline).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Generic, NamedTuple, TypeVar

import torch

from tokenspeed_kernel_triton import _launcher
from tokenspeed_kernel_triton._launcher import BoundLaunch, DerivedSlot, Launch, PendingDescriptor

__all__ = [
    "Built",
    "Derived",
    "Pipeline",
    "RunnerCache",
    "bind_runner",
    "by_fields",
    "clear_runners",
    "derive",
    "derive_descriptor",
    "pipeline",
    "run_fresh",
    "runner_stats",
]

A = TypeVar("A")
RUNNERS_LIMIT = 256  # runners per cache; a full cache is emptied (a miss only costs a bind)


def _picker(slots: list[int]) -> Callable[[Sequence[Any]], tuple]:
    """``values -> tuple(values[s] for s in slots)``, in C for two or more slots."""
    if not slots:
        return lambda values: ()
    if len(slots) == 1:
        slot = slots[0]
        return lambda values: (values[slot],)
    return operator.itemgetter(*slots)


def _is_tensor_like(value: object) -> bool:
    """A tensor, or an object that holds one (a Gluon ``TensorDescriptor``)."""
    return isinstance(value, torch.Tensor) or isinstance(getattr(value, "base", None), torch.Tensor)


class Derived(NamedTuple):
    """A launch argument computed from a call's inputs: ``value = fn(*args)`` (see
    :func:`derive`). ``value`` is what the build put in its launches; a runner computes it
    anew per run from the run's inputs, or keys it (``descriptor``: made by
    :func:`derive_descriptor`)."""

    value: Any
    fn: Callable[..., Any]
    args: tuple
    descriptor: bool = False


def derive(fn: Callable[..., Any], *args: Any) -> Derived:
    """``fn(*args)`` as a launch argument derived per run (the pipeline contract's
    ``derived``): a builder puts ``.value`` in its launches and returns the record. ``fn`` must
    be a pure function of ``args`` (no state of its own), since a run calls it again with the
    run's tensors in place of the bind call's; an uncached call computes it once, here."""
    return Derived(fn(*args), fn, args)


def derive_descriptor(fn: Callable[..., Any], *args: Any) -> Derived:
    """:func:`derive` for a Gluon TMA ``TensorDescriptor`` whose encoding a runner may reuse:
    ``fn(*args)`` must depend on its tensor arguments only through their address, shape,
    strides, dtype and device (never their contents), and on the others through their value
    (ints, floats, bools, strings, None) or their identity (a cached layout). Over one input,
    a run hands its launch that input and the launch derives the descriptor (a derived slot,
    built only at an address, or of a layout, its slot has not encoded); otherwise a run
    passes a ``PendingDescriptor`` of the run's tensors (:func:`_descriptor_key`), built only
    when the launch cache's descriptor memo lacks its encoding."""
    return Derived(fn(*args), fn, args, descriptor=True)


def _descriptor_head(fn: Callable[..., Any], bound: Sequence[Any]) -> tuple:
    """The bound part of a derived descriptor's memo key: ``fn`` and, per argument, its type
    and its value (plain types) or identity (anything else; the memo entry keeps it alive). A
    tensor's place (None in ``bound``) is filled per run."""
    return (fn, *((type(v), v if type(v) in _launcher._PLAIN_TYPES else id(v)) for v in bound))


def _descriptor_key(head: tuple, call: Sequence[Any], positions: Sequence[int]) -> tuple:
    """A run's memo key of a derived descriptor: ``head`` and each tensor argument's address,
    shape, strides, dtype and device (what ``fn`` may read of it)."""
    if len(positions) == 1:  # the common case (a descriptor over one tensor), flat
        t = call[positions[0]]
        return (head, t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)
    key: list[Any] = [head]
    for position in positions:
        t = call[position]
        key += (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)
    return tuple(key)


class Pipeline:
    """Launches bound once; ``pipe(inputs)`` launches them with a run's inputs (in the order
    they were bound with), new scratch buffers and the derived arguments computed from them.
    Built by :func:`pipeline`."""

    __slots__ = ("_derived", "_scratch", "_steps", "_width", "run")

    def __init__(self, steps: tuple, scratch: tuple, width: int, derived: tuple = (), slots: tuple = ()) -> None:
        self._steps = steps  # (BoundLaunch, picker of its varying values), in launch order
        self._scratch = scratch  # (shape, dtype, device) per scratch buffer
        self._width = width  # number of inputs
        # (fn, bound arguments, positions of tensors, their value slots, the memo key's head
        # of a derived descriptor passed pending, else None)
        self._derived = derived
        # ``run(inputs)``: the same as calling the pipeline; generated for its launches when it
        # has no scratch buffer and no value derived per run (the Gluon TMA kernels' runners,
        # whose launches derive their descriptors: :func:`_generated_run`); ``slots``: per
        # step, the value slots of its varying arguments
        self.run = _generated_run(self, slots) if slots else self.__call__

    def __call__(self, inputs: Sequence[Any]) -> None:
        if len(inputs) != self._width:
            raise TypeError(f"expected {self._width} inputs, got {len(inputs)}")
        values = inputs
        if self._scratch or self._derived:
            values = [
                *inputs,
                *[torch.empty(shape, dtype=dtype, device=device) for shape, dtype, device in self._scratch],
            ]
            for fn, bound, positions, slots, head in self._derived:
                call = list(bound)
                for position, where in zip(positions, slots):
                    call[position] = values[where]
                if head is None:
                    values.append(fn(*call))
                else:
                    values.append(PendingDescriptor(_descriptor_key(head, call, positions), fn, call))
        for launch, pick in self._steps:
            launch(*pick(values))


def pipeline(
    launches: Sequence[Launch],
    inputs: Sequence[Any],
    *,
    scratch: Sequence[torch.Tensor] = (),
    keep: Sequence[object] = (),
    derived: Sequence[Derived] = (),
) -> Pipeline:
    """Bind ``launches`` (see the module docstring's pipeline contract). ``TypeError`` for two
    inputs that are one object (a position could not be told from the other), a launch tensor
    that is none of ``inputs``, ``scratch``, ``keep`` and the ``derived`` values, a derived
    value computed from a tensor that is neither an input nor a scratch buffer (nor an earlier
    derived value), or a scratch buffer that is not a contiguous, unviewed tensor."""
    slot: dict[int, int] = {}
    for i, value in enumerate(inputs):
        if value is not None:
            if id(value) in slot:
                raise TypeError(f"inputs {slot[id(value)]} and {i} are one object: bind with stand-ins (bind_runner)")
            slot[id(value)] = i
    specs = []
    for t in scratch:
        if id(t) in slot:
            continue
        if t._base is not None or not t.is_contiguous() or t.storage_offset() != 0:
            raise TypeError("a scratch buffer must be a fresh contiguous tensor (torch.empty), not a view")
        slot[id(t)] = len(inputs) + len(specs)
        specs.append((tuple(t.shape), t.dtype, t.device))
    computed: list[tuple] = []
    first_derived = len(inputs) + len(specs)
    # A descriptor derived from one input (id of its value -> the input's slot, the slot's
    # recipe): the launch takes the input there and derives the descriptor itself, unless
    # another derived value reads it (then it is computed per run, as any derived value).
    over_input: dict[int, tuple[int, DerivedSlot]] = {}
    read = {id(a) for d in derived for a in d.args if _is_tensor_like(a)}
    for d in derived:
        bound, positions, slots = list(d.args), [], []
        for position, value in enumerate(bound):
            if not _is_tensor_like(value):
                continue
            where = slot.get(id(value))
            if where is None:
                raise TypeError(
                    f"{getattr(d.fn, '__name__', d.fn)}: argument {position} of a derived value is a tensor that is "
                    "neither an input nor a scratch buffer"
                )
            if where >= first_derived:  # an argument of this one: built per run, never pending
                computed[where - first_derived] = (*computed[where - first_derived][:4], None)
            positions.append(position)
            slots.append(where)
            bound[position] = None  # the run's own tensor takes its place
        if (
            d.descriptor
            and len(slots) == 1
            and slots[0] < len(inputs)
            and isinstance(d.args[positions[0]], torch.Tensor)
            and id(d.value) not in read
        ):
            recipe = DerivedSlot(d.fn, tuple(bound), positions[0], _descriptor_head(d.fn, bound))
            over_input[id(d.value)] = (slots[0], recipe)
            continue
        slot[id(d.value)] = first_derived + len(computed)
        keyed = d.descriptor and all(isinstance(d.args[p], torch.Tensor) for p in positions)
        head = _descriptor_head(d.fn, bound) if keyed else None
        computed.append((d.fn, tuple(bound), tuple(positions), tuple(slots), head))
    kept = {id(x) for x in keep}
    steps, step_slots = [], []
    for launch in launches:
        if any(_is_tensor_like(v) for v in launch.kwargs.values()):
            raise TypeError(f"{launch.fn.__name__}: tensors passed by keyword cannot be bound")
        args, positions, slots, recipes = list(launch.args), [], [], []
        for position, value in enumerate(args):
            if isinstance(value, tuple) and any(_is_tensor_like(v) for v in value):
                raise TypeError(f"{launch.fn.__name__}: argument {position} is a tuple holding tensors")
            if not _is_tensor_like(value):
                continue
            if id(value) in over_input:  # the input's slot; the launch derives the descriptor
                where, recipe = over_input[id(value)]
                positions.append(position)
                slots.append(where)
                recipes.append(recipe)
                args[position] = None
                continue
            where = slot.get(id(value))
            if where is not None:
                positions.append(position)
                slots.append(where)
                recipes.append(None)
                args[position] = None  # no input or scratch buffer of the bind call is held
            elif id(value) not in kept:
                raise TypeError(
                    f"{launch.fn.__name__}: argument {position} is a tensor that is neither an input, a scratch "
                    "buffer nor kept (a view of an input, or one computed from it, would go stale)"
                )
        bound = BoundLaunch(launch.fn, launch.grid, tuple(args), launch.kwargs, tuple(positions), tuple(recipes))
        steps.append((bound, _picker(slots)))
        step_slots.append(tuple(slots))
    return Pipeline(tuple(steps), tuple(specs), len(inputs), tuple(computed), tuple(step_slots))


def _generated_run(pipe: Pipeline, slots: tuple) -> Callable[[Sequence[Any]], None]:
    """``pipe``'s run as one generated function (the generic loop unrolled: inputs unpacked,
    each launch called with its values), or ``pipe.__call__`` where the pipeline has scratch
    buffers or values it derives per run (a derived slot's descriptor is none: its launch
    derives it)."""
    width = pipe._width
    if pipe._scratch or pipe._derived:
        return pipe.__call__
    names = [f"v{i}" for i in range(width)]
    lines = [
        "def run(inputs):",
        f"    if len(inputs) != {width}:",
        f"        raise TypeError(f'expected {width} inputs, got {{len(inputs)}}')",
        f"    {', '.join(names)}{',' if width == 1 else ''} = inputs" if width else "",
    ]
    for i, step in enumerate(slots):
        lines.append(f"    L{i}({', '.join(names[s] for s in step)})")
    unpack = [f"    L{i} = STEPS[{i}][0]" for i in range(len(slots))]
    source = (
        "def make(STEPS):\n" + "\n".join(unpack) + "\n"
        + "\n".join("    " + line for line in "\n".join(x for x in lines if x).split("\n"))
        + "\n    return run\n"
    )  # fmt: skip
    return _launcher._generated_factory(source, "<runner pipeline>", {})(pipe._steps)


# What a kernel's launch builder returns for a call: its launches, the scratch buffers they use
# (allocated by the builder), the objects they use that persist across calls and, optionally,
# the launch arguments it derived from the call's inputs (:func:`derive`).
Built = (
    tuple[Sequence[Launch], Sequence[torch.Tensor], Sequence[object]]
    | tuple[Sequence[Launch], Sequence[torch.Tensor], Sequence[object], Sequence[Derived]]
)


def _stand_in(t: Any) -> Any:
    """A new tensor object over ``t``'s memory with its shape, strides and offset (None: None)."""
    return None if t is None else t.as_strided(t.shape, t.stride(), t.storage_offset())


def bind_runner(
    build: Callable[[A], Built],
    args: A,
    inputs_of: Callable[[A], Sequence[Any]],
    with_inputs: Callable[[A, tuple], A],
    *,
    keep: Sequence[object] = (),
) -> Callable[[A], None]:
    """The runner of ``build``'s launches for calls like ``args``: each run launches them with
    ``inputs_of(run_args)`` and new scratch buffers.

    ``inputs_of(args)`` lists the call's tensors that vary per run (the pipeline's inputs);
    ``with_inputs(args, tensors)`` is ``args`` with those replaced (same order). The launches
    are built from ``args`` with a stand-in for each input (a distinct tensor object over the
    same memory, shape and strides), so two inputs that are one tensor in this call (a
    self-attention's ``cu_seqlens_q`` and ``cu_seqlens_k``) still get a position each, and a
    later call where they differ launches correctly. ``build`` must not branch on tensor
    identity. ``keep``: objects bound besides ``build``'s own (a plan's caches)."""
    stand_ins = tuple(map(_stand_in, inputs_of(args)))
    launches, scratch, kept, *derived = build(with_inputs(args, stand_ins))
    pipe = pipeline(launches, stand_ins, scratch=scratch, keep=(*kept, *keep), derived=derived[0] if derived else ())
    run = pipe.run
    return lambda a: run(inputs_of(a))


def by_fields(*names: str) -> tuple[Callable[[Any], tuple], Callable[[Any, tuple], Any]]:
    """``(inputs_of, with_inputs)`` for :func:`bind_runner` when the inputs are fields of a
    dataclass (at least two): read in C (``operator.attrgetter``), replaced with
    ``dataclasses.replace``."""
    if len(names) < 2:
        raise ValueError("by_fields needs at least two field names")
    return operator.attrgetter(*names), lambda args, tensors: dataclasses.replace(args, **dict(zip(names, tensors)))


def run_fresh(build: Callable[[A], Built], args: A) -> None:
    """Build ``args``' launches and launch each once (``jit_launch``): the uncached call."""
    for launch in build(args)[0]:
        launch()


class RunnerCache(Generic[A]):
    """A kernel's functional calls' runners, by key (see the module docstring).

    ``cache(args)`` runs the call: the runner bound for ``key(args)`` (``bind(args)`` at the
    key's first call), or ``fresh(args)`` (the uncached launch) when the launch cache is off. At most :data:`RUNNERS_LIMIT`
    runners; a full cache is emptied. The kernel validates its arguments before calling it.
    """

    __slots__ = ("_bind", "_fresh", "_key", "binds", "limit", "name", "runners")

    def __init__(
        self,
        name: str,
        key: Callable[[A], Hashable],
        bind: Callable[[A], Callable[[A], None]],
        fresh: Callable[[A], None],
        limit: int = RUNNERS_LIMIT,
    ) -> None:
        self.name = name
        self._key = key
        self._bind = bind
        self._fresh = fresh
        self.limit = limit
        self.runners: dict[Hashable, Callable[[A], None]] = {}
        self.binds = 0  # runners bound so far (tests, runner_stats)
        _CACHES.append(self)

    def __call__(self, args: A) -> None:
        self.runner(args)(args)

    def runner(self, args: A) -> Callable[[A], None]:
        """What serves calls with ``args``' key: its runner (bound on the key's first call), or
        the uncached launch when the launch cache is off. A kernel's ``step_runner`` hook returns
        it, so a step plan's runs skip the key (every run of a plan has the key of its first)."""
        if not _launcher._enabled:
            return self._fresh
        key = self._key(args)
        run = self.runners.get(key)
        if run is None:
            run = self._bind(args)
            if len(self.runners) >= self.limit:
                self.runners.clear()
            self.runners[key] = run
            self.binds += 1
        return run

    def clear(self) -> None:
        """Forget every runner (the next call of each key binds again)."""
        self.runners.clear()


_CACHES: list[RunnerCache] = []


def clear_runners() -> None:
    """Forget every cache's runners (tests)."""
    for cache in _CACHES:
        cache.clear()


def runner_stats() -> dict[str, dict[str, int]]:
    """Per cache (by name): runners held (``runners``) and bound so far (``binds``)."""
    return {cache.name: {"runners": len(cache.runners), "binds": cache.binds} for cache in _CACHES}
