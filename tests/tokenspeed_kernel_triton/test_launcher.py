"""The launch cache (``tokenspeed_kernel_triton._launcher``) on CPU, with a fake CUDA driver.

No GPU here, so Triton's compile is replaced by a fake that records what Triton asked to
compile and returns a stand-in compiled kernel whose C launcher records each launch. The
JIT function, its binder, Triton's own kernel cache and ``JITFunction.run`` are the real
ones: a launch that Triton would compile anew must miss the launch cache (and compile), and
a launch that hits must use the binary Triton compiled for that key, on the current stream.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.driver import CudaLauncher
from triton.compiler.compiler import CompiledKernel
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

from tokenspeed_kernel_triton import _launcher
from tokenspeed_kernel_triton._launcher import Launch


def _toy(X, Y, n, scale, FLAG: tl.constexpr, BLOCK: tl.constexpr = 16):
    pass


def _toy_nospec(X, n, m, BLOCK: tl.constexpr):
    pass


class _FakeDriver:
    """The few driver calls JITFunction.run and the launcher make."""

    def __init__(self) -> None:
        self.device = 0
        self.stream = 7
        self.launches: list = []

    def get_current_device(self):
        return self.device

    def get_current_stream(self, device):
        return self.stream + 1000 * device

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


def _fake_compiled(drv: _FakeDriver, number: int) -> CompiledKernel:
    kernel = object.__new__(CompiledKernel)
    kernel.module = "fake"  # handles "loaded": _init_handles returns at once
    kernel.function = 1000 + number
    kernel.packed_metadata = (4, 1, 0)
    kernel.name = f"fake{number}"
    kernel.src = None
    runner = object.__new__(CudaLauncher)
    runner.num_ctas = 1
    runner.global_scratch_size = runner.profile_scratch_size = 0
    runner.global_scratch_align = runner.profile_scratch_align = 1
    runner.launch_cooperative_grid = runner.launch_pdl = False

    def c_launch(gx, gy, gz, stream, function, coop, pdl, scratch, profile, packed, meta, enter, exit_, *args):
        drv.launches.append({"grid": (gx, gy, gz), "stream": stream, "function": function, "args": args})

    runner.launch = c_launch
    kernel._run = runner
    return kernel


@contextlib.contextmanager
def _fake_gpu(fn: JITFunction):
    drv = _FakeDriver()
    compiled: list = []
    previous = driver._active
    driver.set_active(drv)

    def do_compile(key, signature, device, constexprs, options, attrs, warmup):
        kernel = _fake_compiled(drv, len(compiled))
        compiled.append({"key": key, "signature": signature, "constexprs": constexprs, "device": device})
        fn.device_caches[device][0][key] = kernel
        fn.hash = fn.hash or "source-hash"
        return kernel

    fn._do_compile = do_compile
    try:
        yield drv, compiled
    finally:
        driver._active = previous
        del fn._do_compile


@pytest.fixture
def toy(monkeypatch):
    """A fresh JITFunction (built directly: under TRITON_INTERPRET=1 ``triton.jit`` would
    give an interpreter function) with the launch cache on, and the fake GPU."""
    monkeypatch.setattr(_launcher, "_interpreting", lambda: False)
    _launcher.clear()
    fn = JITFunction(_toy)
    with _fake_gpu(fn) as (drv, compiled):
        # The tensors here are CPU tensors standing for the fake GPU's: on its device.
        monkeypatch.setattr(_launcher, "_device_of", lambda t: drv.device if t.device.type == "cpu" else -2)
        yield fn, drv, compiled
    _launcher.clear()


def _tensors(dtype=torch.float32, offset=0):
    base = torch.randn(64 + offset, dtype=torch.float32).to(dtype)
    return base[offset:], torch.randn(64).to(dtype)


def _go(fn, x, y, n=32, scale=0.5, flag=True, **opts):
    return _launcher.jit_launch(fn, (3, 2), x, y, n, scale, FLAG=flag, **opts)


def test_equal_keys_reuse_the_binary_on_the_current_stream(toy):
    fn, drv, compiled = toy
    x, y = _tensors()
    _go(fn, x, y)
    x2, y2 = _tensors()  # other tensors, same dtypes and alignment
    drv.stream = 9
    assert _go(fn, x2, y2, n=48) is None  # a cached launch returns None
    assert len(compiled) == 1
    assert _launcher.launcher_stats(fn) == {"hits": 1, "misses": 1, "fallbacks": 0, "direct": 0, "entries": 1}
    last = drv.launches[-1]
    assert last["stream"] == 9 and last["grid"] == (3, 2, 1) and last["function"] == 1000
    # signature order, then the constexpr slots (skipped by the C launcher): FLAG, BLOCK default
    # Tensors go to the C launcher as their addresses (no data_ptr()/driver query per tensor there).
    assert last["args"][:4] == (x2.data_ptr(), y2.data_ptr(), 48, 0.5) and len(last["args"]) == 6
    assert last["args"][5] == 16


class _Elsewhere(torch.Tensor):
    """A tensor that reports another device index (a CPU tensor after a GPU one, or another GPU)."""

    def get_device(self):
        return 3


def test_a_tensor_on_another_device_misses_and_takes_tritons_checked_path(toy):
    fn, drv, _compiled = toy
    x, y = _tensors()
    _go(fn, x, y)
    _go(fn, x, y)
    elsewhere = torch.Tensor._make_subclass(_Elsewhere, _tensors()[0])
    _go(fn, elsewhere, y)  # the key holds each tensor's device index: a miss, not a direct launch
    assert _launcher.launcher_stats(fn)["hits"] == 1
    assert drv.launches[-1]["args"][0] is elsewhere, "Triton's own path got the tensor, not an address"


# Each variant changes one thing that Triton specializes on: Triton compiles a new binary,
# and the launch cache must miss, then use that new binary.
VARIANTS = {
    "dtype": dict(x=lambda: _tensors(torch.bfloat16)[0]),
    "misaligned pointer": dict(x=lambda: _tensors(offset=1)[0]),
    "int == 1": dict(n=1),
    "int not divisible by 16": dict(n=33),
    "int64 range": dict(n=2**40),
    "uint64 range": dict(n=2**63 + 16),
    "constexpr value": dict(flag=False),
    "num_warps": dict(num_warps=8),
    "num_stages": dict(num_stages=2),
    "None for a runtime arg": dict(y=lambda: None),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_changed_key_recompiles(toy, name):
    fn, drv, compiled = toy
    x, y = _tensors()
    _go(fn, x, y)
    _go(fn, x, y)
    assert len(compiled) == 1
    change = {k: (v() if callable(v) else v) for k, v in VARIANTS[name].items()}
    args = {"x": x, "y": y, "n": 32, "flag": True}
    opts = {k: change.pop(k) for k in ("num_warps", "num_stages") if k in change}
    args.update(change)
    _go(fn, args["x"], args["y"], args["n"], flag=args["flag"], **opts)
    assert len(compiled) == 2, "Triton compiled a new binary"
    _go(fn, args["x"], args["y"], args["n"], flag=args["flag"], **opts)  # now cached (or normal path)
    assert len(compiled) == 2
    assert drv.launches[-1]["function"] == 1001, "the launch used the new binary"
    _go(fn, x, y)  # the first key still launches the first binary
    assert drv.launches[-1]["function"] == 1000


def test_device_is_part_of_the_key(toy):
    fn, drv, compiled = toy
    x, y = _tensors()
    _go(fn, x, y)
    drv.device = 1
    _go(fn, x, y)
    _go(fn, x, y)
    assert len(compiled) == 2 and compiled[1]["device"] == 1
    assert drv.launches[-1]["function"] == 1001 and drv.launches[-1]["stream"] == 1007


def test_key_function_distinguishes_what_triton_does():
    """The generated key on its own: equal kinds give equal keys; a change in dtype,
    alignment, int class, constexpr or option gives a different key."""
    fn = JITFunction(_toy)
    from triton.backends.nvidia.compiler import CUDABackend

    backend = CUDABackend(GPUTarget("cuda", 90, 32))
    x, y = _tensors()
    shape = _launcher._build_shape(fn, (x, y, 32, 0.5), {"FLAG": True, "num_warps": 4}, backend)

    def key(x=x, y=y, n=32, scale=0.5, flag=True, warps=4, dev=0):
        return shape.prep(dev, x, y, n, scale, flag, warps)[0]

    same = key(x=_tensors()[0], y=_tensors()[1], n=64, scale=2.0)
    assert key() == same
    for changed in (
        key(x=_tensors(torch.float16)[0]),
        key(x=_tensors(offset=1)[0]),
        key(n=1),
        key(n=31),
        key(n=2**33),
        key(flag=False),
        key(warps=8),
        key(dev=1),
    ):
        assert changed != key()


def test_do_not_specialize_is_respected(monkeypatch):
    """A do_not_specialize int: Triton compiles one binary for 16 and 17, and so the key
    must not split them (only the i32/i64 range still matters)."""
    monkeypatch.setattr(_launcher, "_interpreting", lambda: False)
    _launcher.clear()
    fn = JITFunction(_toy_nospec, do_not_specialize=["n"], do_not_specialize_on_alignment=["X"])
    with _fake_gpu(fn) as (_drv, compiled):
        a = torch.randn(65)
        _launcher.jit_launch(fn, (1,), a[1:], 16, 16, BLOCK=8)
        _launcher.jit_launch(fn, (1,), a[:64], 17, 16, BLOCK=8)  # aligned X, n % 16 != 0: same binary
        assert len(compiled) == 1
        assert _launcher.launcher_stats(fn)["hits"] == 1
        _launcher.jit_launch(fn, (1,), a[:64], 17, 17, BLOCK=8)  # m is specialized
        assert len(compiled) == 2
    _launcher.clear()


def test_runtime_arg_by_keyword_takes_the_normal_path(toy):
    fn, drv, compiled = toy
    x, y = _tensors()
    for _ in range(2):
        _launcher.jit_launch(fn, (1,), x, y, 32, scale=0.5, FLAG=True)
    stats = _launcher.launcher_stats(fn)
    assert stats["hits"] == 0 and stats["entries"] == 0 and stats["fallbacks"] == 2
    assert len(drv.launches) == 2 and len(compiled) == 1


def test_a_kind_change_falls_back_and_stays_correct(toy):
    """A tensor at the first launch, a float later for the same parameter: the generated key
    raises, the launch takes Triton's path (which compiles for the float)."""
    fn, drv, compiled = toy
    x, y = _tensors()
    _go(fn, x, y)
    _launcher.jit_launch(fn, (1,), x, 2.0, 32, 0.5, FLAG=True)
    assert len(compiled) == 2 and drv.launches[-1]["function"] == 1001


