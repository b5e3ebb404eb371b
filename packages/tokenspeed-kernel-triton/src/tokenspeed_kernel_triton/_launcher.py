"""A launch cache for Triton and Gluon JIT kernels: ``jit_launch(kernel, grid, *args, **kwargs)``.

Same arguments and semantics as ``kernel[grid](*args, **kwargs)``; cheaper per launch on a GPU.

Why: ``JITFunction.run`` (Triton 3.6) spends tens of microseconds of host time per launch
before the C launcher runs: it binds the arguments through a generated function that calls
the native specializer on every argument, formats ``str(options)`` for its cache key, reads
knobs, builds launch metadata and calls two (empty) launch hooks. Here the first launch of a
*key* goes through ``JITFunction.run`` (compiling if Triton has to) and remembers the
compiled kernel; later launches with the same key call the compiled kernel's C launcher
directly with the arguments in signature order, each plain tensor as its device address
(Triton's C launcher would otherwise call ``data_ptr()`` and ask the driver about the pointer,
``cuPointerGetAttribute``, for every tensor at every launch: ~0.3 µs each on an H200 host).

The key (built by a function generated once per kernel from its signature) covers
everything that selects the compiled binary in Triton's own cache, and more:

- the current device (Triton keeps one cache per device);
- every ``tl.constexpr`` argument's value and type (``True``, ``1`` and ``1.0`` differ), or
  its identity for values of other types (Gluon layouts: hashing them costs microseconds;
  the cache entry holds a reference, so an identity is never reused while it is a key);
- each tensor argument's dtype, its device index (a host tensor, or one on another device,
  misses and takes Triton's checked path) and, unless the parameter is ``do_not_specialize``
  / ``do_not_specialize_on_alignment``, whether its data pointer is 16-byte aligned;
- each Gluon ``TensorDescriptor``'s element dtype, block shape and layout (identity);
- any other argument (ints, floats, bools, None, tuples): Triton's own native
  specialization of it (``== 1``, divisible by 16, i32/i64/u64 range; bool; float; None),
  with the parameter's own specialize/alignment flags;
- the launch options passed (``num_warps``, ``num_stages``, ...) and the debug and
  instrumentation knobs that Triton folds into its options.

Anything else takes Triton's normal path, unchanged: the interpreter (``TRITON_INTERPRET=1``:
the kernel is an ``InterpretedFunction``; nothing here runs, except that such a kernel given a
GPU tensor raises ``RuntimeError``: see :func:`jit_launch`), Triton versions other than the
one this was written against, non-CUDA backends (ROCm's buffer-op specialization depends on
the tensor's address range; not covered), a callable grid, launch hooks set in
``triton.knobs.runtime`` (profilers), ``pre_run_hooks`` on the kernel, a changed kernel
source (its hash), changed globals the kernel read, an argument of a kind not seen at the
first launch (the generated key raises; the call falls back), and unhashable arguments.
The stream is read at every launch (Triton's current stream: torch's current CUDA stream),
so launches go to the caller's stream and are captured by CUDA graphs like any other.

``BoundLaunch(fn, grid, args, kwargs, varying, derived)`` goes one step further for a plan, whose
launches repeat with the same arguments except a few tensors (q, out, lse) or TMA
descriptors over them: the key is worked out once, at its first launch, and each later
launch only checks what the key read of those (a tensor's dtype and 16-byte alignment; a
descriptor's dtype, block shape and layout) and of the bound tensors (alignment), then
calls the C launcher. Any doubt takes :func:`jit_launch` with the full arguments. Those
checks and the argument list are a function generated at the first launch for the launch's
slots (:func:`_direct_source`: no loop over slots, the constants in a closure; launches of one
structure share the compiled factory): ~15 % less host time per direct launch than the loop
it replaced (CPU, three descriptors and five tensors).

A varying position may be a *derived slot* (:class:`DerivedSlot`, what a runner's pipeline
binds for a descriptor it derives from one of its inputs, ``_runners.derive_descriptor``): the
run hands the launch the tensor, and the launch derives the descriptor ``fn(*args)`` over it.
A direct launch checks the tensor's type, dtype, device, shape and strides against the slot's
first launch's, then takes the slot's own encoding of that address (a dict per slot, at most
:data:`DERIVED_SLOT_LIMIT` addresses, emptied when full); at an address it has not encoded it
takes the descriptor memo's encoding (below; keyed as a pending descriptor's, so the slots of
other runners of one descriptor, another batch's over the same caches, share it), else builds
the descriptor, checks and encodes it (:func:`_descriptor_parts`), and keeps the encoding
(also in the memo) when it is the tensor map of the tensor's own memory
(:func:`_encode_derived`).
Since ``fn`` reads nothing of the tensor but its address, shape, strides, dtype and device,
and the slot's shape, strides, dtype and device are checked at every launch, a kept encoding is
the tensor map an encoding would make now (an allocator that reuses an address with the same
layout gets the same map); a tensor of another layout at a kept address takes
:func:`jit_launch` with its descriptor built. Per run: the tensor's five reads, its address and
one dict look-up, against ~1.2 µs (CPU) for a pending descriptor's key, memo look-up and
checks below.

A varying descriptor may also be a :class:`PendingDescriptor` (``fn(*args)`` not built yet,
with a ``key`` of everything the result depends on: what a runner's per-run derived
descriptors pass when a derived slot cannot serve them, a descriptor over several tensors or
over a scratch buffer, ``_runners.derive_descriptor``). A direct launch looks its encoding up in
the *descriptor memo*: a per-process LRU (:data:`DESCRIPTOR_MEMO_LIMIT` entries) from (key,
the launcher's TMA metadata) to the encoded launch arguments (the CUDA tensor map, shape and
strides) and what the launch checks of a descriptor (type, base dtype, block shape, layout).
A hit builds and encodes nothing: the key names the base tensor by address, shape, strides,
dtype and device, so a hit is the tensor map an encoding would make now (an allocator that
reuses an address with the same shape and strides gets the same map). A miss builds the
descriptor, checks and encodes it as above, and remembers the encoding only when it holds no
tensor and the descriptor lies at the address of a (non-empty) tensor among ``args`` (not a
buffer ``fn`` allocated). The memo holds no tensor: tensor maps hold addresses, and an entry
keeps only ``args``' other values (constants named in the key by identity). Every other path
(the first launch, a fallback, the interpreter, the cache off) builds the descriptor.

``Launch(fn, grid, args, kwargs)`` is one launch as data, so that one function builds a
kernel's argument list for both uses: ``launch()`` runs it once (:func:`jit_launch`),
``launch.bound(*positions)`` makes the :class:`BoundLaunch` of a plan's runner.
"""

from __future__ import annotations

import os
import sys
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import torch
import triton
from triton import knobs
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

