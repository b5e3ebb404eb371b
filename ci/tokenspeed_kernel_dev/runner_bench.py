"""Host µs of the functional runner caches on the CPU: a key against a bind, per call.

For each kernel whose functional calls run a runner cached per key
(``tokenspeed_kernel_triton._runners``), at the ``tokenspeed-kernel overhead`` shapes
(GPT-OSS-120B attention: 64 query / 8 KV heads of dim 64, bf16, sinks; decode B=1 over 256
keys, extend 16 onto 256, prefill 64 with window 128, and without one for the dense Gluon
prefill; MoE 4 tokens, 32 experts of 512 x 512, top-4), with every launch stubbed out (nothing
runs), it times:

- ``key``: the runner key of a call (what every call pays on top of its runner);
- ``bind``: binding a runner (the launch building and ``BoundLaunch`` set-up a cache hit skips);
- ``uncached``: the uncached call's host work up to its launches (building them);
- ``cached``: a cache hit up to its launches (key, look-up, the run's inputs, scratch and
  derived arguments: the Gluon TMA kernels' descriptors, passed pending: built only by a
  launch that does not find them in the descriptor memo).
  On the CPU a bound launch takes ``jit_launch`` with its full arguments (stubbed here); on a
  GPU it is a direct launch, whose cost this figure leaves out, as ``uncached`` leaves out
  ``jit_launch``'s keying of the full arguments (what the GPU measurement adds back);
- ``+desc``: ``cached`` plus the descriptor step of each direct launch (``BoundLaunch``'s,
  the real code: a derived slot's look-up of its tensor's address, ``_encode_derived``; a
  pending descriptor's ``_descriptor_parts``, a memo look-up): on a miss the descriptor built,
  checked and encoded by Triton's own ``make_tensordesc_arg`` with the driver's C encoder
  (``fill_tma_descriptor``, ``cuTensorMapEncodeTiled``) stubbed; the same tensors every call,
  so the look-ups hit. ``--descriptor-memo 0`` empties the memo (a pending descriptor's
  launch builds and encodes: the work before the memo, plus the key). The whole direct launch
  (its tensor checks included) of the step plans' runs: ``plan_bench``.

    TRITON_INTERPRET=1 PYTHONPATH=ci:packages/tokenspeed-kernel/src:packages/tokenspeed-kernel-triton/src:packages/tokenspeed-kernel-nvidia/src \\
        python3 -m tokenspeed_kernel_dev.runner_bench [--number 2000] [--descriptor-memo 0]
"""

from __future__ import annotations

import argparse
import statistics
import timeit
from collections.abc import Callable
from typing import Any

import torch

HEADS, KV_HEADS, HEAD_DIM, PAGE = 64, 8, 64, 16


def _descriptor_slot(value: Any) -> tuple | None:
    """A bound launch's check of a varying Gluon descriptor slot (``BoundLaunch._checks``'s
    dtype and descriptor tuple, as ``_remember`` makes it) with Triton's own encoder and TMA
    metadata of its box, from a first launch's ``value``; None for a tensor."""
    from triton.backends.nvidia.driver import make_tensordesc_arg
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from tokenspeed_kernel_triton import _launcher

    if type(value) is _launcher.PendingDescriptor:
        value = value.build()
    if type(value) is not TensorDescriptor:
        return None
    layout = value.layout
    meta = {"swizzle": layout.swizzle_byte_width, "elem_size": value.base.element_size(), "elem_type": 10,
            "block_size": list(value.block_shape), "fp4_padded": False}  # fmt: skip
    width = len(make_tensordesc_arg(value, meta))
    token = _launcher._meta_token(make_tensordesc_arg, meta)
    desc = (TensorDescriptor, list(value.block_shape), layout, make_tensordesc_arg, meta, token, width)
    return value.base.dtype, desc