def test_launch_hooks_take_the_normal_path(toy):
    fn, _drv, _compiled = toy
    x, y = _tensors()
    seen = []
    hook = seen.append
    _launcher._ENTER_HOOK.add(hook)
    try:
        _go(fn, x, y)
        _go(fn, x, y)
    finally:
        _launcher._ENTER_HOOK.remove(hook)
    assert _launcher.launcher_stats(fn)["hits"] == 0
    _go(fn, x, y)
    _go(fn, x, y)
    assert _launcher.launcher_stats(fn)["hits"] == 1


def test_changed_source_hash_drops_the_cache(toy):
    fn, _drv, _compiled = toy
    x, y = _tensors()
    _go(fn, x, y)
    fn.hash = "edited"  # what _unsafe_update_src + recompiling would leave
    _go(fn, x, y)
    assert _launcher.launcher_stats(fn)["hits"] == 0
    _go(fn, x, y)
    assert _launcher.launcher_stats(fn)["hits"] == 1


def test_fresh_constexpr_objects_switch_the_shape_to_values(toy, monkeypatch):
    """Identity keys for non-plain constexprs; a call site that builds a new object at every
    launch overflows its shape, which is rebuilt to key by value."""
    fn, _drv, _compiled = toy
    monkeypatch.setattr(_launcher, "_MAX_ENTRIES", 4)

    class Layout(tuple):
        pass

    x, y = _tensors()
    for _ in range(6):
        _go(fn, x, y, flag=Layout((1, 2)))
    shape = _launcher._KERNELS[id(fn)].shapes[("FLAG",)]
    assert shape.by_value
    _go(fn, x, y, flag=Layout((1, 2)))
    assert _launcher.launcher_stats(fn)["hits"] >= 1