__all__ = [
    "DERIVED_SLOT_LIMIT",
    "DESCRIPTOR_MEMO_LIMIT",
    "BoundLaunch",
    "DerivedSlot",
    "Launch",
    "PendingDescriptor",
    "clear",
    "derived_descriptor_stats",
    "descriptor_memo_stats",
    "jit_launch",
    "launcher_stats",
    "set_enabled",
]

# The JITFunction / CompiledKernel / CudaLauncher internals used here were read in this
# version; any other runs the normal path.
_SUPPORTED_TRITON = ((3, 6),)
_TRITON_OK = tuple(int(x) for x in triton.__version__.split(".")[:2]) in _SUPPORTED_TRITON
# TOKENSPEED_KERNEL_LAUNCH_CACHE=0 turns the cache off (every launch takes Triton's path):
# for A/B timing and as an escape hatch. set_enabled() flips it at run time.
_enabled = os.environ.get("TOKENSPEED_KERNEL_LAUNCH_CACHE", "1") != "0"
_MAX_ENTRIES = 256  # per kernel; on overflow the kernel's cache is cleared (only a cost)
# Constexpr values keyed by value (and type); any other type is keyed by identity.
_PLAIN_TYPES = frozenset({int, bool, float, str, type(None)})
_RUNTIME = knobs.runtime
_COMPILATION = knobs.compilation
_ENTER_HOOK = _RUNTIME.launch_enter_hook  # the HookChains Triton installs (3.6)
_EXIT_HOOK = _RUNTIME.launch_exit_hook


def _interpreting() -> bool:
    """Triton's interpreter knob now (``TRITON_INTERPRET``, parsed as Triton parses it)."""
    return bool(_RUNTIME.interpret)


def _is_interpreted(fn) -> bool:
    """Whether ``fn`` is Triton's ``InterpretedFunction`` (made by ``triton.jit`` while
    ``TRITON_INTERPRET`` was on), without importing the interpreter when nothing did."""
    interpreter = sys.modules.get("triton.runtime.interpreter")
    return interpreter is not None and isinstance(fn, interpreter.InterpretedFunction)


def _host_tensors_only(fn, args: tuple, kwargs: dict) -> None:
    """Refuse to let Triton's CPU interpreter run ``fn`` on GPU tensors: the kernels here run
    the interpreter on CPU tensors only, and their ``INTERPRET`` constexpr follows the
    tensors' device, so an interpreted launch on a GPU would be slow and wrong."""
    for value in (*args, *kwargs.values()):
        device = getattr(value, "device", None)
        if isinstance(device, torch.device) and device.type != "cpu":
            raise RuntimeError(
                f"{getattr(fn, '__name__', fn)}: got {device.type} tensors, but the kernel was defined while "
                "TRITON_INTERPRET was on (Triton makes a kernel an interpreted one when its module is "
                "imported), and Triton's interpreter serves CPU tensors only here. Unset TRITON_INTERPRET "
                "before the first kernel selection of a process that uses the GPU."
            )


def _hooks_idle() -> bool:
    """No launch hook is installed (Triton's empty chains, or None)."""
    enter, exit_ = _RUNTIME.launch_enter_hook, _RUNTIME.launch_exit_hook
    return (enter is None or (enter is _ENTER_HOOK and not enter.calls)) and (
        exit_ is None or (exit_ is _EXIT_HOOK and not exit_.calls)
    )


# (driver, current device, current stream): Triton's getters of the active driver, except
# that torch.cuda.current_device (a Python function that checks lazy init; the first launch
# went through Triton and initialized CUDA) is replaced by the C call it ends in.
_DEVICE: list = [None, None, None]


def _refresh_device_functions(drv) -> None:
    get_device = drv.get_current_device
    if get_device is getattr(torch.cuda, "current_device", None) and torch.cuda.is_initialized():
        get_device = torch._C._cuda_getDevice
    _DEVICE[:] = [drv, get_device, drv.get_current_stream]


def _descriptor_type():
    try:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    except ImportError:  # pragma: no cover - no Gluon in this Triton
        return None
    return TensorDescriptor


class _Shape:
    """One call shape of a kernel (positional count and keyword names): its generated key
    function, the constant tail of the launch arguments, and the remembered launches.

    ``prep(dev, *args, *kwarg_values)`` returns the cache key and the positional launch
    arguments with each plain tensor replaced by its device address, which spares Triton's C
    launcher a ``data_ptr()`` call and a driver query (``cuPointerGetAttribute``) per tensor.
    The key holds each such tensor's device index, so a tensor on the host or on another
    device misses and takes Triton's checked path."""

    __slots__ = ("by_value", "cache", "keep", "nargs", "prep", "tail")

    def __init__(self, nargs: int, prep, keep, tail: tuple, by_value: bool) -> None:
        self.nargs = nargs
        self.by_value = by_value
        self.prep = prep
        self.keep = keep
        self.tail = tail
        self.cache: dict = {}


class _Kernel:
    """Per-kernel state: one :class:`_Shape` per keyword-name tuple seen, and counters."""

    __slots__ = (
        "direct",
        "fallbacks",
        "fn",
        "globals_seen",
        "hash",
        "hits",
        "interpreted",
        "misses",
        "plain",
        "shapes",
    )

    def __init__(self, fn) -> None:
        self.fn = fn
        self.globals_seen: list = []  # per global the kernel read: the object last found equal
        # The interpreter (and anything that is not a JITFunction) is never touched.
        self.plain = not isinstance(fn, JITFunction) or _interpreting() or not _TRITON_OK
        self.interpreted = _is_interpreted(fn)
        self.shapes: dict[tuple, _Shape | None] = {}  # None: a shape that is never cached
        self.hash = None
        self.hits = self.misses = self.fallbacks = self.direct = 0


_KERNELS: dict[int, _Kernel] = {}  # id(kernel) -> state; the state holds the kernel alive


def _state(fn) -> _Kernel:
    state = _KERNELS.get(id(fn))
    if state is None:
        state = _KERNELS[id(fn)] = _Kernel(fn)
    return state


def _key_expression(kp, local: str, value, descriptor, keep: list, by_value: bool) -> str:
    """The key expression of one argument, chosen from the kind of its first value."""
    if kp is None or kp.is_constexpr:  # a launch option, or a constexpr: its value
        if by_value or type(value) in _PLAIN_TYPES:
            return local
        # Hashing a Gluon layout costs ~0.2-0.7 us: keyed by identity instead, and kept alive
        # by the entry (an identity in a key is never reused). Call sites build their
        # layouts once (cached configs); a shape whose cache overflows is rebuilt by value.
        keep.append(local)
        return f"_ts_id({local})"
    if descriptor is not None and type(value) is descriptor:
        # Triton's specialization of a descriptor: element type, block shape, layout.
        return (
            f"(({local}.base.dtype, (*{local}.block_shape,), {local}.layout) "
            f"if _ts_type({local}) is _ts_TD else _ts_bad())"
        )
    if type(value) is _TENSOR:  # its address is read once, in ``prep``'s first lines
        address = f"{local}_p"
        parts = f"{local}.dtype, {local}.get_device()"
        if kp.do_not_specialize or kp.do_not_specialize_on_alignment:
            return parts
        return f"{parts}, not {address} & 15"
    if hasattr(value, "data_ptr") and hasattr(value, "dtype"):
        if kp.do_not_specialize or kp.do_not_specialize_on_alignment:
            return f"{local}.dtype"
        return f"{local}.dtype, not {local}.data_ptr() & 15"
    specialize = not kp.do_not_specialize
    align = not kp.do_not_specialize_on_alignment
    return f"_ts_spec(_ts_backend, {local}, {kp.is_const}, {specialize}, {align})"


