"""Host µs of the step plans' runs on the CPU, their kernels' direct launches included (issue 19).

``tokenspeed-kernel overhead --device cuda`` times ``PrefillPlan.run``, ``ExtendPlan.run`` and
``DecodeStepPlan.run`` on a GPU host; this times the same runs' Python on a CPU, at the same
shapes (GPT-OSS-120B attention: 64 query / 8 KV heads of dim 64, bf16, sinks; prefill 64
tokens with window 128 through ``gluon_prefill_window_sm90`` and without one through
``gluon_prefill_fa3_sm90``, extend 16 onto 256 cached through ``gluon_extend_fa3_sm90``, decode
B=1 over 256 keys through ``gluon_decode_sm90``), each plan made with ``override=`` its kernel
(the selector's platform check skipped: the CPU is no sm_90). Everything runs as on a GPU but
Triton's compile and the C launch: a fake CUDA driver (its device index -1, a CPU tensor's
``get_device()``, so the launch cache's device checks pass for host tensors), each Gluon
kernel's compile replaced by a stand-in compiled kernel whose raw launcher is Triton's own
tensor-descriptor wrapper (``wrap_handle_tensordesc``, with TMA metadata as a Gluon kernel's)
around a C launch that only counts, and the driver's tensor-map encoder returning a stand-in.
So a run is the core's quick path, the wheel's step runner and the launch cache's real
direct launch (its generated checks, the derived slots' encodings, the argument splice),
minus the C launcher and the driver (4.8-6.7 µs on an H200 host, docs/history.md).

The CPU here runs this Python about 2x faster than the H200 host (``overhead`` on the same
build), and is shared: the figures are the minimum and the median of ``--repeats`` runs of
``--number`` calls. A/B against another build: run this file with that build's ``src``
folders first on ``PYTHONPATH`` (the file is self-contained).

    PYTHONPATH=ci:packages/tokenspeed-kernel/src:packages/tokenspeed-kernel-triton/src:packages/tokenspeed-kernel-nvidia/src \\
        python3 -m tokenspeed_kernel_dev.plan_bench [--number 2000] [--repeats 15] [--only ExtendPlan]
"""

from __future__ import annotations

import argparse
import statistics
import timeit
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

HEADS, KV_HEADS, HEAD_DIM, PAGE = 64, 8, 64, 16
# TMA metadata of a Gluon kernel's descriptor arguments (what the encoder is handed; stubbed)
_TMA_META = {"swizzle": 128, "elem_size": 2, "elem_type": 10, "block_size": [1, 1, 16, 64], "fp4_padded": False}


class _FakeDriver:
    """The driver calls Triton's ``JITFunction.run`` and the launch cache make: device -1 (a
    CPU tensor's ``get_device()``), one stream, an sm_90 target, a stand-in tensor-map
    encoder; ``launches`` counts the C launches."""

    def __init__(self) -> None:
        self.launches = 0
        self.utils = SimpleNamespace(fill_tma_descriptor=lambda *args: object())

    def get_current_device(self) -> int:
        return -1

    def get_current_stream(self, device: int) -> int:
        return 7

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


def _fake_compile(drv: _FakeDriver, fn: Any) -> None:
    """``fn``'s compile (Triton's ``_do_compile``) returns a stand-in compiled kernel: its
    raw launcher Triton's descriptor wrapper around a C launch that counts. ``fn``'s hash and
    the globals it reads are Triton's own (a direct launch checks those globals)."""
    from triton.backends.nvidia.driver import CudaLauncher, wrap_handle_tensordesc
    from triton.compiler.compiler import CompiledKernel

    def c_launch(*args: Any) -> None:
        drv.launches += 1

    def do_compile(key, signature, device, constexprs, options, attrs, warmup):
        kernel = object.__new__(CompiledKernel)
        kernel.module, kernel.function, kernel.packed_metadata = "fake", 1000, (4, 1, 0)
        kernel.name, kernel.src = "fake", None
        launcher = object.__new__(CudaLauncher)
        launcher.num_ctas = 1
        launcher.global_scratch_size = launcher.profile_scratch_size = 0
        launcher.global_scratch_align = launcher.profile_scratch_align = 1
        launcher.launch_cooperative_grid = launcher.launch_pdl = False
        count = sum(str(sig).startswith("tensordesc") for sig in signature.values())
        launcher.launch = wrap_handle_tensordesc(c_launch, signature, [dict(_TMA_META) for _ in range(count)])
        kernel._run = launcher
        fn.device_caches[device][0][key] = kernel
        return kernel

    fn.cache_key  # noqa: B018  # its source hash and the globals it reads (checked per launch), as a compile sets
    fn._do_compile = do_compile