def _bound(fn, x, y, n=32):
    """x varies per launch (position 0); y, n, scale, FLAG are bound."""
    return _launcher.BoundLaunch(fn, (3, 2), (None, y, n, 0.5), {"FLAG": True}, varying=(0,))


def test_bound_launch_is_direct_after_the_first(toy):
    fn, drv, compiled = toy
    x, y = _tensors()
    launch = _bound(fn, x, y)
    launch(x)  # through jit_launch: compiles, fills the cache
    stats = _launcher.launcher_stats(fn)
    x2, _ = _tensors()
    drv.stream = 5
    launch(x2)
    launch(x2)
    # Direct launches bypass jit_launch (no hit, miss, fallback or entry there) and count apart.
    assert _launcher.launcher_stats(fn) == {**stats, "direct": 2}
    assert len(compiled) == 1
    last = drv.launches[-1]
    assert last["function"] == 1000 and last["stream"] == 5 and last["grid"] == (3, 2, 1)
    # Tensors go to the C launcher as their addresses: no data_ptr() / driver query there.
    assert last["args"][:4] == (x2.data_ptr(), y.data_ptr(), 32, 0.5)
    assert len(last["args"]) == 6 and last["args"][5] == 16


def test_bound_launch_follows_a_bound_tensor_that_moved(toy):
    """A bound tensor re-pointed (``set_``) to aligned memory: same binary, new address,
    never the stale one."""
    fn, drv, compiled = toy
    x, y = _tensors()
    launch = _bound(fn, x, y)
    launch(x)
    launch(x)
    y.set_(torch.randn(64).untyped_storage(), 0, (64,))
    launch(x)  # the full path (tensors), then remembered anew
    launch(x)
    assert len(compiled) == 1
    assert drv.launches[-1]["args"][:2] == (x.data_ptr(), y.data_ptr())


def test_bound_launch_takes_the_full_path_for_another_device_or_count(toy):
    fn, drv, _compiled = toy
    x, y = _tensors()
    launch = _bound(fn, x, y)
    launch(x)
    drv.device = 1  # the current device changed: nothing direct, Triton's own path
    launch(x)
    assert drv.launches[-1]["args"][0] is x and drv.launches[-1]["stream"] == 1007
    drv.device = 0
    launch(x)
    assert drv.launches[-1]["args"][0] == x.data_ptr()
    with pytest.raises(TypeError, match="expected 1 varying arguments, got 2"):
        launch(x, x)


BOUND_CHANGES = {
    "varying dtype": lambda x, y: (_tensors(torch.bfloat16)[0], y),
    "varying misaligned": lambda x, y: (_tensors(offset=1)[0], y),
    "bound tensor re-pointed misaligned": lambda x, y: (x, y.set_(torch.randn(65).untyped_storage(), 1, (64,))),
}


@pytest.mark.parametrize("name", list(BOUND_CHANGES))
def test_bound_launch_takes_the_full_path_when_the_key_would_change(toy, name):
    fn, drv, compiled = toy
    x, y = _tensors()
    launch = _bound(fn, x, y)
    launch(x)
    launch(x)
    x2, _ = BOUND_CHANGES[name](x, y)
    launch(x2)
    assert len(compiled) == 2, "Triton compiled the binary for the new key"
    assert drv.launches[-1]["function"] == 1001 and drv.launches[-1]["args"][0] is x2
    launch(x)  # x again: the first binary, unless the bound y stays misaligned
    assert drv.launches[-1]["function"] == (1001 if name == "bound tensor re-pointed misaligned" else 1000)