def _build_shape(fn: JITFunction, args: tuple, kwargs: dict, backend, by_value: bool = False) -> _Shape | None:
    """Generate the key function of this call shape, or None when the shape is not cached
    (a runtime argument passed by keyword, a required parameter left out)."""
    from triton._C.libtriton import native_specialize_impl

    params = fn.params
    by_name = {kp.name: kp for kp in params}
    if len(args) > len(params):
        return None
    for name in kwargs:
        kp = by_name.get(name)
        if kp is not None and (kp.num < len(args) or not kp.is_constexpr):
            return None  # runtime arguments by keyword: not cached (would need reordering)
    tail = []
    for kp in params[len(args) :]:
        if kp.name in kwargs:
            tail.append(None)  # a constexpr: the C launcher skips its slot
        elif kp.has_default:
            tail.append(kp.default)
        else:
            return None
    descriptor = _descriptor_type()
    keep: list[str] = []
    locals_, parts = [], ["_ts_dev"]
    # Plain tensors passed positionally to a runtime parameter: their address is read once (a
    # later value of another kind has no ``data_ptr``/``get_device``: AttributeError, a miss).
    addressed: list[str] = []
    launch: list[str] = []
    for i, value in enumerate(args):
        local = f"_ts_a{i}"
        locals_.append(local)
        kp = params[i]
        parts.append(_key_expression(kp, local, value, descriptor, keep, by_value))
        if not kp.is_constexpr and type(value) is _TENSOR:
            addressed.append(local)
            launch.append(f"{local}_p")
        else:
            launch.append(local)
    for j, (name, value) in enumerate(kwargs.items()):
        local = f"_ts_k{j}"
        locals_.append(local)
        parts.append(_key_expression(by_name.get(name), local, value, descriptor, keep, by_value))
    parts += ["_ts_RT.debug", "_ts_FN.debug", "_ts_CO.instrumentation_mode"]
    head = ", ".join(["_ts_dev", *locals_])
    addresses = "".join(f"    {local}_p = {local}.data_ptr()\n" for local in addressed)
    src = (
        f"def prep({head}):\n{addresses}"
        f"    return ({', '.join(parts)},), ({''.join(part + ', ' for part in launch)})\n"
        f"def keep({head}):\n"
        f"    return ({''.join(part + ', ' for part in keep)})\n"
    )
    namespace = {
        "_ts_spec": native_specialize_impl,
        "_ts_backend": backend,
        "_ts_RT": _RUNTIME,
        "_ts_CO": _COMPILATION,
        "_ts_FN": fn,
        "_ts_TD": descriptor,
        "_ts_bad": _bad_kind,
        "_ts_type": type,
        "_ts_id": id,
    }
    exec(compile(src, f"<launch key of {fn.__name__}>", "exec"), namespace)
    return _Shape(len(args), namespace["prep"], namespace["keep"], tuple(tail), by_value)


def _bad_kind():
    raise TypeError("an argument of another kind than at the first launch")


def _globals_unchanged(fn, state: _Kernel) -> bool:
    """The globals the kernel read still equal the values it compiled with. Triton keeps deep
    copies of those values, so each compares by value once (Triton's constexprs build new
    objects to compare); the object found equal is remembered and later checks compare
    identities only."""
    missing = _globals_unchanged
    items = fn.used_global_vals.items()
    seen = state.globals_seen
    if len(seen) != len(items):
        seen = state.globals_seen = [missing] * len(items)
    for i, ((name, _), (value, scope)) in enumerate(items):
        now = scope.get(name, missing)
        if now is seen[i]:
            continue
        if now is not value and now != value:
            return False
        seen[i] = now
    return True


def _nothing_else_changed(fn, state: _Kernel) -> bool:
    """What a remembered launch relies on beyond its key: no pre-run hooks on the kernel, no
    launch hooks installed, and the globals the kernel read unchanged since it compiled."""
    return (
        not fn.pre_run_hooks
        and _RUNTIME.launch_enter_hook is _ENTER_HOOK
        and _RUNTIME.launch_exit_hook is _EXIT_HOOK
        and not _ENTER_HOOK.calls
        and not _EXIT_HOOK.calls
        and (not fn.used_global_vals or _globals_unchanged(fn, state))
    )


def _entry(kernel, target, keep: tuple):
    """What a direct launch needs, or None when this compiled kernel stays on the normal
    path (another backend, scratch buffers to allocate, an unexpected object)."""
    if getattr(target, "backend", None) != "cuda":
        return None
    function = getattr(kernel, "function", None)
    packed = getattr(kernel, "packed_metadata", None)
    if function is None or packed is None:
        return None
    run = kernel.run
    raw = getattr(run, "launch", None)
    try:
        direct = (
            raw is not None
            and run.global_scratch_size == 0
            and run.profile_scratch_size == 0
            and getattr(run, "num_ctas", 1) == 1
        )
        coop, pdl = (run.launch_cooperative_grid, run.launch_pdl) if direct else (False, False)
    except AttributeError:
        direct, coop, pdl = False, False, False
    return (direct, raw if direct else run, function, packed, coop, pdl, keep)


