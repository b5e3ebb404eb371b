"""``overhead --device cuda``: the host cost of one eager public call with the real kernels.

The CPU mode (:mod:`tokenspeed_kernel.tools.overhead`) times the core alone, behind no-op
kernels. This mode times what an engine pays on a GPU host: every public operator (and
``DecodePlan.run`` / ``MoEPlan.apply``) served by the kernel the selector picks, at
GPT-OSS-120B's attention layout (64 query heads, 8 KV heads, head dim 64, bf16, sinks) and a
small MoE, with the tensors on the GPU. Beside them, in the same process: torch's eager
``scaled_dot_product_attention`` at the decode shape and a small ``torch.matmul``, the
baselines the targets are stated against.

**Host µs per call**: ``number`` back-to-back calls, timed on the host clock *before* the
closing synchronize, divided by ``number``; the median of ``repeats`` runs. The problems are
tiny, so the GPU drains its queue faster than the host fills it and the figure is the host's
own work per call: validation, selection, allocation, argument binding and every launch.
``wall`` (after the synchronize) is printed too; a wall far above host means the GPU, not the
host, bounded the run. The breakdown adds ``kernel`` (the vendor wheel's launch code and the
compiler runtime: Triton's argument binding and launcher) to the CPU mode's categories.

    tokenspeed-kernel overhead --device cuda [--op OP] [--top 12] [--json FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenspeed_kernel.ops._dispatch import last_kernel

__all__ = ["DeviceCase", "DeviceRow", "baselines", "device_cases", "measure_device", "top_functions"]

HEADS, KV_HEADS, HEAD_DIM, PAGE = 64, 8, 64, 16  # GPT-OSS-120B attention
DTYPE = torch.bfloat16


@dataclass(frozen=True)
class DeviceCase:
    """One timed call on ``device``: ``make(device)`` builds inputs once, returns the call."""

    name: str
    op: str
    make: Callable[[torch.device], Callable[[], object]]


@dataclass(frozen=True)
class DeviceRow:
    """Host and wall µs per eager call of one case, and the kernel that served it."""

    name: str
    op: str
    kernel: str
    host_us: float
    wall_us: float
    breakdown_us: dict[str, float]


def _randn(*shape: int, device: torch.device, dtype: torch.dtype = DTYPE) -> torch.Tensor:
    return torch.randn(*shape, device=device, dtype=dtype)


def _paged(device: torch.device, batch: int = 1, tokens: int = 256) -> dict[str, torch.Tensor]:
    """A contiguous paged cache holding ``tokens`` keys per sequence, pages in order."""
    per_seq = -(-tokens // PAGE) + 1
    pages = batch * per_seq
    return {
        "k_cache": _randn(pages, PAGE, KV_HEADS, HEAD_DIM, device=device),
        "v_cache": _randn(pages, PAGE, KV_HEADS, HEAD_DIM, device=device),
        "page_table": torch.arange(pages, dtype=torch.int32, device=device).reshape(batch, per_seq),
        "cache_seqlens": torch.full((batch,), tokens, dtype=torch.int32, device=device),
        "sinks": torch.randn(HEADS, device=device, dtype=torch.float32),
    }


def _prefill(device: torch.device) -> Callable[[], object]:
    from tokenspeed_kernel import mha_prefill

    q, k, v = (_randn(64, h, HEAD_DIM, device=device) for h in (HEADS, KV_HEADS, KV_HEADS))
    cu = torch.tensor([0, 64], dtype=torch.int32, device=device)
    sinks = torch.randn(HEADS, device=device, dtype=torch.float32)
    return lambda: mha_prefill(q, k, v, cu, cu, 64, 64, window_left=127, sinks=sinks)


def _extend(device: torch.device) -> Callable[[], object]:
    from tokenspeed_kernel import mha_extend_with_kvcache

    c = _paged(device)
    q = _randn(16, HEADS, HEAD_DIM, device=device)
    cu = torch.tensor([0, 16], dtype=torch.int32, device=device)
    return lambda: mha_extend_with_kvcache(
        q, c["k_cache"], c["v_cache"], c["page_table"], cu, c["cache_seqlens"], 16, 256, sinks=c["sinks"]
    )


def _decode(device: torch.device) -> Callable[[], object]:
    from tokenspeed_kernel import mha_decode_with_kvcache

    c = _paged(device)
    q = _randn(1, HEADS, HEAD_DIM, device=device)
    return lambda: mha_decode_with_kvcache(
        q, c["k_cache"], c["v_cache"], c["page_table"], c["cache_seqlens"], 256, sinks=c["sinks"]
    )


def _decode_plan(device: torch.device) -> Callable[[], object]:
    from tokenspeed_kernel import mha_decode_plan

    c = _paged(device)
    plan = mha_decode_plan(
        c["k_cache"], c["v_cache"], c["page_table"], c["cache_seqlens"], 256,
        q_dtype=DTYPE, num_q_heads=HEADS, sinks=c["sinks"],
    )  # fmt: skip
    q = _randn(1, HEADS, HEAD_DIM, device=device)
    return lambda: plan.run(q)


def _store(device: torch.device) -> Callable[[], object]:
    from tokenspeed_kernel import store_kvcache

    c = _paged(device)
    k, v = (_randn(1, KV_HEADS, HEAD_DIM, device=device) for _ in range(2))
    slots = torch.tensor([256], dtype=torch.int64, device=device)
    return lambda: store_kvcache(k, v, c["k_cache"], c["v_cache"], slots)


def _topk(device: torch.device) -> Callable[[], object]:
    from tokenspeed_kernel import moe_topk

    logits = _randn(4, 128, device=device)
    return lambda: moe_topk(logits, 4)


def _moe(device: torch.device) -> dict[str, torch.Tensor]:
    """4 tokens, 32 experts of hidden 512 / intermediate 512 (bf16), top-4."""
    experts, hidden, inter, tokens, top_k = 32, 512, 512, 4, 4
    return {
        "x": _randn(tokens, hidden, device=device),
        "w13": _randn(experts, 2 * inter, hidden, device=device) / hidden**0.5,
        "w2": _randn(experts, hidden, inter, device=device) / inter**0.5,
        "topk_weights": torch.rand(tokens, top_k, device=device),
        "topk_ids": torch.randperm(experts, device=device)[: tokens * top_k].reshape(tokens, top_k).int(),
    }


def _apply(device: torch.device) -> Callable[[], object]:
    from tokenspeed_kernel import moe_apply

    m = _moe(device)
    return lambda: moe_apply(m["x"], m["w13"], m["w2"], m["topk_weights"], m["topk_ids"])


def _apply_plan(device: torch.device) -> Callable[[], object]:
    from tokenspeed_kernel import moe_plan

    m = _moe(device)
    plan = moe_plan(m["w13"], m["w2"], x_dtype=DTYPE, top_k=4)
    return lambda: plan.apply(m["x"], m["topk_weights"], m["topk_ids"])


def device_cases() -> tuple[DeviceCase, ...]:
    """Every public operator and each plan's per-step call (GPT-OSS attention heads, bf16:
    prefill 64 tokens with window 128 and sinks; extend 16 onto 256 cached; decode B=1 over
    256 keys; store 1 token; top-4 of 128 over 4 tokens; MoE 4 tokens, 32 experts)."""
    return (
        DeviceCase("mha_prefill", "attention.prefill", _prefill),
        DeviceCase("mha_extend_with_kvcache", "attention.extend", _extend),
        DeviceCase("mha_decode_with_kvcache", "attention.decode", _decode),
        DeviceCase("DecodePlan.run", "attention.decode", _decode_plan),
        DeviceCase("store_kvcache", "kvcache.store", _store),
        DeviceCase("moe_topk", "moe.topk", _topk),
        DeviceCase("moe_apply", "moe.apply", _apply),
        DeviceCase("MoEPlan.apply", "moe.apply", _apply_plan),
    )


def _sdpa(device: torch.device) -> Callable[[], object]:
    q = _randn(1, HEADS, 1, HEAD_DIM, device=device)
    k, v = (_randn(1, KV_HEADS, 256, HEAD_DIM, device=device) for _ in range(2))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return lambda: sdpa(q, k, v, enable_gqa=True)


def _matmul(device: torch.device) -> Callable[[], object]:
    a, b = _randn(64, 64, device=device), _randn(64, 64, device=device)
    return lambda: torch.matmul(a, b)


def baselines() -> tuple[DeviceCase, ...]:
    """torch's own eager calls at comparable sizes: SDPA at the decode shape (GQA), matmul."""
    return (
        DeviceCase("torch SDPA (baseline)", "torch", _sdpa),
        DeviceCase("torch matmul (baseline)", "torch", _matmul),
    )