def _install() -> _FakeDriver:
    """The fake GPU: the driver, the Gluon attention kernels' compiles, 132 SMs, and the step
    plans' selection taking the override (the CPU is no sm_90)."""
    from triton.runtime.driver import driver

    from tokenspeed_kernel import registry
    from tokenspeed_kernel.ops.attention import step_plan
    from tokenspeed_kernel_nvidia.ops.attention import gluon_decode, gluon_extend_fa3, gluon_prefill_fa3
    from tokenspeed_kernel_nvidia.ops.attention._gluon_decode_kernel import combine_kernel, decode_kernel
    from tokenspeed_kernel_nvidia.ops.attention._gluon_extend_fa3_kernel import extend_fa3_kernel
    from tokenspeed_kernel_nvidia.ops.attention._gluon_prefill_fa3_kernel import prefill_fa3_kernel
    from tokenspeed_kernel_nvidia.ops.attention._gluon_prefill_kernel import prefill_window_kernel

    registry.load_backends()
    drv = _FakeDriver()
    driver.set_active(drv)  # type: ignore[arg-type]
    for fn in (extend_fa3_kernel, prefill_window_kernel, prefill_fa3_kernel, decode_kernel, combine_kernel):
        _fake_compile(drv, fn)
    for module in (gluon_extend_fa3, gluon_prefill_fa3, gluon_decode):
        module.sm_count = lambda device: 132  # type: ignore[attr-defined]
    step_plan.select = lambda request, platform, override: registry.get_kernel(override)  # type: ignore[assignment]
    return drv


def _cases() -> dict[str, Callable[[], object]]:
    """Each plan's run at ``tokenspeed-kernel overhead``'s shape, its plan made once."""
    from tokenspeed_kernel import mha_decode_step_plan, mha_extend_plan, mha_prefill_plan

    bf = torch.bfloat16
    pages = 256 // PAGE + 1
    k_cache, v_cache = (torch.randn(pages, PAGE, KV_HEADS, HEAD_DIM, dtype=bf) for _ in range(2))
    table = torch.arange(pages, dtype=torch.int32).view(1, pages)
    lens = torch.tensor([256], dtype=torch.int32)
    sinks = torch.randn(HEADS)
    q16, cu16 = torch.randn(16, HEADS, HEAD_DIM, dtype=bf), torch.tensor([0, 16], dtype=torch.int32)
    q64, cu64 = torch.randn(64, HEADS, HEAD_DIM, dtype=bf), torch.tensor([0, 64], dtype=torch.int32)
    k64, v64 = (torch.randn(64, KV_HEADS, HEAD_DIM, dtype=bf) for _ in range(2))
    q1 = torch.randn(1, HEADS, HEAD_DIM, dtype=bf)
    window = mha_prefill_plan(q64, k64, v64, cu64, cu64, 64, 64, window_left=127, sinks=sinks,
                              override="gluon_prefill_window_sm90")  # fmt: skip
    dense = mha_prefill_plan(q64, k64, v64, cu64, cu64, 64, 64, sinks=sinks, override="gluon_prefill_fa3_sm90")
    extend = mha_extend_plan(q16, k_cache, v_cache, table, cu16, lens, 16, 256, sinks=sinks,
                             override="gluon_extend_fa3_sm90")  # fmt: skip
    decode = mha_decode_step_plan(q1, k_cache, v_cache, table, lens, 256, sinks=sinks, override="gluon_decode_sm90")
    return {
        "PrefillPlan.run (window)": lambda: window.run(q64, k64, v64, sinks=sinks),
        "PrefillPlan.run (fa3)": lambda: dense.run(q64, k64, v64, sinks=sinks),
        "ExtendPlan.run": lambda: extend.run(q16, k_cache, v_cache, sinks=sinks),
        "DecodeStepPlan.run": lambda: decode.run(q1, k_cache, v_cache, sinks=sinks),
    }


def run(number: int, repeats: int, only: str = "") -> list[tuple[str, float, float]]:
    """(run, min µs, median µs) per plan whose name holds ``only``; each run checked to make
    its kernel's launches and no other."""
    drv = _install()
    rows = []
    for name, call in _cases().items():
        if only not in name:
            continue
        for _ in range(5):  # the runner bound, the first (Triton) launch, the encodings made
            call()
        before = drv.launches
        call()
        if drv.launches - before not in (1, 2):  # the decode may add its merge
            raise RuntimeError(f"{name}: {drv.launches - before} launches")
        times = [t / number * 1e6 for t in timeit.repeat(call, number=number, repeat=repeats)]
        rows.append((name, min(times), statistics.median(times)))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--number", type=int, default=2000, help="calls per timed run")
    parser.add_argument("--repeats", type=int, default=15, help="timed runs (min and median)")
    parser.add_argument("--only", default="", help="the plans whose name holds this")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, CPU, fake GPU (compile and C launch stubbed): host µs per run")
    print(f"{'run':<26} {'min':>7} {'median':>7}")
    for name, low, mid in run(args.number, args.repeats, args.only):
        print(f"{name:<26} {low:>7.2f} {mid:>7.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