def jit_launch(fn, grid, *args, **kwargs):
    """``fn[grid](*args, **kwargs)`` through the launch cache (see the module docstring).

    ``fn`` is a ``triton.jit`` / ``gluon.jit`` kernel; ``grid`` a tuple of 1-3 ints (a
    callable grid takes the normal path). Returns what ``fn[grid]`` returns on the normal
    path (the compiled kernel) or None on a cached launch.

    Raises ``RuntimeError`` before launching when ``fn`` is an interpreted kernel (defined
    while ``TRITON_INTERPRET`` was on) and an argument is a tensor on a GPU: Triton's
    interpreter serves CPU tensors only here (the ``INTERPRET`` constexpr of our kernels
    follows the tensors' device)."""
    state = _KERNELS.get(id(fn))
    if state is None:
        state = _state(fn)
    if state.plain or not _enabled:
        if state.interpreted:
            _host_tensors_only(fn, args, kwargs)
        return fn[grid](*args, **kwargs)
    drv = driver.active
    if drv is not _DEVICE[0]:
        _refresh_device_functions(drv)
    dev = _DEVICE[1]()
    shape = state.shapes.get(tuple(kwargs))
    if shape is not None and shape.nargs == len(args) and type(grid) is tuple:
        try:
            key, launch = shape.prep(dev, *args, *kwargs.values())
            entry = shape.cache.get(key)
        except (AttributeError, TypeError):
            key = entry = None
        if entry is not None and fn.hash is state.hash and _nothing_else_changed(fn, state):
            state.hits += 1
            direct, run, function, packed, coop, pdl, _ = entry
            stream = _DEVICE[2](dev)
            n = len(grid)
            g0 = grid[0]
            g1 = grid[1] if n > 1 else 1
            g2 = grid[2] if n > 2 else 1
            if direct:
                run(g0, g1, g2, stream, function, coop, pdl, None, None, packed, None, None, None, *launch, *shape.tail)
            else:
                run(g0, g1, g2, stream, function, packed, None, None, None, *launch, *shape.tail)
            return None
        return _miss(state, fn, grid, args, kwargs, dev, shape, key)
    return _miss(state, fn, grid, args, kwargs, dev, shape, None)


def _miss(state: _Kernel, fn, grid, args, kwargs, dev, shape, key):
    """The normal path; remembers the compiled kernel under ``key`` when it can."""
    kernel = fn.run(*args, grid=grid, warmup=False, **kwargs)
    _DEVICE[0] = None  # CUDA is initialized now: take the C device getter at the next launch
    if type(grid) is not tuple or fn.pre_run_hooks or not _hooks_idle() or kernel is None:
        state.fallbacks += 1
        return kernel
    names = tuple(kwargs)
    try:
        _, _, target, backend, _ = fn.device_caches[dev]
        if getattr(target, "backend", None) != "cuda":
            state.plain = True  # ROCm and others: the normal path, always
            return kernel
        if names not in state.shapes:
            state.shapes[names] = _build_shape(fn, args, kwargs, backend)
        shape = state.shapes[names]
        if shape is None or shape.nargs != len(args):
            state.fallbacks += 1
            return kernel
        if len(shape.cache) >= _MAX_ENTRIES and not shape.by_value:
            # Fresh constexpr objects at every launch (identities never repeat): key by value.
            shape = state.shapes[names] = _build_shape(fn, args, kwargs, backend, by_value=True)
            key = None
        if key is None:
            key = shape.prep(dev, *args, *kwargs.values())[0]
        hash(key)
        keep = shape.keep(dev, *args, *kwargs.values())
    except (AttributeError, TypeError):
        state.fallbacks += 1
        return kernel
    if fn.hash is not state.hash:  # first launch, or the source changed: drop stale launches
        for other in state.shapes.values():
            if other is not None:
                other.cache.clear()
        state.hash = fn.hash
    entry = _entry(kernel, target, keep)
    if entry is None:
        state.fallbacks += 1
        return kernel
    if len(shape.cache) >= _MAX_ENTRIES:
        shape.cache.clear()
    shape.cache[key] = entry
    state.misses += 1
    return kernel


def launcher_stats(fn) -> dict[str, int]:
    """Cached launches (``hits``), launches that filled the cache (``misses``), launches
    that took the normal path without caching (``fallbacks``), :class:`BoundLaunch` launches
    that skipped :func:`jit_launch` (``direct``), and ``entries``."""
    state = _state(fn)
    entries = sum(len(shape.cache) for shape in state.shapes.values() if shape is not None)
    return {
        "hits": state.hits,
        "misses": state.misses,
        "fallbacks": state.fallbacks,
        "direct": state.direct,
        "entries": entries,
    }


def set_enabled(enabled: bool) -> bool:
    """Turn the cache on or off for every kernel; returns the previous setting."""
    global _enabled
    previous, _enabled = _enabled, bool(enabled)
    return previous


def clear() -> None:
    """Forget every remembered launch and descriptor encoding (Triton's own caches are untouched)."""
    _KERNELS.clear()
    _MEMO.clear()
    _DERIVED_STATS.update(encodes=0, kept=0)


class PendingDescriptor(NamedTuple):
    """A Gluon ``TensorDescriptor`` not built yet, ``fn(*args)``, at a varying position of a
    :class:`BoundLaunch`: a direct launch takes its encoding from the descriptor memo when
    ``key`` was encoded before, and builds it otherwise (see the module docstring).

    ``key``: a hashable of everything ``fn(*args)`` depends on, holding no tensor: each tensor
    argument by address, shape, strides, dtype and device (``fn`` never reads their contents),
    the others by value or by identity (an entry keeps those alive). ``args`` holds the run's
    tensors; the object lives for one run."""

    key: Hashable
    fn: Callable[..., Any]
    args: Sequence[Any]

    def build(self) -> Any:
        """The descriptor: ``fn(*args)``."""
        return self.fn(*self.args)


class _Encoded(NamedTuple):
    """A memo entry: a descriptor's launch arguments as the launcher's wrapper would encode
    them (``parts``: the CUDA tensor map, then the shape and strides), what a launch checks of
    the descriptor (its type, its base's dtype, block shape, layout), and the key's values
    named by identity (``keep``: never a tensor)."""

    parts: tuple
    kind: type
    dtype: torch.dtype
    block_shape: list[int]
    layout: Any
    keep: tuple


DESCRIPTOR_MEMO_LIMIT = 256  # entries of the descriptor memo (a model's layers' K/V caches fit)


class _DescriptorMemo:
    """The descriptor memo: an LRU from (a :class:`PendingDescriptor`'s key, a launcher's TMA
    metadata token) to :class:`_Encoded`, at most ``limit`` entries (the least recently used
    goes first), with hit and miss counts."""

    __slots__ = ("entries", "hits", "limit", "misses")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.entries: OrderedDict[Hashable, _Encoded] = OrderedDict()
        self.hits = self.misses = 0

    def get(self, key: Hashable) -> _Encoded | None:
        """The entry of ``key`` (now the most recent), or None."""
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
            self.hits += 1
        return entry

    def put(self, key: Hashable, pending: PendingDescriptor, descriptor: Any, parts: Sequence[Any]) -> None:
        """Remember ``parts``, the encoding of ``descriptor`` (``pending`` built), under
        ``key`` when the key determines it: no tensor among ``parts`` (a launcher handed the
        base tensor) and the descriptor's base at the address of a non-empty tensor among
        ``pending.args`` (not a buffer ``pending.fn`` allocated)."""
        self.misses += 1
        if self.limit <= 0 or any(isinstance(part, _TENSOR) for part in parts):
            return
        address = descriptor.base.data_ptr()
        if not any(type(a) is _TENSOR and a.numel() and a.data_ptr() == address for a in pending.args):
            return
        keep = tuple(a for a in pending.args if not isinstance(a, _TENSOR))
        entry = _Encoded(
            tuple(parts), type(descriptor), descriptor.base.dtype, list(descriptor.block_shape), descriptor.layout, keep
        )
        while len(self.entries) >= self.limit:
            self.entries.popitem(last=False)
        self.entries[key] = entry

    def clear(self) -> None:
        self.entries.clear()
        self.hits = self.misses = 0