def _host_and_wall(call: Callable[[], object], device: torch.device, number: int) -> tuple[float, float]:
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(number):
        call()
    host = time.perf_counter() - start
    torch.cuda.synchronize(device)
    wall = time.perf_counter() - start
    return host / number * 1e6, wall / number * 1e6


def measure_device(
    case: DeviceCase, device: torch.device, *, number: int = 300, repeats: int = 7, profile: bool = True
) -> DeviceRow:
    """Host and wall µs per call of ``case`` (medians over ``repeats`` runs of ``number``)."""
    from tokenspeed_kernel.tools.overhead import breakdown

    call = case.make(device)
    for _ in range(20):  # warm: compilation, selection cache, allocator
        call()
    kernel = (last_kernel() or "?") if case.op != "torch" else "torch"
    runs = [_host_and_wall(call, device, number) for _ in range(repeats)]
    host = statistics.median(r[0] for r in runs)
    wall = statistics.median(r[1] for r in runs)
    shares = breakdown(call, calls=number) if profile and case.op != "torch" else {}
    torch.cuda.synchronize(device)
    return DeviceRow(case.name, case.op, kernel, host, wall, {k: s * host for k, s in shares.items()})


def top_functions(case: DeviceCase, device: torch.device, *, calls: int = 300, top: int = 12) -> str:
    """The ``top`` functions by self time over ``calls`` eager calls (cProfile), as text."""
    import io

    call = case.make(device)
    for _ in range(20):
        call()
    torch.cuda.synchronize(device)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        call()
    profiler.disable()
    torch.cuda.synchronize(device)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    body = text.getvalue()
    return body[body.find("ncalls") :] if "ncalls" in body else body


