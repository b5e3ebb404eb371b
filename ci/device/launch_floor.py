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

    python3 ci/device/launch_floor.py [--number 2000] [--repeats 7]
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
    args = parser.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
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


if __name__ == "__main__":
    main()