_MEMO = _DescriptorMemo(DESCRIPTOR_MEMO_LIMIT)
_META_TOKENS: dict[Hashable, int] = {}  # (make, TMA metadata as a hashable) -> a small int


def _meta_token(make: Callable[..., Any] | None, meta: Any) -> int | None:
    """A small int naming the encoding function and its TMA metadata (swizzle, element type,
    block size, ...: one dict per descriptor argument of a compiled kernel), equal for equal
    metadata so that runners of one kernel share entries; None when nothing is memoized (no
    wrapper to unwrap, no metadata: the launcher is handed the base tensor)."""
    if make is None or not isinstance(meta, dict):
        return None
    try:
        named = (make, tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in meta.items()))
        return _META_TOKENS.setdefault(named, len(_META_TOKENS))
    except TypeError:  # an unhashable value
        return None


def descriptor_memo_stats() -> dict[str, int]:
    """The descriptor memo's ``hits`` (encodings reused), ``misses`` (descriptors built and
    encoded at a direct launch), ``entries`` and ``limit``."""
    return {"hits": _MEMO.hits, "misses": _MEMO.misses, "entries": len(_MEMO.entries), "limit": _MEMO.limit}


def _fits(hit: _Encoded, dtype: torch.dtype, desc: tuple) -> bool:
    """Whether a memo entry passes a bound launch's checks of its descriptor slot ``desc``
    (type, base dtype ``dtype``, layout, block shape, the encoding's width)."""
    kind, block_shape, layout, _, _, _, width = desc
    return (
        hit.kind is kind
        and hit.dtype is dtype
        and hit.layout is layout
        and hit.block_shape == block_shape
        and len(hit.parts) == width
    )


def _descriptor_parts(t: Any, dtype: torch.dtype, desc: tuple, dev: int) -> Sequence[Any] | None:
    """The launch arguments of ``t``, a varying descriptor or :class:`PendingDescriptor`, at a
    bound launch's slot ``desc`` (its first launch's descriptor type, block shape and layout,
    the encoding function, TMA metadata and its memo token, the encoding's width) whose base
    dtype is ``dtype``, on device ``dev``; None when ``t`` is unlike the slot's first (the
    launch takes :func:`jit_launch`: Triton's key or checks differ).

    A pending descriptor whose key the memo holds: its encoding, after the same checks on
    the entry. Otherwise the descriptor (built) is checked, encoded as Triton's launcher
    would (``make``: the tensor map of its base address, shape, strides and padding) and,
    when pending, remembered; without ``make`` it is passed whole (the launcher encodes it)."""
    kind, block_shape, layout, make, meta, token, width = desc
    pending = None
    if type(t) is PendingDescriptor:
        if token is not None:
            hit = _MEMO.get((t.key, token))
            if hit is not None:
                return hit.parts if _fits(hit, dtype, desc) else None
        pending, t = t, t.build()
    if type(t) is not kind or t.layout is not layout or t.block_shape != block_shape:
        return None
    base = t.base
    if type(base) is not _TENSOR or base.dtype is not dtype or _device_of(base) != dev:
        return None
    if base.data_ptr() & 15:
        return None  # Triton's path raises for it, as an uncached launch would
    if make is None:
        return (t,)  # the launcher encodes it
    parts = make(t, meta)
    if len(parts) != width:
        return None
    if pending is not None and token is not None:
        _MEMO.put((pending.key, token), pending, t, parts)
    return parts


class DerivedSlot(NamedTuple):
    """A varying position of a :class:`BoundLaunch` whose launch argument is a Gluon
    ``TensorDescriptor`` derived from the tensor passed there: ``fn(*args)`` with that tensor
    at ``args[at]`` (None there). ``fn`` depends on the tensor only through its address,
    shape, strides, dtype and device, never its contents, and on the other arguments only
    through their values (``_runners.derive_descriptor``'s contract), so a direct launch
    reuses the slot's encoding for a tensor of the slot's layout at an address it encoded
    before (:func:`_encode_derived`)."""

    fn: Callable[..., Any]
    args: tuple
    at: int
    # The bound part of the descriptor memo's key (``_runners._descriptor_head``), or None:
    # a slot's first launch at an address looks there before building (another runner of
    # the descriptor, e.g. another batch's over the same cache, may have encoded it).
    head: Hashable | None = None

    def build(self, t: Any) -> Any:
        """The descriptor over ``t``: ``fn(*args)`` with ``t`` at ``at``."""
        return self.fn(*self.call(t))

    def call(self, t: Any) -> list:
        """``fn``'s arguments with ``t`` at ``at``."""
        call = list(self.args)
        call[self.at] = t
        return call


DERIVED_SLOT_LIMIT = 256  # encodings per derived slot (a model's layers' K/V caches fit); a full slot is emptied
_DERIVED_STATS = {"encodes": 0, "kept": 0}


def _encode_derived(
    t: Any, address: int, dtype: torch.dtype, desc: tuple, slot: DerivedSlot, cache: dict, dev: int
) -> Sequence[Any] | None:
    """The launch arguments of a derived slot's descriptor over ``t`` (at ``address``; the
    direct launch checked its type, dtype, device, shape and strides against the slot's
    first launch) when ``cache`` holds none for that address: the descriptor memo's encoding
    of it when it has one (keyed as a pending descriptor's: the slot's ``head``, the tensor's
    address, shape, strides, dtype and device, the TMA metadata; checked like a pending one's
    hit), else built (``slot.build``), checked and encoded by :func:`_descriptor_parts` (the
    slot's base dtype ``dtype`` and descriptor check ``desc``). Kept in ``cache`` by address
    (and put in the memo) when the encoding is the tensor map of ``t``'s own memory: encoded
    here (not handed whole to the launcher), no tensor among it, the descriptor's base at
    ``address`` and ``t`` not empty (an empty tensor's descriptor is over a stand-in the
    builder allocated); a memo entry is one by the memo's own rule. A full ``cache`` is
    emptied first. None: the launch takes :func:`jit_launch`."""
    token = desc[5]
    key = None
    if slot.head is not None and token is not None:
        key = (slot.head, address, t.shape, t.stride(), t.dtype, t.device)
        hit = _MEMO.get((key, token))
        if hit is not None and _fits(hit, dtype, desc):
            _keep(cache, address, hit.parts)
            return hit.parts
    descriptor = slot.build(t)
    parts = _descriptor_parts(descriptor, dtype, desc, dev)
    _DERIVED_STATS["encodes"] += 1
    if (
        parts is not None
        and desc[3] is not None
        and t.numel()
        and descriptor.base.data_ptr() == address
        and not any(isinstance(part, _TENSOR) for part in parts)
    ):
        _keep(cache, address, parts)
        if key is not None:
            _MEMO.put((key, token), PendingDescriptor(key, slot.fn, slot.call(t)), descriptor, parts)
    return parts


