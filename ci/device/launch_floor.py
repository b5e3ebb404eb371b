"""The host floor of one kernel launch on this GPU host, by path (issue 19).

One trivial Triton kernel with 12 tensor arguments and 2 ints, launched back to back
(``--number`` launches, then one sync; median of ``--repeats`` runs), by each path:

- ``triton``: ``kernel[grid](...)`` (Triton's ``JITFunction.run``);
- ``jit_launch``: our launch cache (key, then Triton's C launcher with the tensors: the C
  launcher calls ``data_ptr()`` and ``cuPointerGetAttribute`` on each);
- ``C launcher, tensors`` / ``C launcher, ints``: the cached entry's C launcher called
  directly with the tensors / their addresses (precomputed);
- ``C launcher, data_ptr() per call``: addresses read in Python at every launch;
- ``BoundLaunch, all varying``: the plan path with every tensor passed per call;
- ``torch static launcher``: torch inductor's ``_StaticCudaLauncher`` on the same cubin;
- and the pieces an op pays around its launches: ``torch.empty``, ``data_ptr()``, the
  current stream, torch's eager SDPA at the decode shape.

``--calls``: the same floor for the real public calls of ``tokenspeed-kernel overhead
--device cuda`` (its cases, each pick and the opt-in TMA kernels by ``override=``), peeled
layer by layer in one process: the public call; the kernel function alone with the call's
typed arguments (no validation, selection or allocation); that with every direct launch's C
launcher stubbed (the host Python of the wheel's runner: descriptor memo, checks, argument
splicing); the public call so stubbed; the captured C launches alone, replayed with their
recorded arguments (what the driver and Triton's C launcher cost); and the launches per call
(a call that stubs no launch never took the direct path: its launches went through
``jit_launch``).

``--pieces``: the steps of one public call (``mha_prefill`` at the overhead shape, GPT-OSS
heads, 64 tokens) timed one by one, each on the GPU's tensors and on host tensors in the same
process: the call key, the plan look-up, ``dispatch``, the capture check, the output
allocation, the typed arguments; on a host the core's Python runs at the same speed for both,
so a gap is what CUDA tensors cost.

    python3 ci/device/launch_floor.py [--number 2000] [--repeats 7] [--calls] [--pieces] [--no-floor]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import triton
import triton.language as tl

from tokenspeed_kernel_triton import _launcher


@triton.jit
def _twelve(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, n, m, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(a0 + offs, mask=mask, other=0.0)
    tl.store(a11 + offs, x + m, mask=mask)


def _time(call, number: int, repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(number):
            call()
        runs.append((time.perf_counter() - start) / number * 1e6)
        torch.cuda.synchronize()
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--number", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--calls", action="store_true", help="peel the public calls layer by layer")
    parser.add_argument("--pieces", action="store_true", help="the public call's steps, GPU vs host tensors")
    parser.add_argument("--no-floor", action="store_true", help="skip the one-kernel floor")
    args = parser.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    if not args.no_floor:
        _floor(args, dev)
    if args.pieces:
        _pieces(args, dev)
    if args.calls:
        _calls(args, dev)


def _floor(args, dev: torch.device) -> None:
    ts = [torch.randn(256, device=dev) for _ in range(12)]
    grid = (1,)
    kw = {"BLOCK": 256}
    rows: list[tuple[str, float]] = []

    def add(name, call):
        for _ in range(50):
            call()
        rows.append((name, _time(call, args.number, args.repeats)))

    add("triton kernel[grid](...)", lambda: _twelve[grid](*ts, 256, 3, **kw))
    add("jit_launch (tensors to C)", lambda: _launcher.jit_launch(_twelve, grid, *ts, 256, 3, **kw))
    state = _launcher._KERNELS[id(_twelve)]
    shape = state.shapes[tuple(kw)]
    (entry,) = shape.cache.values()
    direct, run, function, packed, coop, pdl, _ = entry
    assert direct, "expected the raw C launcher"
    stream = torch.cuda.current_stream().cuda_stream
    tail = shape.tail
    ptrs = [t.data_ptr() for t in ts]
    add(
        "C launcher, tensors",
        lambda: run(1, 1, 1, stream, function, coop, pdl, None, None, packed, None, None, None, *ts, 256, 3, *tail),
    )
    add(
        "C launcher, ints (precomputed)",
        lambda: run(1, 1, 1, stream, function, coop, pdl, None, None, packed, None, None, None, *ptrs, 256, 3, *tail),
    )
    add(
        "C launcher, data_ptr() per call",
        lambda: run(
            1,
            1,
            1,
            stream,
            function,
            coop,
            pdl,
            None,
            None,
            packed,
            None,
            None,
            None,
            *[t.data_ptr() for t in ts],
            256,
            3,
            *tail,
        ),
    )
    bound = _launcher.BoundLaunch(_twelve, grid, (*ts, 256, 3), kw, tuple(range(12)))
    add("BoundLaunch, 12 varying", lambda: bound(*ts))
    bound0 = _launcher.BoundLaunch(_twelve, grid, (*ts, 256, 3), kw, ())
    add("BoundLaunch, all bound", lambda: bound0())
    try:
        from torch._inductor.runtime.static_triton_launcher import StaticallyLaunchedCudaKernel

        compiled = _twelve[grid](*ts, 256, 3, **kw)
        compiled._cubin_path = None  # set by inductor's own compile; the raw cubin is used
        static = StaticallyLaunchedCudaKernel(compiled)
        static.reload_cubin_from_raw("/tmp/launch_floor/twelve.cubin")
        static.load_kernel(dev.index)
        add("torch static launcher, tensors", lambda: static.run(1, 1, 1, stream, *ts, 256, 3))
        add("torch static launcher, ints", lambda: static.run(1, 1, 1, stream, *ptrs, 256, 3))
        out = torch.empty_like(ts[11])
        static.run(1, 1, 1, stream, *ts[:11], out, 256, 3)
        torch.cuda.synchronize()
        print("static launcher output ok:", torch.equal(out, ts[0] + 3))
    except Exception as exc:
        print(f"torch static launcher: not usable here ({type(exc).__name__}: {exc})")
    add("torch.empty(256) on the GPU", lambda: torch.empty(256, device=dev))
    add("torch.empty_like", lambda: torch.empty_like(ts[0]))
    add("12 x data_ptr()", lambda: [t.data_ptr() for t in ts])
    add("current stream (raw)", lambda: torch._C._cuda_getCurrentRawStream(dev.index))
    q = torch.randn(1, 64, 1, 64, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, 8, 256, 64, device=dev, dtype=torch.bfloat16)
    add(
        "torch SDPA decode (baseline)",
        lambda: torch.nn.functional.scaled_dot_product_attention(q, k, k, enable_gqa=True),
    )
    a = torch.randn(64, 64, device=dev)
    add("torch matmul 64x64 (baseline)", lambda: torch.matmul(a, a))
    print(
        f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}, triton {triton.__version__}: host µs per launch"
    )
    for name, us in rows:
        print(f"{name:42s} {us:7.2f}")


# (overhead case, override): the picks at the overhead cases' shapes, and the opt-in TMA kernels
_CALLS = (
    ("mha_prefill", None),
    ("mha_prefill full", None),
    ("mha_prefill full", "gluon_prefill_fa3_sm90"),
    ("mha_prefill full", "triton_prefill"),
    ("mha_extend_with_kvcache", None),
    ("mha_extend_with_kvcache", "gluon_extend_fa3_sm90"),
    ("mha_decode_with_kvcache", None),
)


def _captured_kernel(call) -> tuple:
    """(the kernel function, its typed arguments) of one public call: ``dispatch`` wrapped
    for one call so that the spec it returns records the arguments."""
    import dataclasses

    from tokenspeed_kernel.ops.attention import api

    seen: list = []
    real = api.dispatch

    def spying(*a, **kw):
        spec = real(*a, **kw)
        return dataclasses.replace(spec, fn=lambda typed: seen.append((spec.fn, typed)) or spec.fn(typed))

    api.dispatch = spying
    try:
        call()
    finally:
        api.dispatch = real
    return seen[-1]


class _Stubbed:
    """Every remembered direct launch (each ``BoundLaunch``'s C launcher) replaced by a
    counter that records its arguments, for the block only."""

    def __enter__(self):
        import gc

        self.saved, self.records, self.count = [], {}, [0]
        for obj in gc.get_objects():
            if type(obj) is _launcher.BoundLaunch and obj._direct is not None:
                raw, run, *rest = obj._direct
                self.saved.append((obj, obj._direct, obj._go))
                obj._direct = (raw, self._stub(id(obj), run), *rest)
                obj._go = obj._compile()  # the generated launch binds its C launcher
        return self

    def _stub(self, key, run):
        def stub(*a):
            self.count[0] += 1
            self.records[key] = (run, a)

        return stub

    def __exit__(self, *exc):
        for obj, direct, go in self.saved:
            obj._direct, obj._go = direct, go


def _peel(call, name: str, override: str | None, number: int, repeats: int) -> str:
    """One table line: ``call`` timed layer by layer (see the module docstring)."""
    from tokenspeed_kernel.ops._dispatch import last_kernel

    for _ in range(30):
        call()
    kernel = last_kernel() or "?"
    fn, typed = _captured_kernel(call)
    public = _time(call, number, repeats)
    direct = _time(lambda: fn(typed), number, repeats)
    with _Stubbed() as stubbed:
        fn(typed)
        stubbed.count[0] = 0
        fn_stub = _time(lambda: fn(typed), number, 1)
        per_call = stubbed.count[0] / number
        pub_stub = _time(call, number, repeats)
        records = list(stubbed.records.values())

    def replay():
        for run, a in records:
            run(*a)

    c_only = _time(replay, number, repeats) if records else float("nan")
    label = name + (f" ({override})" if override else "")
    return (
        f"{label[:28]:<28} {kernel[:26]:<26} {public:7.2f} {direct:7.2f} {fn_stub:7.2f} {pub_stub:8.2f} "
        f"{c_only:7.2f} {per_call:6.2f}"
    )


def _calls(args, dev: torch.device) -> None:
    from tokenspeed_kernel.tools.overhead import FUNCTIONAL_CALLS

    head = f"{'call':<28} {'kernel':<26} {'public':>7} {'fn':>7} {'fn stub':>7} {'pub stub':>8} {'C only':>7} {'C/call':>6}"
    lines = [head, "-" * len(head)]
    number = max(args.number // 4, 100)
    for name, override in _CALLS:
        lines.append(_peel(FUNCTIONAL_CALLS[name](dev, override=override), name, override, number, args.repeats))
    print(
        f"{torch.cuda.get_device_name(dev)}: host µs per call, peeled (public call; kernel fn alone; with its "
        "C launches stubbed; the public call stubbed; the C launches alone; direct launches per call)"
    )
    print("\n".join(lines))


def _pieces(args, dev: torch.device) -> None:
    """One line per step of a ``mha_prefill`` call: µs on the GPU's tensors, on host tensors."""
    from tokenspeed_kernel import mha_prefill
    from tokenspeed_kernel.ops import _checks, _dispatch
    from tokenspeed_kernel.ops.attention import api
    from tokenspeed_kernel.ops.attention.args import PrefillArgs
    from tokenspeed_kernel.platform import platform_for
    from tokenspeed_kernel.selector import select
    from tokenspeed_kernel.tools.overhead import noop_kernels

    def steps(device: torch.device) -> dict:
        q, k, v = (torch.randn(64, h, 64, device=device, dtype=torch.bfloat16) for h in (64, 8, 8))
        cu = torch.tensor([0, 64], dtype=torch.int32, device=device)
        sinks = torch.randn(64, device=device)
        call = (q, k, v, cu, cu, 64, 64, True, None, -1, sinks, 0.0, False, None, None)
        plan = api.PrefillCall.check(False, *call)
        out = q.new_empty(*plan.out_shape)
        table = {api.PrefillCall.key(*call): plan}
        return {
            "arg_key(q)": lambda: _checks.arg_key(q),
            "q.device": lambda: q.device,
            "q.stride()": lambda: q.stride(),
            "plan key (7 tensors)": lambda: api.PrefillCall.key(*call),
            "plan look-up": lambda: table.get(api.PrefillCall.key(*call)),
            "platform_for": lambda: platform_for(device),
            "select (cached)": lambda: select(plan.request, platform_for(device), None),
            "is_capturing": _dispatch.is_capturing,
            "dispatch": lambda: _dispatch.dispatch(plan.request, device, None, lambda: {}),
            "q.new_empty(out)": lambda: q.new_empty(*plan.out_shape),
            "PrefillArgs(...)": lambda: PrefillArgs(q, k, v, cu, cu, 64, 64, True, 0.125, -1, sinks, 0.0, out, None),
            "public call, no-op kernel": lambda: mha_prefill(q, k, v, cu, cu, 64, 64, sinks=sinks, override=noop),
        }

    number = max(args.number // 2, 200)
    with noop_kernels(("attention.prefill",)) as names:
        noop = names["attention.prefill"]
        gpu, host = steps(dev), steps(torch.device("cpu"))
        print(f"{torch.cuda.get_device_name(dev)}: µs per step of one mha_prefill call (64 tokens, 64/8 heads)")
        print(f"{'step':<32} {'GPU tensors':>12} {'host tensors':>13}")
        for name in gpu:
            print(
                f"{name:<32} {_time(gpu[name], number, args.repeats):12.2f} {_time(host[name], number, args.repeats):13.2f}"
            )


if __name__ == "__main__":
    main()