def test_a_slot_first_launched_misaligned_stays_direct_only_while_misaligned(toy):
    """The generated direct launch checks alignment both ways: a slot whose first tensor was
    misaligned (Triton specialized it so) takes the full path for an aligned one."""
    fn, drv, compiled = toy
    x, y = _tensors(offset=1)
    launch = _bound(fn, x, y)
    launch(x)
    launch(_tensors(offset=3)[0])
    assert _launcher.launcher_stats(fn)["direct"] == 1
    aligned, _ = _tensors()
    launch(aligned)
    assert _launcher.launcher_stats(fn)["direct"] == 1 and len(compiled) == 2
    assert drv.launches[-1]["args"][0] is aligned


def test_launches_of_one_structure_share_a_generated_factory(toy):
    fn, drv, _compiled = toy
    x, y = _tensors()
    first, second = _bound(fn, x, y), _bound(fn, x, y, n=48)
    for launch in (first, second, first, second):
        launch(x)
    assert _launcher.launcher_stats(fn)["direct"] == 2
    assert first._go is not second._go and first._go.__code__ is second._go.__code__
    assert [d["args"][2] for d in drv.launches[-2:]] == [32, 48], "each keeps its own bound values"


def _through_jit_launch(fn) -> int:
    """Launches that went through jit_launch (a direct bound launch counts nowhere)."""
    stats = _launcher.launcher_stats(fn)
    return stats["hits"] + stats["misses"] + stats["fallbacks"]


def test_bound_launch_respects_hooks_hash_device_and_the_switch(toy):
    fn, drv, compiled = toy
    x, y = _tensors()
    launch = _bound(fn, x, y)
    launch(x)
    launch(x)
    assert _through_jit_launch(fn) == 1, "the second launch was direct"
    hook = lambda *a: None  # noqa: E731
    _launcher._ENTER_HOOK.add(hook)
    try:
        launch(x)
    finally:
        _launcher._ENTER_HOOK.remove(hook)
    assert _through_jit_launch(fn) == 2 and _launcher.launcher_stats(fn)["fallbacks"] == 1
    drv.device = 1
    launch(x)
    assert compiled[-1]["device"] == 1 and drv.launches[-1]["stream"] == 1007 and _through_jit_launch(fn) == 3
    drv.device = 0
    previous = _launcher.set_enabled(False)
    try:
        launch(x)  # Triton's own path: not even counted
        assert len(drv.launches) == 5
    finally:
        _launcher.set_enabled(previous)
    fn.hash = "edited"
    launch(x)
    assert _through_jit_launch(fn) == 4
    assert drv.launches[-1]["function"] == 1000 and len(drv.launches) == 6


def test_bound_launch_checks_the_kernels_globals_and_every_hook_inline(toy):
    """The direct launch's inline checks (what ``_nothing_else_changed`` checks): a global the
    kernel read, rebound to another object of the same value, stays direct (the new object
    remembered); another value takes Triton's path, which raises; an exit hook or a pre-run
    hook on the kernel takes the normal path too."""
    fn, _drv, _compiled = toy
    x, y = _tensors()
    scope = {"G": (1, 2), "H": 3}
    fn.used_global_vals = {("G", id(scope)): ((1, 2), scope), ("H", id(scope)): (3, scope)}
    launch = _bound(fn, x, y)
    launch(x)
    launch(x)
    assert _through_jit_launch(fn) == 1, "direct with its globals unchanged"
    scope["G"] = (1, 2)  # another object, the same value
    launch(x)
    launch(x)
    assert _through_jit_launch(fn) == 1 and _launcher.launcher_stats(fn)["direct"] == 3
    hook = lambda *a, **kw: None  # noqa: E731
    _launcher._EXIT_HOOK.add(hook)
    try:
        launch(x)
    finally:
        _launcher._EXIT_HOOK.remove(hook)
    fn.pre_run_hooks.append(hook)
    try:
        launch(x)
    finally:
        fn.pre_run_hooks.remove(hook)
    assert _through_jit_launch(fn) == 3
    launch(x)
    assert _through_jit_launch(fn) == 3, "direct again"
    scope["H"] = 4
    with pytest.raises(RuntimeError, match="Global variable H has changed"):
        launch(x)


def test_bound_launch_never_direct_for_a_varying_non_tensor(toy):
    fn, drv, _compiled = toy
    x, y = _tensors()
    launch = _launcher.BoundLaunch(fn, (1,), (x, y, 32, None), {"FLAG": True}, varying=(3,))
    launch(0.5)
    launch(0.25)
    assert launch._direct is None and drv.launches[-1]["args"][3] == 0.25
    with pytest.raises(TypeError, match="grid"):
        _launcher.BoundLaunch(fn, [1], (x,), {}, varying=())


def test_interpreter_and_disabled_take_the_plain_path(monkeypatch):
    """Under TRITON_INTERPRET=1 nothing is cached: the kernel's own ``[grid]`` path runs."""
    _launcher.clear()
    fn = JITFunction(_toy)
    monkeypatch.setattr(_launcher, "_interpreting", lambda: True)
    with _fake_gpu(fn) as (drv, compiled):
        x, y = _tensors()
        _go(fn, x, y)
        _go(fn, x, y)
        assert len(drv.launches) == 2 and len(compiled) == 1
        assert _launcher.launcher_stats(fn) == {"hits": 0, "misses": 0, "fallbacks": 0, "direct": 0, "entries": 0}
    _launcher.clear()
    monkeypatch.setattr(_launcher, "_interpreting", lambda: False)
    previous = _launcher.set_enabled(False)
    fn = JITFunction(_toy)
    try:
        with _fake_gpu(fn) as (drv, _compiled):
            _go(fn, x, y)
            _go(fn, x, y)
            assert _launcher.launcher_stats(fn)["hits"] == 0 and len(drv.launches) == 2
    finally:
        _launcher.set_enabled(previous)
        _launcher.clear()