def run_device(
    device: torch.device, ops: list[str] | None = None, *, number: int = 300, repeats: int = 7, profile: bool = True
) -> list[DeviceRow]:
    """Measure the baselines, then every case (of ``ops``, or all), on ``device``."""
    chosen = [c for c in device_cases() if ops is None or c.op in ops]
    return [
        measure_device(c, device, number=number, repeats=repeats, profile=profile) for c in baselines() + tuple(chosen)
    ]


def device_table(rows: list[DeviceRow]) -> str:
    """One line per row: host and wall µs, host over torch SDPA's, the breakdown."""
    from tokenspeed_kernel.tools.overhead import CATEGORIES

    sdpa = next((r.host_us for r in rows if r.name.startswith("torch SDPA")), float("nan"))
    head = f"{'call':<26} {'kernel':<24} {'host µs':>8} {'wall µs':>8} {'×SDPA':>6}  " + " ".join(
        f"{c:>10}" for c in CATEGORIES
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        parts = " ".join(f"{r.breakdown_us[c]:>10.2f}" if r.breakdown_us else f"{'':>10}" for c in CATEGORIES)
        lines.append(
            f"{r.name:<26} {r.kernel[:24]:<24} {r.host_us:>8.1f} {r.wall_us:>8.1f} {r.host_us / sdpa:>6.2f}  {parts}"
        )
    return "\n".join(lines)


def run_device_cli(args: argparse.Namespace) -> int:
    """``tokenspeed-kernel overhead --device cuda``: the table, then (``--top N``) profiles."""
    import json
    import sys
    from dataclasses import asdict

    device = torch.device(args.device)
    if device.type != "cuda" or not torch.cuda.is_available():
        print(f"overhead --device {args.device}: no CUDA device here (the CPU mode needs no GPU)", file=sys.stderr)
        return 2
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    number = args.number or 300
    if args.top:
        for case in device_cases():
            if args.op is None or case.op in args.op:
                print(f"== {case.name}: top {args.top} functions by self time over {number} calls")
                print(top_functions(case, device, calls=number, top=args.top))
    rows = run_device(device, args.op, number=number, repeats=args.repeats, profile=not args.no_breakdown)
    print(
        f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, python {sys.version.split()[0]}: host µs "
        f"per eager call, {number} calls per run, median of {args.repeats}"
    )
    print(device_table(rows))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return 0