def _keep(cache: dict, address: int, parts: Sequence[Any]) -> None:
    """``parts`` as a derived slot's encoding of ``address`` (a full slot emptied first)."""
    if len(cache) >= DERIVED_SLOT_LIMIT:
        cache.clear()
    cache[address] = parts
    _DERIVED_STATS["kept"] += 1


def derived_descriptor_stats() -> dict[str, int]:
    """The derived slots' descriptors built and encoded by a direct launch (``encodes``: a
    slot's first launch at an address the memo has no encoding of, or one whose encoding
    cannot be kept) and the encodings a slot kept (``kept``: encoded, or the memo's); a launch
    that finds its slot's encoding counts in neither."""
    return dict(_DERIVED_STATS)


class Launch(NamedTuple):
    """``fn[grid](*args, **kwargs)`` as data (a named tuple: cheap to build per call)."""

    fn: Any
    grid: tuple[int, ...]
    args: tuple
    kwargs: dict

    def __call__(self) -> None:
        """Launch it once, through :func:`jit_launch`."""
        jit_launch(self.fn, self.grid, *self.args, **self.kwargs)

    def bound(self, *varying: int) -> BoundLaunch:
        """The :class:`BoundLaunch` whose launches take new tensors at positions ``varying``."""
        return BoundLaunch(self.fn, self.grid, self.args, self.kwargs, varying)


class BoundLaunch:
    """``fn[grid](*args, **kwargs)`` bound once; ``launch(*values)`` launches it with
    ``values`` at the argument positions ``varying`` (tensors or Gluon ``TensorDescriptor``
    objects; placeholders there in ``args`` are replaced at every launch). ``derived``: per
    varying position None, or the :class:`DerivedSlot` whose descriptor the launch derives
    from the tensor passed there (empty: none).

    The first launch goes through :func:`jit_launch` (compiling if needed) and remembers the
    compiled kernel and the launch arguments with every tensor as its device address: the
    C launcher then neither calls ``data_ptr()`` nor asks the driver about the pointer
    (``cuPointerGetAttribute``) at every launch. The first launch, through Triton, validated
    the bound tensors; a varying tensor is checked here to be a plain ``torch.Tensor`` on the
    current device, of the remembered dtype and, for parameters Triton specializes on
    alignment, as 16-byte aligned as at the first launch. A later launch is direct when
    nothing the key covers changed: same device, same kernel source and globals, no launch
    hooks, those checks, and every bound tensor still at its remembered address. A varying
    descriptor is checked for what Triton's key reads of it (its base's dtype, its block shape,
    its layout: the first launch's object) and for a plain tensor base on the current device,
    16-byte aligned; it is then encoded for this launch as Triton's launcher would
    (``make_tensordesc_arg``: a CUDA tensor map of its base address, shape, strides and
    padding) and spliced into the pre-encoded arguments, the bound descriptors encoded once
    (:func:`_expand_descriptors`). A varying :class:`PendingDescriptor` whose key the
    descriptor memo holds takes the memo's encoding after the same checks on the entry, built
    and encoded nothing (:func:`_descriptor_parts`); elsewhere it is built. A derived slot's
    tensor is checked as a varying tensor is and for the first launch's shape and strides, and
    takes the slot's encoding of its address, or is built and encoded (:func:`_encode_derived`;
    see the module docstring). Otherwise
    it takes :func:`jit_launch` with the full arguments (correct, only slower), and a bound
    tensor that moved (``set_``) is remembered anew. The bound arguments are held by
    reference: their values (a plan's caches and tables, scalars) should not change; their
    contents may.
    """

    __slots__ = (
        "_args",
        "_bound",
        "_checks",
        "_derived",
        "_dev",
        "_direct",
        "_encoded",
        "_fast",
        "_fn",
        "_go",
        "_grid",
        "_hash",
        "_kwargs",
        "_layouts",
        "_slots",
        "_state",
        "_varying",
    )

    def __init__(
        self,
        fn,
        grid: tuple[int, ...],
        args: tuple,
        kwargs: dict,
        varying: tuple[int, ...],
        derived: Sequence[DerivedSlot | None] = (),
    ) -> None:
        if type(grid) is not tuple or not 1 <= len(grid) <= 3:
            raise TypeError(f"grid must be a tuple of 1-3 ints, got {grid!r}")
        if derived and len(derived) != len(varying):
            raise TypeError(f"derived: one entry per varying position ({len(varying)}), got {len(derived)}")
        self._fn = fn
        self._grid = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        self._args = list(args)
        self._kwargs = dict(kwargs)
        self._varying = tuple(varying)
        # Per varying position: None, or the DerivedSlot whose descriptor the launch derives
        # from the tensor passed there; after the first launch, that tensor's (dtype, shape,
        # strides) and the slot's encodings by address (:func:`_encode_derived`).
        self._derived: tuple = tuple(derived) if any(d is not None for d in derived) else ()
        self._layouts: tuple = ()
        self._encoded: tuple = ()
        # After the first launch: (run is the raw C launcher, run, function, packed, coop, pdl).
        self._direct = None
        self._go: Callable[..., bool | None] | None = None  # the generated direct launch (_compile)
        # Per varying position: (dtype, aligned or None, None for a tensor; for a descriptor
        # (its type, block shape, layout, make or None, meta, memo token, width of its encoding)).
        self._checks: tuple = ()
        self._fast: list = []  # the launch arguments: addresses for tensors, then the tail
        self._slots: tuple[int, ...] = ()  # where each varying tensor's address goes in _fast
        self._bound: tuple = ()  # (bound tensor, its remembered address)
        self._dev = self._hash = None
        self._state: _Kernel | None = None

    def __call__(self, *values) -> None:
        go = self._go
        if go is not None and len(values) == len(self._varying):
            done = go(*values)
            if done:
                return
            if done is None:  # a bound tensor moved: the full launch below remembers it anew
                self._go = self._direct = None
        if len(values) != len(self._varying):
            raise TypeError(f"{self._fn.__name__}: expected {len(self._varying)} varying arguments, got {len(values)}")
        args = self._args.copy()
        for position, value in zip(self._varying, values):
            args[position] = value.build() if type(value) is PendingDescriptor else value
        for position, slot, value in zip(self._varying, self._derived, values):
            if slot is not None:
                args[position] = slot.build(value)
        jit_launch(self._fn, self._grid, *args, **self._kwargs)
        if self._direct is None:
            self._remember(args, values)

    def _remember(self, args: list, values: Sequence[Any]) -> None:
        """After the first launch: the entry :func:`jit_launch` cached for these arguments
        (``values``: the varying ones as passed; a derived slot's tensor)."""
        fn = self._fn
        state = _KERNELS.get(id(fn))
        if state is None or state.plain or not _enabled:
            return
        shape = state.shapes.get(tuple(self._kwargs))
        if shape is None or shape.nargs != len(args):
            return
        dev = _DEVICE[1]()
        try:
            entry = shape.cache.get(shape.prep(dev, *args, *self._kwargs.values())[0])
        except (AttributeError, TypeError):
            return
        if entry is None:
            return
        kind = _descriptor_type()
        fast, checks, bound = [], {}, []
        for position, value in enumerate(args):
            if position in self._varying:
                if kind is not None and type(value) is kind:
                    base = value.base
                    if type(base) is not _TENSOR or _device_of(base) != dev:
                        return
                    # Triton keys a descriptor on its dtype, block shape and layout; the
                    # rest (base address, shape, strides, padding) is encoded per launch.
                    checks[position] = (base.dtype, True, (kind, list(value.block_shape), value.layout))
                    fast.append(value)  # its width is read below; replaced, never held
                    continue
                if type(value) is not _TENSOR:
                    return  # a varying argument that is neither a tensor nor a descriptor: never direct
                kp = fn.params[position]
                fixed = kp.do_not_specialize or kp.do_not_specialize_on_alignment
                checks[position] = (value.dtype, None if fixed else not value.data_ptr() & 15, None)
                fast.append(None)  # filled at each launch
            elif isinstance(value, _TENSOR):
                if type(value) is not _TENSOR or _device_of(value) != dev:
                    return  # a subclass (its data_ptr may differ per call) or another device
                fast.append(value.data_ptr())
                bound.append((value, fast[-1]))
            else:
                fast.append(value)
        direct, run, function, packed, coop, pdl, _ = entry
        fast, slots = fast + list(shape.tail), self._varying
        # Per varying slot: None (a tensor), or how a descriptor reaches the launcher: encoded
        # here per launch (make, meta, width), or passed whole (None, None, 1).
        encode: tuple = tuple(None if checks[p][2] is None else (None, None, 1) for p in slots)
        expanded = _expand_descriptors(run, fast, slots) if direct else None
        if expanded is not None:
            run, fast, slots, bases, encode = expanded
            bound.extend((t, t.data_ptr()) for t in bases)
        else:
            for p in slots:
                fast[p] = None  # no varying descriptor is held
        layouts = []
        for slot, value in zip(self._derived, values):
            if slot is not None and (type(value) is not _TENSOR or _device_of(value) != dev):
                return  # a derived slot's value must be a tensor on this device: never direct
            layouts.append(None if slot is None else (value.dtype, value.shape, value.stride()))
        self._checks = tuple(
            (dtype, aligned, None if how is None else (*desc, how[0], how[1], _meta_token(how[0], how[1]), how[2]))
            for (dtype, aligned, desc), how in zip((checks[p] for p in self._varying), encode)
        )
        self._layouts = tuple(layouts)
        self._encoded = tuple(None if slot is None else {} for slot in self._derived)
        self._fast, self._slots = fast, slots
        self._bound = tuple(bound)
        self._dev, self._hash, self._state = dev, state.hash, state
        self._direct = (direct, run, function, packed, coop, pdl)
        self._go = self._compile()

    def _compile(self) -> Callable[..., bool | None]:
        """The direct launch of the remembered arguments: a function of the varying values,
        generated for this launch's slots (:func:`_direct_source`), that checks what the key
        read (as the class docstring lists), launches and returns True; False to take
        :func:`jit_launch`, None when a bound tensor moved (remembered anew)."""
        raw, run, function, packed, coop, pdl = self._direct
        derived = tuple(
            None if slot is None else (slot, *layout, cache)
            for slot, layout, cache in zip(self._derived, self._layouts, self._encoded)
        )
        used = self._fn.used_global_vals
        if used:
            _globals_unchanged(self._fn, self._state)  # the objects found equal, read inline
        scopes = tuple((scope, name) for (name, _), (_, scope) in used.items())
        source, constants = _direct_source(
            raw, self._fast, self._slots, self._checks, len(self._bound), tuple(d is not None for d in derived),
            len(scopes),
        )  # fmt: skip
        make = _generated_factory(source, f"<direct launch of {self._fn.__name__}>", globals())
        return make(
            self._fn, self._state, self._dev, self._hash, run, function, packed, coop, pdl, self._grid,
            tuple(self._fast[i] for i in constants), tuple(self._checks), self._bound, derived, (used, scopes),
        )  # fmt: skip