def test_interpreted_kernels_are_never_cached():
    """The real test setup: kernels built by triton.jit under the interpreter."""
    from tokenspeed_kernel_triton.ops.kvcache.store import _store_rows

    if isinstance(_store_rows, JITFunction):
        pytest.skip("not under the Triton interpreter (a GPU run): nothing to check here")
    assert _launcher._state(_store_rows).plain


def _add_one(X, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(X + offs, tl.load(X + offs) + 1.0)


def test_an_interpreted_kernel_runs_on_cpu_tensors_and_refuses_gpu_ones():
    """A kernel defined while TRITON_INTERPRET was on is Triton's InterpretedFunction: it runs
    on CPU tensors, and a GPU tensor (here on the meta device: any device but the CPU) is a
    RuntimeError before anything runs, naming the cause, instead of a silent launch in the
    interpreter (whose INTERPRET constexpr would be off: our kernels take it from the device)."""
    from triton.runtime.interpreter import InterpretedFunction

    _launcher.clear()
    fn = InterpretedFunction(_add_one)
    try:
        x = torch.zeros(8)
        _launcher.jit_launch(fn, (1,), x, N=8)
        assert torch.equal(x, torch.ones(8)) and _launcher._state(fn).interpreted
        with pytest.raises(RuntimeError, match=r"_add_one: got meta tensors.*defined while TRITON_INTERPRET was on"):
            _launcher.jit_launch(fn, (1,), torch.zeros(8, device="meta"), N=8)
        with pytest.raises(RuntimeError, match="got meta tensors"):  # a keyword tensor too
            _launcher.jit_launch(fn, (1,), X=torch.zeros(8, device="meta"), N=8)
        assert not _launcher._state(JITFunction(_toy)).interpreted
    finally:
        _launcher.clear()


def _descriptor_wrapper(calls: list):
    """Triton's own tensor-descriptor wrapper (``wrap_handle_tensordesc``) around a fake C
    launch recording its arguments; the kernel's argument 1 is a descriptor."""
    from triton.backends.nvidia.driver import wrap_handle_tensordesc

    def c_launch(*args):
        calls.append(args)

    signature = {0: "*fp32", 1: "tensordesc<i32[32, 32]>", 2: "i32"}
    return c_launch, wrap_handle_tensordesc(c_launch, signature, None)


def test_bound_descriptors_are_expanded_once_as_triton_would():
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    base = torch.zeros(64, 32, dtype=torch.int32)
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    desc = TensorDescriptor(base, [64, 32], [32, 1], [32, 32], layout)
    calls: list = []
    c_launch, wrapper = _descriptor_wrapper(calls)
    head = (1, 1, 1, 7, 1000, False, False, None, None, (4, 1, 0), None, None, None)
    fast = [1234, desc, 5]
    launcher, expanded, slots, bases, encode = _launcher._expand_descriptors(wrapper, fast, (0,))
    assert launcher is c_launch and slots == (0,) and bases == [base] and encode == (None,)
    wrapper(*head, *fast)
    launcher(*head, *expanded)
    assert len(calls) == 2 and len(calls[0]) == len(calls[1])
    assert all(a is b or a == b for a, b in zip(calls[0], calls[1])), "the same arguments reach the C launch"
    assert expanded[-1] == 5 and expanded[0] == 1234
    assert _launcher._expand_descriptors(wrapper, fast, (2, 0))[2] == (len(expanded) - 1, 0)
    # A varying descriptor: placeholders of its encoding's width, encoded per launch.
    launcher, varying, slots, bases, encode = _launcher._expand_descriptors(wrapper, fast, (1,))
    width = len(expanded) - 2
    assert slots == (1,) and bases == [] and varying[1 : 1 + width] == [None] * width
    make, meta, n = encode[0]
    assert n == width and meta is None and make(desc, meta) == expanded[1 : 1 + width]
    # A launcher without the wrapper: nothing to expand (the launcher encodes them itself).
    assert _launcher._expand_descriptors(c_launch, fast, (0,)) is None


# --- varying descriptors: encoded per launch as Triton's own launcher would ---------------


def _toy_desc(X, D, E, n, FLAG: tl.constexpr):
    pass


_TMA_META = {"swizzle": 128, "elem_size": 2, "elem_type": 10, "block_size": [32, 64], "fp4_padded": False}


@pytest.fixture
def desc_toy(monkeypatch):
    """A kernel with descriptor arguments D and E (positions 1 and 2) on the fake GPU, whose
    compiled kernels' raw launcher is Triton's own descriptor wrapper (with TMA metadata, as
    a Gluon kernel's) around the fake C launch; the fake driver's ``fill_tma_descriptor``
    returns a tuple of what it was asked to encode and counts its calls."""
    from types import SimpleNamespace

    from triton.backends.nvidia.driver import wrap_handle_tensordesc

    monkeypatch.setattr(_launcher, "_interpreting", lambda: False)
    _launcher.clear()
    fn = JITFunction(_toy_desc)
    encoded: list = []

    def fill(ptr, swizzle, elem_size, elem_type, block, shape, strides, padding):
        encoded.append(ptr)
        return ("map", ptr, swizzle, elem_type, tuple(block), tuple(shape), tuple(strides), padding)

    with _fake_gpu(fn) as (drv, compiled):
        drv.utils = SimpleNamespace(fill_tma_descriptor=fill)
        make = fn._do_compile

        def do_compile(key, signature, device, constexprs, options, attrs, warmup):
            kernel = make(key, signature, device, constexprs, options, attrs, warmup)
            count = sum(str(sig).startswith("tensordesc") for sig in signature.values())
            kernel._run.launch = wrap_handle_tensordesc(kernel._run.launch, signature, [_TMA_META] * count)
            return kernel

        fn._do_compile = do_compile
        monkeypatch.setattr(_launcher, "_device_of", lambda t: drv.device if t.device.type == "cpu" else -2)
        yield fn, drv, compiled, encoded
    _launcher.clear()


def _layout():
    """The NVMMA layout of a ``[32, 64]`` bf16 box (a new object per call)."""
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for([32, 64], gl.bfloat16)


_LAYOUT = _layout()  # the layout object the descriptors share (a cached config's)


def _desc(rows=64, dtype=torch.bfloat16, block=(32, 64), layout=_LAYOUT, padding="zero"):
    """A descriptor over a new ``[rows, 64]`` tensor."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    base = torch.randn(rows, 64).to(dtype)
    return TensorDescriptor(base, [rows, 64], [64, 1], list(block), layout, padding)


def _triton_args(fn, drv, x, d, e):
    """What Triton's own path hands the C launch for these arguments (cache off)."""
    previous = _launcher.set_enabled(False)
    try:
        _launcher.jit_launch(fn, (2,), x, d, e, 9, FLAG=True)
    finally:
        _launcher.set_enabled(previous)
    return drv.launches.pop()["args"]


def _same_args(got: tuple, want: tuple) -> bool:
    return len(got) == len(want) and all(a is b or (type(a) is type(b) and a == b) for a, b in zip(got, want))


def test_bound_launch_encodes_varying_descriptors_per_launch(desc_toy):
    """X (a tensor) and D (a descriptor) vary, E (a descriptor) is bound: each direct launch
    encodes D's tensor map anew (its base, shape, strides, padding) and E's never again; the C
    launch gets the same arguments as Triton's own path with the full arguments."""
    fn, drv, compiled, encoded = desc_toy
    x, e = torch.randn(8).to(torch.bfloat16), _desc(128)
    launch = _launcher.BoundLaunch(fn, (2,), (None, None, e, 9), {"FLAG": True}, varying=(0, 1))
    launch(x, _desc())  # through jit_launch: compiles, fills the cache
    for rows, padding in ((64, "zero"), (96, "zero"), (64, "nan")):
        x2, d2 = torch.randn(8).to(torch.bfloat16), _desc(rows, padding=padding)
        before, direct = len(encoded), _launcher.launcher_stats(fn)["direct"]
        launch(x2, d2)
        assert _launcher.launcher_stats(fn)["direct"] == direct + 1, "a direct launch"
        assert encoded[before:] == [d2.base.data_ptr()], "only the varying descriptor is encoded"
        got = drv.launches[-1]["args"]
        assert got[0] == x2.data_ptr() and got[1] == ("map", d2.base.data_ptr(), 128, 9, (32, 64), (rows, 64), (64, 1),
                                                     1 if padding == "nan" else 0)  # fmt: skip
        want = _triton_args(fn, drv, x2, d2, e)
        # (the last slot is FLAG's, a constexpr the C launch skips: None here, its value there)
        assert want[0] is x2 and _same_args(got[1:-1], want[1:-1]), "Triton's own encoding of the same arguments"
    assert len(compiled) == 1
    width = launch._checks[1][2][-1]  # the tensor map, then the shape and strides
    assert width == 5 and launch._fast[1 : 1 + width] == [None] * width, "no varying descriptor's encoding is held"


DESC_CHANGES = {
    # (the changed descriptor, whether Triton compiles anew: its key changed)
    "another block shape": (lambda: _desc(block=(16, 64)), True),
    "another dtype": (lambda: _desc(dtype=torch.float16), True),
    "an equal layout, another object": (lambda: _desc(layout=_layout()), False),
    "a tensor, not a descriptor": (lambda: torch.zeros(64, 64, dtype=torch.bfloat16), True),
}


@pytest.mark.parametrize("name", list(DESC_CHANGES))
def test_a_varying_descriptor_unlike_the_first_takes_the_full_path(desc_toy, name):
    fn, _drv, compiled, _encoded = desc_toy
    x, e = torch.randn(8).to(torch.bfloat16), _desc(128)
    launch = _launcher.BoundLaunch(fn, (2,), (None, None, e, 9), {"FLAG": True}, varying=(0, 1))
    launch(x, _desc())
    launch(x, _desc())
    direct = _launcher.launcher_stats(fn)["direct"]
    assert direct == 1
    changed, recompiles = DESC_CHANGES[name]
    launch(x, changed())
    assert _launcher.launcher_stats(fn)["direct"] == direct, "not direct"
    assert len(compiled) == (2 if recompiles else 1)
    launch(x, _desc())  # like the first again: direct
    assert _launcher.launcher_stats(fn)["direct"] == direct + 1


def test_a_varying_descriptor_over_a_misaligned_base_takes_tritons_path(desc_toy):
    fn, _drv, _compiled, encoded = desc_toy
    x, e = torch.randn(8).to(torch.bfloat16), _desc(128)
    launch = _launcher.BoundLaunch(fn, (2,), (None, None, e, 9), {"FLAG": True}, varying=(0, 1))
    launch(x, _desc())
    bad = _desc()
    object.__setattr__(bad, "base", torch.randn(64 * 64 + 1).to(torch.bfloat16)[1:].view(64, 64))
    launch(x, bad)  # Triton's path (here the fake encoder accepts it; a GPU's raises)
    assert _launcher.launcher_stats(fn)["direct"] == 0 and encoded[-2:] == [bad.base.data_ptr(), e.base.data_ptr()]


def test_a_varying_descriptor_is_passed_whole_to_a_launcher_that_encodes_it(toy):
    """Without Triton's wrapper to unwrap (here the fake C launch itself), a varying
    descriptor reaches the launcher as the object, checked as above."""
    fn, drv, _compiled = toy
    x, _y = _tensors()
    launch = _launcher.BoundLaunch(fn, (3, 2), (x, None, 32, 0.5), {"FLAG": True}, varying=(1,))
    launch(_desc())
    d = _desc()
    launch(d)
    assert _launcher.launcher_stats(fn)["direct"] == 1 and drv.launches[-1]["args"][1] is d
    assert launch._fast[1] is None


def _rows_desc(x, rows, layout):
    """A derived descriptor (``derive_descriptor``): ``x [n, 64]``, box ``[rows, 64]``."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor(x, list(x.shape), list(x.stride()), [rows, 64], layout)


def test_a_runners_derived_descriptors_reuse_their_slots_encoding_and_launch_tritons(desc_toy):
    """A runner's pipeline with D derived from an input per run (two "layers" a and b, run
    alternately): the input reaches the bound launch, whose derived slot builds and encodes
    D at the first direct launch of each layer's tensor and later takes the slot's encoding
    of that address (nothing encoded, the descriptor memo untouched); every launch hands the C
    launch what Triton's own path hands it for the descriptor built afresh."""
    from tokenspeed_kernel_triton import _runners

    fn, drv, _compiled, encoded = desc_toy
    x, e = torch.randn(8).to(torch.bfloat16), _desc(128)
    base = torch.randn(64, 64).to(torch.bfloat16)
    d = _runners.derive_descriptor(_rows_desc, base, 32, _LAYOUT)
    launch = Launch(fn, (2,), (x, d.value, e, 9), {"FLAG": True})
    pipe = _runners.pipeline([launch], (x, base), keep=(e,), derived=(d,))
    layers = [torch.randn(64, 64).to(torch.bfloat16) for _ in range(2)]
    pipe((x, layers[0]))  # the first launch: through jit_launch
    for i, (layer, fills) in enumerate([(0, 1), (1, 1), (0, 0), (1, 0), (0, 0)]):
        before, direct = len(encoded), _launcher.launcher_stats(fn)["direct"]
        pipe((x, layers[layer]))
        assert _launcher.launcher_stats(fn)["direct"] == direct + 1, "a direct launch"
        assert len(encoded) - before == fills, f"run {i}: encoded {len(encoded) - before}, expected {fills}"
        got = drv.launches[-1]["args"]
        want = _triton_args(fn, drv, x, _rows_desc(layers[layer], 32, _LAYOUT), e)
        assert _same_args(got[1:-1], want[1:-1]), "Triton's own encoding of the descriptor built afresh"
    assert _launcher.derived_descriptor_stats() == {"encodes": 2, "kept": 2}
    # the two encodings also put in the descriptor memo (never looked up again: the slot has them)
    assert _launcher.descriptor_memo_stats() == {"hits": 0, "misses": 2, "entries": 2, "limit": 256}