def _stub_launches(descriptor_memo: int) -> None:
    """Every launch of the Triton wheel's helpers becomes a no-op, but a bound launch's
    descriptor step (``_launcher._descriptor_parts``, timed by ``+desc``: see the module
    docstring); the driver's C tensor-map encoder returns a stand-in."""
    from types import SimpleNamespace

    from triton.runtime.driver import driver

    from tokenspeed_kernel_triton import _launcher, _runners

    def nothing(*args: Any, **kwargs: Any) -> None:
        return None

    class _Bound:
        descriptors = False  # the +desc column: run each varying descriptor's step

        def __init__(self, fn, grid, args, kwargs, varying, derived=()) -> None:
            self.varying = varying
            self.derived = derived or (None,) * len(varying)
            self.slots: list | None = None
            self.encoded: list = [{} for _ in varying]  # a derived slot's encodings by address

        def __call__(self, *values: Any) -> None:
            if not _Bound.descriptors:
                return
            if self.slots is None:  # the first launch (through jit_launch on a GPU)
                self.slots = [_descriptor_slot(d.build(v) if d else v) for v, d in zip(values, self.derived)]
                return
            for value, slot, derived, cache in zip(values, self.slots, self.derived, self.encoded):
                if slot is None:
                    continue
                if derived is None:
                    parts = _launcher._descriptor_parts(value, slot[0], slot[1], -1)
                else:  # a direct launch's derived slot (its tensor checks left out): its encoding, or made
                    address = value.data_ptr()
                    parts = cache.get(address) or _launcher._encode_derived(
                        value, address, slot[0], slot[1], derived, cache, -1
                    )
                if parts is None:
                    raise RuntimeError("the descriptor step took the full path")

    fill = SimpleNamespace(fill_tma_descriptor=lambda *args: object())
    driver.set_active(SimpleNamespace(utils=fill))  # type: ignore[arg-type]
    _launcher.jit_launch = nothing  # type: ignore[assignment]
    _runners.BoundLaunch = _Bound  # type: ignore[assignment,misc]
    _launcher._MEMO.limit = descriptor_memo
    globals()["_BOUND"] = _Bound


def _capture(module: Any, call: Callable[[], object]) -> Any:
    """What ``module._RUNNERS`` receives from one public call."""
    seen: list = []
    cache = module._RUNNERS
    module._RUNNERS = seen.append
    try:
        call()
    finally:
        module._RUNNERS = cache
    return seen[0]


def _attention_rows() -> dict[str, tuple[Any, Any]]:
    from tokenspeed_kernel import mha_decode_with_kvcache, mha_extend_with_kvcache, mha_prefill
    from tokenspeed_kernel_triton.ops.attention import decode, extend, prefill

    bf = torch.bfloat16
    pages = 256 // PAGE + 1
    k = torch.randn(pages, PAGE, KV_HEADS, HEAD_DIM, dtype=bf)
    v = torch.randn(pages, PAGE, KV_HEADS, HEAD_DIM, dtype=bf)
    table = torch.arange(pages, dtype=torch.int32).view(1, pages)
    lens = torch.tensor([256], dtype=torch.int32)
    sinks = torch.randn(HEADS)
    q1 = torch.randn(1, HEADS, HEAD_DIM, dtype=bf)
    q16 = torch.randn(16, HEADS, HEAD_DIM, dtype=bf)
    cu16 = torch.tensor([0, 16], dtype=torch.int32)
    q64 = torch.randn(64, HEADS, HEAD_DIM, dtype=bf)
    kv64 = torch.randn(64, KV_HEADS, HEAD_DIM, dtype=bf)
    cu64 = torch.tensor([0, 64], dtype=torch.int32)
    return {
        "triton_decode": (
            decode,
            _capture(decode, lambda: mha_decode_with_kvcache(q1, k, v, table, lens, 256, sinks=sinks)),
        ),
        "triton_extend": (
            extend,
            _capture(extend, lambda: mha_extend_with_kvcache(q16, k, v, table, cu16, lens, 16, 256, sinks=sinks)),
        ),
        "triton_prefill": (
            prefill,
            _capture(prefill, lambda: mha_prefill(q64, kv64, kv64, cu64, cu64, 64, 64, window_left=127, sinks=sinks)),
        ),
    }


def _gluon_decode() -> tuple[Any, Any] | None:
    try:
        from tokenspeed_kernel.ops.attention.args import DecodeArgs
        from tokenspeed_kernel_nvidia.ops.attention import gluon_decode
    except ImportError:  # no NVIDIA wheel on the path
        return None
    bf = torch.bfloat16
    pages = 256 // PAGE + 1
    q = torch.randn(1, 1, HEADS, HEAD_DIM, dtype=bf)
    args = DecodeArgs(
        q,
        torch.randn(pages, PAGE, KV_HEADS, HEAD_DIM, dtype=bf),
        torch.randn(pages, PAGE, KV_HEADS, HEAD_DIM, dtype=bf),
        torch.arange(pages, dtype=torch.int32).view(1, pages),
        torch.tensor([256], dtype=torch.int32),
        256,
        0.125,
        -1,
        torch.randn(HEADS),
        0.0,
        None,
        None,
        torch.empty_like(q),
        None,
    )
    return gluon_decode, args