_FACTORIES: dict[str, Callable[..., Any]] = {}  # generated source -> its factory


def _generated_factory(source: str, filename: str, scope: dict[str, Any]) -> Callable[..., Any]:
    """The ``make`` that generated ``source`` defines, compiled once per text and kept (the
    functions of one structure share it); ``scope``: the globals the generated code reads at
    every call (``filename`` names it in tracebacks). Used by :class:`BoundLaunch` and by the
    runner pipelines (``_runners``); their sources define different functions, never one text."""
    make = _FACTORIES.get(source)
    if make is None:
        namespace: dict[str, Any] = {}
        exec(compile(source, filename, "exec"), scope, namespace)
        make = _FACTORIES[source] = namespace["make"]
    return make


def _direct_source(
    raw: bool,
    fast: list,
    slots: tuple[int, ...],
    checks: tuple,
    bound: int,
    derived: tuple[bool, ...] = (),
    used_globals: int = 0,
) -> tuple[str, list[int]]:
    """The source of a factory ``make(...)`` of a :class:`BoundLaunch`'s direct launch, and the
    positions in ``fast`` of the constants it takes (in order): per varying value ``v{i}``, a
    tensor is checked for type, dtype, device and (where the key reads it) alignment and
    passed as its address, a descriptor goes through :func:`_descriptor_parts`, a derived
    slot's tensor (``derived[i]``) is checked for type, dtype, device, shape and strides (the
    first launch's) and its descriptor's encoding taken from the slot's by its address, else
    made (:func:`_encode_derived`); each bound
    tensor's address is compared with the remembered one. The module's globals (the switch,
    the driver, the hooks, ``_device_of``) are read at every launch, as before. What
    :func:`_nothing_else_changed` checks is inline: the hooks, and each of the kernel's
    ``used_globals`` globals by identity with the object last found equal (any doubt:
    :func:`_globals_unchanged`, which compares by value)."""
    n = len(slots)
    exprs: list[str | None] = [f"K{i}" for i in range(len(fast))]
    lines = [
        f"def direct({', '.join(f'v{i}' for i in range(n))}):",
        "    if not _enabled:",
        "        return False",
        "    drv = driver.active",
        "    if drv is not _DEVICE[0]:",
        "        _refresh_device_functions(drv)",
        "    dev = _DEVICE[1]()",
        "    if dev != DEV or FN.hash is not HASH:",
        "        return False",
        "    if (FN.pre_run_hooks or _RUNTIME.launch_enter_hook is not _ENTER_HOOK",
        "            or _RUNTIME.launch_exit_hook is not _EXIT_HOOK or _ENTER_HOOK.calls or _EXIT_HOOK.calls):",
        "        return False",
    ]
    if used_globals:
        same = " or ".join(f"GS{j}.get(GN{j}, _globals_unchanged) is not gs[{j}]" for j in range(used_globals))
        lines += [
            "    gs = STATE.globals_seen",
            f"    if FN.used_global_vals is not UGV or len(gs) != {used_globals} or {same}:",
            "        if not _globals_unchanged(FN, STATE):",
            "            return False",
        ]
    else:
        lines += [
            "    if FN.used_global_vals is not UGV and not _globals_unchanged(FN, STATE):",
            "        return False",
        ]
    lines += [f"    if BT{j}.data_ptr() != BP{j}:\n        return None" for j in range(bound)]
    for i, (position, (_, aligned, desc)) in enumerate(zip(slots, checks)):
        if derived and derived[i]:
            lines.append(
                f"    if (type(v{i}) is not _TENSOR or v{i}.dtype is not TD{i} or _device_of(v{i}) != dev\n"
                f"            or v{i}.shape != SH{i} or v{i}.stride() != ST{i}):\n        return False"
            )
            lines.append(f"    a{i} = v{i}.data_ptr()\n    e{i} = C{i}.get(a{i})\n    if e{i} is None:")
            lines.append(f"        e{i} = _encode_derived(v{i}, a{i}, DT{i}, DESC{i}, DS{i}, C{i}, dev)")
            lines.append(f"        if e{i} is None:\n            return False")
            exprs[position] = f"*e{i}"
            for covered in range(position + 1, position + desc[-1]):
                exprs[covered] = None
            continue
        if desc is None:
            lines.append(f"    if type(v{i}) is not _TENSOR or v{i}.dtype is not DT{i} or _device_of(v{i}) != dev:")
            lines.append("        return False")
            lines.append(f"    a{i} = v{i}.data_ptr()")
            if aligned is not None:
                lines.append(f"    if {'' if aligned else 'not '}a{i} & 15:\n        return False")
            exprs[position] = f"a{i}"
            continue
        lines.append(
            f"    e{i} = _descriptor_parts(v{i}, DT{i}, DESC{i}, dev)\n    if e{i} is None:\n        return False"
        )
        exprs[position] = f"*e{i}"
        for covered in range(position + 1, position + desc[-1]):
            exprs[covered] = None
    varying = {f"a{i}" for i in range(n)} | {f"*e{i}" for i in range(n)}
    constants = [i for i, e in enumerate(exprs) if e is not None and e not in varying]
    # The call's arguments: each run of consecutive constants one tuple splatted (``*KR{r}``,
    # a slice of K; ~40 % less than naming each of a Gluon launch's ~60 arguments, CPU).
    call, runs, k = [], [], 0
    for e in exprs:
        if e is None:
            continue
        if e in varying:
            call.append(e)
            continue
        if call and call[-1] == f"*KR{len(runs) - 1}" and runs[-1][1] == k:
            runs[-1][1] = k + 1
        else:
            call.append(f"*KR{len(runs)}")
            runs.append([k, k + 1])
        k += 1
    lines.append(f"    RUN(G0, G1, G2, _DEVICE[2](dev), *HEAD{', ' if call else ''}{', '.join(call)})")
    lines += ["    STATE.direct += 1", "    return True"]
    head = (
        "(FUNCTION, COOP, PDL, None, None, PACKED, None, None, None)" if raw else "(FUNCTION, PACKED, None, None, None)"
    )
    unpack = [f"    HEAD = {head}"] + [f"    KR{r} = K[{a}:{b}]" for r, (a, b) in enumerate(runs)]
    unpack += [f"    DT{i}, _, DESC{i} = CHECKS[{i}]" for i in range(n)]
    unpack += [f"    BT{j}, BP{j} = BOUND[{j}]" for j in range(bound)]
    unpack += [f"    DS{i}, TD{i}, SH{i}, ST{i}, C{i} = DERIVED[{i}]" for i in range(n) if derived and derived[i]]
    unpack += [f"    GS{j}, GN{j} = GLOBS[{j}]" for j in range(used_globals)]
    body = "\n".join("    " + line for line in "\n".join(lines).split("\n"))
    factory = (
        "def make(FN, STATE, DEV, HASH, RUN, FUNCTION, PACKED, COOP, PDL, GRID, K, CHECKS, BOUND, DERIVED, GLOBALS):\n"
        "    G0, G1, G2 = GRID\n    UGV, GLOBS = GLOBALS\n"
        + "\n".join(unpack)
        + ("\n" if unpack else "")
        + body
        + "\n    return direct\n"
    )
    return factory, constants