def test_another_runners_slot_takes_the_memos_encoding_of_an_address(desc_toy):
    """Two runners of one derived descriptor (another batch's, say) over the same tensor: the
    second's first direct launch at that address takes the encoding the first made, from the
    descriptor memo (nothing encoded), and launches Triton's encoding of it; with the memo
    off it encodes its own."""
    fn, drv, _compiled, encoded = desc_toy
    base = torch.randn(64, 64).to(torch.bfloat16)
    first, x, e = _derived_pipe(desc_toy, base)
    first((x, base))
    first((x, base))  # encoded: kept by its slot and put in the memo
    second, _, e = _derived_pipe(desc_toy, base)  # its own bound E
    second((x, base))  # its first launch, through jit_launch (Triton's wrapper encodes)
    before, stats = len(encoded), _launcher.derived_descriptor_stats()
    second((x, base))
    assert len(encoded) == before, "the memo's encoding"
    after = _launcher.derived_descriptor_stats()
    assert after == {"encodes": stats["encodes"], "kept": stats["kept"] + 1}
    want = _triton_args(fn, drv, x, _rows_desc(base, 32, _LAYOUT), e)
    assert _same_args(drv.launches[-1]["args"][1:-1], want[1:-1])
    _launcher._MEMO.clear()
    third, _, _ = _derived_pipe(desc_toy, base)
    third((x, base))
    before = len(encoded)
    third((x, base))
    assert len(encoded) == before + 1, "no memo entry: encoded"