def _gluon_tma() -> dict[str, tuple[Any, Any]]:
    """The Gluon TMA attention kernels at the overhead shapes: the window prefill (64 tokens,
    window 128), the dense FA3 prefill (64 tokens, no window) and the FA3 paged extend (16
    onto 256); their runners derive the TMA descriptors per run (built here, not encoded:
    the tensor-map encoding happens in the launch, stubbed)."""
    try:
        from tokenspeed_kernel.ops.attention.args import ExtendArgs, PrefillArgs
        from tokenspeed_kernel_nvidia.ops.attention import gluon_extend_fa3, gluon_prefill, gluon_prefill_fa3
    except ImportError:  # no NVIDIA wheel on the path
        return {}
    for module in (gluon_prefill_fa3, gluon_extend_fa3):
        module.sm_count = lambda device: 132  # type: ignore[attr-defined]  # an H100's (the CPU has none)
    bf = torch.bfloat16
    q64 = torch.randn(64, HEADS, HEAD_DIM, dtype=bf)
    kv64 = torch.randn(64, KV_HEADS, HEAD_DIM, dtype=bf)
    cu64 = torch.tensor([0, 64], dtype=torch.int32)
    sinks = torch.randn(HEADS)

    def prefill(window: int) -> Any:
        return PrefillArgs(q64, kv64, kv64.clone(), cu64, cu64, 64, 64, True, 0.125, window, sinks, 0.0,
                           torch.empty_like(q64), None)  # fmt: skip

    pages = 256 // PAGE + 1
    q16 = torch.randn(16, HEADS, HEAD_DIM, dtype=bf)
    extend = ExtendArgs(
        q16,
        torch.randn(pages, PAGE, KV_HEADS, HEAD_DIM, dtype=bf),
        torch.randn(pages, PAGE, KV_HEADS, HEAD_DIM, dtype=bf),
        torch.arange(pages, dtype=torch.int32).view(1, pages),
        torch.tensor([0, 16], dtype=torch.int32),
        torch.tensor([256], dtype=torch.int32),
        16, 256, True, 0.125, -1, sinks, 0.0, None, None, torch.empty_like(q16), None,
    )  # fmt: skip
    return {
        "gluon_prefill_window": (gluon_prefill, prefill(127)),
        "gluon_prefill_fa3": (gluon_prefill_fa3, prefill(-1)),
        "gluon_extend_fa3": (gluon_extend_fa3, extend),
    }


def _moe() -> tuple[Any, Any]:
    from tokenspeed_kernel.ops.moe.args import MoEApplyArgs
    from tokenspeed_kernel_triton.ops.moe import fused

    experts, hidden, inter, tokens, top_k = 32, 512, 512, 4, 4
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16)
    args = MoEApplyArgs(
        x,
        torch.randn(experts, 2 * inter, hidden, dtype=torch.bfloat16),
        torch.randn(experts, hidden, inter, dtype=torch.bfloat16),
        torch.rand(tokens, top_k),
        torch.randperm(experts)[: tokens * top_k].view(tokens, top_k).int(),
        "silu",
        None,
        None,
        None,
        torch.empty_like(x),
        None,
        None,
    )
    return fused, args


def _time(fn: Callable[[], object], number: int) -> float:
    runs = timeit.repeat(fn, number=number, repeat=5)
    return statistics.median(runs) / number * 1e6


def run(number: int, descriptor_memo: int = 256) -> list[tuple[str, float, float, float, float, float]]:
    """(kernel, key µs, bind µs, uncached µs, cached µs, cached with the descriptor step µs)
    per kernel, the descriptor memo at ``descriptor_memo`` entries."""
    _stub_launches(descriptor_memo)
    kernels = _attention_rows()
    gluon = _gluon_decode()
    if gluon is not None:
        kernels["gluon_decode_sm90"] = gluon
    kernels.update(_gluon_tma())
    kernels["triton_fused_moe"] = _moe()
    rows = []
    for name, (module, args) in kernels.items():
        cache = module._RUNNERS
        _BOUND.descriptors = False
        cache.clear()
        cache(args)  # bound: later calls hit
        timings = [
            _time(lambda c=cache, a=args: c._key(a), number),
            _time(lambda c=cache, a=args: c._bind(a), max(number // 10, 10)),
            _time(lambda c=cache, a=args: c._fresh(a), max(number // 10, 10)),
            _time(lambda c=cache, a=args: c(a), number),
        ]
        _BOUND.descriptors = True
        cache.clear()
        cache(args)  # bound anew: its launches' first calls make their descriptor slots
        timings.append(_time(lambda c=cache, a=args: c(a), number))
        rows.append((name, *timings))
    return rows


_BOUND: Any = None  # the stub bound launch class (_stub_launches)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--number", type=int, default=2000, help="calls per timed run (median of 5)")
    parser.add_argument(
        "--descriptor-memo", type=int, default=256, help="descriptor memo entries (0: every launch encodes)"
    )
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}, CPU, launches stubbed, descriptor memo {args.descriptor_memo} entries: "
        "host µs per call"
    )
    print(f"{'kernel':<22} {'key':>7} {'bind':>7} {'uncached':>9} {'cached':>7} {'+desc':>7}")
    for name, key, bind, fresh, cached, encoded in run(args.number, args.descriptor_memo):
        print(f"{name:<22} {key:>7.2f} {bind:>7.2f} {fresh:>9.2f} {cached:>7.2f} {encoded:>7.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