def _expand_descriptors(run, fast: list, slots: tuple[int, ...]):
    """For a kernel with Gluon ``TensorDescriptor`` arguments, Triton 3.6's raw launcher is a
    Python wrapper (``wrap_handle_tensordesc``) that encodes each descriptor into a CUDA
    tensor map at every launch (``make_tensordesc_arg``). A bound launch encodes its bound
    descriptors once here and only its varying ones per launch.

    ``fast``: the launch arguments in signature order, a varying descriptor's slot holding the
    first launch's descriptor (its encoding's width is read from it). Returns (the C launcher
    under the wrapper, the arguments with each bound descriptor encoded as the wrapper would
    and ``width`` placeholders per varying one, where each varying slot starts in them, the
    bound descriptors' base tensors, per varying slot None for a tensor or ``(make, meta,
    width)`` for a descriptor), or None (no wrapper, another Triton)."""
    code, cells = getattr(run, "__code__", None), getattr(run, "__closure__", None)
    if code is None or cells is None:
        return None
    free = dict(zip(code.co_freevars, cells))
    needed = ("launcher", "tensordesc_indices", "tensordesc_meta")
    make = run.__globals__.get("make_tensordesc_arg")
    if make is None or any(name not in free for name in needed):
        return None
    launcher, indices, meta = (free[name].cell_contents for name in needed)
    varying = set(slots)
    expanded, where, bases, encode, k = [], {}, [], {}, 0
    for i, value in enumerate(fast):
        where[i] = len(expanded)
        if i in indices:
            parts = make(value, meta[k])
            if i in varying:
                encode[i] = (make, meta[k], len(parts))
                expanded.extend([None] * len(parts))
            else:
                expanded.extend(parts)
                bases.append(value.base)
            k += 1
        else:
            expanded.append(value)
    return launcher, expanded, tuple(where[slot] for slot in slots), bases, tuple(encode.get(s) for s in slots)


_TENSOR = torch.Tensor
_device_of = _TENSOR.get_device  # the CUDA device index of a tensor; -1 for a CPU tensor