def _derived_pipe(desc_toy, base):
    """``desc_toy``'s kernel bound by a runner pipeline with D derived from input 1 (bound
    over ``base``: rows of 64), and the inputs ``x``, ``e``."""
    from tokenspeed_kernel_triton import _runners

    fn = desc_toy[0]
    x, e = torch.randn(8).to(torch.bfloat16), _desc(128)
    d = _runners.derive_descriptor(_rows_desc, base, 32, _LAYOUT)
    return (
        _runners.pipeline([Launch(fn, (2,), (x, d.value, e, 9), {"FLAG": True})], (x, base), keep=(e,), derived=(d,)),
        x,
        e,
    )


@pytest.mark.parametrize("change", ["rows", "row stride", "columns"])
def test_a_derived_slot_never_reuses_an_encoding_of_another_layout_at_its_address(desc_toy, change):
    """A tensor at an address the slot encoded, but of another shape or strides than the
    slot's first launch (what a runner key must never let through): the launch takes Triton's
    path with the descriptor built afresh over it, never the slot's encoding; the slot's own
    layout at that address is served from its encoding again."""
    fn, drv, _compiled, encoded = desc_toy
    storage = torch.randn(128 * 128).to(torch.bfloat16)
    base = storage[: 64 * 64].view(64, 64)
    pipe, x, e = _derived_pipe(desc_toy, base)
    pipe((x, base))
    pipe((x, base))  # direct: encoded and kept
    direct, kept = _launcher.launcher_stats(fn)["direct"], _launcher.derived_descriptor_stats()["kept"]
    other = {
        "rows": storage[: 32 * 64].view(32, 64),
        "row stride": storage.view(128, 128)[:64, :64],
        "columns": storage[: 64 * 128].view(64, 128),
    }[change]
    assert other.data_ptr() == base.data_ptr() and (other.shape, other.stride()) != (base.shape, base.stride())
    before = len(drv.launches)
    pipe((x, other))
    assert _launcher.launcher_stats(fn)["direct"] == direct, "not a direct launch"
    assert len(drv.launches) == before + 1
    want = _triton_args(fn, drv, x, _rows_desc(other, 32, _LAYOUT), e)
    assert _same_args(drv.launches[-1]["args"][1:-1], want[1:-1]), "the descriptor over this layout"
    fills = len(encoded)
    pipe((x, base))
    assert _launcher.launcher_stats(fn)["direct"] == direct + 1 and len(encoded) == fills, "the slot's encoding"
    assert _launcher.derived_descriptor_stats()["kept"] == kept


def test_a_full_derived_slot_is_emptied_and_encodes_again(desc_toy, monkeypatch):
    """At :data:`DERIVED_SLOT_LIMIT` encodings a slot is emptied: a third address (limit 2)
    encodes and is kept, the first encodes again (the descriptor memo off; on, it would serve
    it); every launch is Triton's encoding of its own tensor."""
    fn, drv, _compiled, encoded = desc_toy
    monkeypatch.setattr(_launcher, "DERIVED_SLOT_LIMIT", 2)
    monkeypatch.setattr(_launcher._MEMO, "limit", 0)
    layers = [torch.randn(64, 64).to(torch.bfloat16) for _ in range(3)]
    pipe, x, e = _derived_pipe(desc_toy, layers[0])
    pipe((x, layers[0]))  # through jit_launch
    for i, (layer, fills) in enumerate([(0, 1), (1, 1), (0, 0), (2, 1), (0, 1), (2, 0)]):
        before = len(encoded)
        pipe((x, layers[layer]))
        assert len(encoded) - before == fills, f"run {i}"
        want = _triton_args(fn, drv, x, _rows_desc(layers[layer], 32, _LAYOUT), e)
        assert _same_args(drv.launches[-1]["args"][1:-1], want[1:-1])


def test_a_runners_derived_descriptor_unlike_the_first_takes_the_full_path(desc_toy):
    """The same memory as another dtype (another key of Triton's): built and launched through
    Triton's path, never served from the slot's encoding; the first again is served by it."""
    from tokenspeed_kernel_triton import _runners

    fn, _drv, compiled, _encoded = desc_toy
    x, e = torch.randn(8).to(torch.bfloat16), _desc(128)
    base = torch.randn(64, 64).to(torch.bfloat16)
    d = _runners.derive_descriptor(_rows_desc, base, 32, _LAYOUT)
    pipe = _runners.pipeline([Launch(fn, (2,), (x, d.value, e, 9), {"FLAG": True})], (x, base), keep=(e,), derived=(d,))
    pipe((x, base))
    pipe((x, base))
    assert _launcher.launcher_stats(fn)["direct"] == 1
    pipe((x, base.view(torch.float16)))  # the same memory as float16: Triton compiles anew
    assert _launcher.launcher_stats(fn)["direct"] == 1 and len(compiled) == 2
    pipe((x, base))
    assert _launcher.launcher_stats(fn)["direct"] == 2
    assert _launcher.derived_descriptor_stats() == {"encodes": 1, "kept": 1}


def test_a_changed_global_takes_tritons_path_which_raises(toy):
    fn, _drv, _compiled = toy
    x, y = _tensors()
    _go(fn, x, y)
    scope = {"G": (1, 2)}
    fn.used_global_vals = {("G", id(scope)): ((1, 2), scope)}  # Triton keeps a deep copy
    _go(fn, x, y)
    scope["G"] = (1, 2)  # another object, the same value: still a cached launch
    _go(fn, x, y)
    assert _launcher.launcher_stats(fn)["hits"] == 2
    scope["G"] = (1, 3)
    with pytest.raises(RuntimeError, match="Global variable G has changed"):
        _go(fn, x, y)
    assert _launcher.launcher_stats(fn)["hits"] == 2
