"""Expert parallelism on 2 GPUs (issue 23): numerics and the GPT-OSS-120B MoE layer, EP=2 vs one GPU.

One process per GPU (spawned by ``tokenspeed_kernel_dev.ranks.run_ranks``, NCCL, NVLink
multicast off: ``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, set before any
process starts; no multicast object is created). The layer is GPT-OSS-120B's MoE: E = 128
experts, top-4, H = I = 2880, swiglu_oai with biases, bf16 activations, MXFP4 weights
(``--weights bf16`` for bf16 weights). Rank r holds experts [r E / W, (r + 1) E / W). Each
rank's routing is ``moe_topk`` of random logits (its own seed).

1. Numerics, per T (tokens per rank): the EP layer (``moe_dispatch_plan`` with
   ``capturable=True`` -> ``triton_moe_dispatch`` + ``triton_moe_combine`` where the Triton
   wheel is installed, else ``torch_moe_dispatch_padded`` + ``torch_moe_combine``;
   ``moe_plan(...).apply`` on the local
   experts with the dispatch's map; ``plan.combine``) against the single-GPU ``moe_apply``
   (``moe_plan`` over all E experts) of the same rank's tokens: relative L2 error and max
   |diff| (bf16 partial sums are rounded once per rank, so a few 1e-3 are expected; the check
   fails above ``--tol``); for T <= 64 also both against the float64 reference
   (``moe_common.reference64``); and the functional ``moe_dispatch`` / ``moe_combine`` (the
   reference all-to-all-v kernel, ``torch_moe_dispatch``) against the plan's result.
2. Times, per T, every rank running the same calls the same number of times (collectives),
   CUDA-graph replays (eager where capture fails, marked), device events, medians of
   ``--reps`` windows of ``--iters`` calls, the slowest rank's: the one-GPU layer on T and on
   W * T tokens (``moe_plan.apply``, all experts, no communication), the EP layer
   (dispatch + experts + combine), its parts (``plan.dispatch``; the local experts;
   the combine kernel alone), and NCCL's own ``all_to_all_single`` of the same payload
   (``W * C * H`` bf16 per rank, C = T) in the same run. Then every other graph-safe
   dispatch and combine kernel the device accepts (the core's where the Triton wheel's won),
   timed the same way (``ep_dispatch:NAME``, ``ep_combine:NAME``) after a check that it
   delivers the plan's kernels' bits; each row names its kernels and wire form (``ep_wire``:
   packed, or split above ``PACK_BYTES``).
3. All-to-all bandwidth: bus bandwidth ``bytes * (W - 1) / W / time`` (nccl-tests'
   convention) of NCCL's ``all_to_all_single``, of our dispatch and of our combine over
   the same activation bytes.

A short table last; JSON under ``$OUT`` (``--json``). Exit status 1 when a numerics check
failed or a rank raised.

Usage on the device (``kind nvidia-h100-x2`` or ``nvidia-h200-x2``; carry ``.whl`` built from
this branch: core, triton, nvidia)::

    python3 -m pip install -q --force-reinstall --no-deps --no-index .whl/*.whl
    python3 ci/device/ep_bench.py --json $OUT/ep_bench.json        # about 2-3 min

On a CPU (gloo ranks, small shapes, the reference kernels; times mean nothing)::

    python3 ci/device/ep_bench.py --cpu                              # about 10 s
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))  # ci/: tokenspeed_kernel_dev

# NVLink multicast stays off (issue 23): set before any rank starts NCCL or symmetric memory.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}

GPT_OSS = {"experts": 128, "top_k": 4, "hidden": 2880, "intermediate": 2880}
CPU_SHAPES = {"experts": 8, "top_k": 2, "hidden": 64, "intermediate": 64}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="gloo ranks on the CPU, small shapes (a smoke run)")
    p.add_argument("--world", type=int, default=2, help="ranks (GPUs) (default: %(default)s)")
    p.add_argument("--tokens", default=None, help="tokens per rank, comma-separated (default: 1,64,4096; CPU: 1,5)")
    p.add_argument("--weights", choices=("mxfp4", "bf16"), default="mxfp4", help="expert weight format")
    p.add_argument("--iters", type=int, default=None, help="calls per timed window (default: 20; CPU: 2)")
    p.add_argument("--reps", type=int, default=None, help="timed windows (default: 5; CPU: 2)")
    p.add_argument("--tol", type=float, default=2e-2, help="largest relative L2 error EP vs one GPU")
    p.add_argument("--no-graph", action="store_true", help="time every call eagerly (no CUDA graphs)")
    p.add_argument("--budget-s", type=float, default=420.0, help="kill the ranks after this long")
    p.add_argument("--json", default=None, help="write the results here (default: $OUT/ep_bench.json if $OUT)")
    args = p.parse_args(argv)
    default_tokens = "1,5" if args.cpu else "1,64,4096"
    args.token_counts = [int(t) for t in (args.tokens or default_tokens).split(",")]
    if any(t < 1 for t in args.token_counts):
        p.error("--tokens: each count must be >= 1")
    if args.world < 2:
        p.error("--world: at least 2 ranks")
    args.iters = args.iters or (2 if args.cpu else 20)
    args.reps = args.reps or (2 if args.cpu else 5)
    args.shapes = CPU_SHAPES if args.cpu else GPT_OSS
    if args.json is None and os.environ.get("OUT"):
        args.json = os.path.join(os.environ["OUT"], "ep_bench.json")
    return args


def log(rank: int, *a: object) -> None:
    if rank == 0:
        print(*a, flush=True)


class Clock:
    """Symmetric timing: every rank runs the same calls the same number of times (the calls
    are collectives). CUDA events on a GPU (a CUDA graph of the call when it captures), the
    wall clock on a CPU."""

    def __init__(self, device: Any, group: Any, iters: int, reps: int, *, graphs: bool = True, rank: int = 0) -> None:
        self.device, self.group, self.iters, self.reps = device, group, iters, reps
        self.graphs, self.rank = graphs, rank

    def _graph(self, fn: Any) -> Any:
        import torch

        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay

    def time(self, name: str, fn: Any) -> dict[str, Any]:
        """``fn`` timed on every rank alike; rank 0 logs the result as it comes (a hang later
        still leaves the rows before it on the screen)."""
        import torch
        import torch.distributed as dist

        cuda = self.device.type == "cuda"
        run, captured, note = fn, False, ""
        if cuda and self.graphs:
            try:
                run, captured = self._graph(fn), True
            except Exception as exc:  # timed eagerly instead, and said so
                note = f"eager ({type(exc).__name__})"
        for _ in range(3):
            run()
        if cuda:
            torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)
        windows = []
        for _ in range(self.reps):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(self.iters):
                    run()
                end.record()
                end.synchronize()
                windows.append(start.elapsed_time(end) * 1e3 / self.iters)
            else:
                t0 = time.perf_counter()
                for _ in range(self.iters):
                    run()
                windows.append((time.perf_counter() - t0) * 1e6 / self.iters)
        result = {"us": statistics.median(windows), "min_us": min(windows), "graph": captured, "note": note}
        log(self.rank, f"  {name}: {result['us']:.1f} us{' (graph)' if captured else ''} {note}".rstrip())
        return result


def _weights(shapes: dict[str, int], fmt: str, device: Any) -> tuple[Any, Any, Any, Any]:
    """GPT-OSS-shaped expert weights and biases (``moe_common``'s, seed 0: every rank the same)."""
    from moe_common import make_weights, quantize

    w13, w2, b13, b2 = make_weights(shapes["experts"], shapes["hidden"], shapes["intermediate"], device, seed=0)
    return quantize(w13, fmt), quantize(w2, fmt), b13, b2


def _slice(w: Any, lo: int, hi: int) -> Any:
    from tokenspeed_kernel.quant import MXFP4Weight

    if isinstance(w, MXFP4Weight):
        return MXFP4Weight(w.packed[lo:hi].contiguous(), w.scales[lo:hi].contiguous())
    return w[lo:hi].contiguous()


def _rel(out: Any, ref: Any) -> dict[str, float]:
    diff = out.double() - ref.double()
    norm = float(ref.double().norm())
    return {"rel_l2": float(diff.norm()) / norm if norm else float(diff.norm()), "max_abs": float(diff.abs().max())}


def rank_main(rank: int, world: int, options: dict[str, Any]) -> dict[str, Any]:
    """One rank's whole run (numerics, then times, per token count); returns its rows."""
    import torch
    import torch.distributed as dist

    from tokenspeed_kernel import moe_plan

    cpu = options["cpu"]
    device = torch.device("cpu") if cpu else torch.device("cuda", rank)
    shapes = options["shapes"]
    num_experts = shapes["experts"]
    per = num_experts // world
    lo, hi = rank * per, (rank + 1) * per if rank < world - 1 else num_experts
    expert_map = torch.full((num_experts,), -1, dtype=torch.int32, device=device)
    expert_map[lo:hi] = torch.arange(hi - lo, dtype=torch.int32, device=device)
    w13, w2, b13, b2 = _weights(shapes, options["weights"], device)
    layer = {"activation": "swiglu_oai", "x_dtype": torch.bfloat16, "top_k": shapes["top_k"]}
    full = moe_plan(w13, w2, w13_bias=b13, w2_bias=b2, **layer)
    # The local experts, planned once with the map every dispatch plan hands out (this rank's
    # map and -1 for the padding id E: MoEDispatched.expert_map).
    local = moe_plan(
        _slice(w13, lo, hi),
        _slice(w2, lo, hi),
        w13_bias=b13[lo:hi].contiguous(),
        w2_bias=b2[lo:hi].contiguous(),
        expert_map=torch.cat([expert_map, expert_map.new_full((1,), -1)]),
        **layer,
    )
    world_setup = {
        "rank": rank,
        "world": world,
        "device": device,
        "group": dist.group.WORLD,
        "expert_map": expert_map,
        "full": full,
        "full_weights": (w13, w2, b13, b2),
        "local": local,
        "clock": Clock(
            device, dist.group.WORLD, options["iters"], options["reps"], graphs=not options["no_graph"], rank=rank
        ),
    }
    rows = [_one_size(tokens, options, **world_setup) for tokens in options["token_counts"]]
    return {"rank": rank, "device": "cpu" if cpu else torch.cuda.get_device_name(device), "rows": rows}


def _one_size(
    tokens: int,
    options: dict[str, Any],
    *,
    rank: int,
    world: int,
    device: Any,
    group: Any,
    expert_map: Any,
    full: Any,
    full_weights: tuple[Any, Any, Any, Any],
    local: Any,
    clock: Clock,
) -> dict[str, Any]:
    """Numerics, times and bandwidth at ``tokens`` tokens per rank (see the module docstring)."""
    import torch
    import torch.distributed as dist

    from tokenspeed_kernel import moe_combine, moe_dispatch, moe_dispatch_plan, moe_topk
    from tokenspeed_kernel.ops.moe.args import MoECombineArgs
    from tokenspeed_kernel.ops.moe.ep_wire import wire_layout

    t_start = time.time()
    shapes = options["shapes"]
    hidden, top_k = shapes["hidden"], shapes["top_k"]
    row: dict[str, Any] = {"tokens": tokens}
    gen = torch.Generator(device=device).manual_seed(1000 + rank)
    x = torch.randn(tokens, hidden, generator=gen, device=device).bfloat16()
    weights, ids = moe_topk(torch.randn(tokens, shapes["experts"], generator=gen, device=device), top_k)
    gathered = []
    for t in (x, weights, ids):
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t, group=group)
        gathered.append(torch.cat(parts))
    x_all, weights_all, ids_all = gathered

    ep = moe_dispatch_plan(
        group,
        expert_map,
        max_tokens=tokens,
        hidden=hidden,
        top_k=top_k,
        x_dtype=torch.bfloat16,
        capturable=not options["cpu"],
    )
    assert torch.equal(ep.expert_map, local.expert_map)

    def ep_layer() -> Any:
        d = ep.dispatch(x, ids, weights)
        return ep.combine(local.apply(d.x, d.topk_weights, d.topk_ids), d.handle)

    # 1. numerics
    got = ep_layer()
    want = full.apply(x, weights, ids)
    row["ep_vs_one_gpu"] = _rel(got, want)
    row["dispatch_kernel"], row["expert_kernel"] = ep.kernel, local.kernel_for(world * tokens)
    d = moe_dispatch(x, ids, weights, group=group, expert_map=expert_map, override="torch_moe_dispatch")
    row["functional_vs_plan"] = _rel(moe_combine(local.apply(d.x, d.topk_weights, d.topk_ids), d.handle), got)
    if tokens <= 64:
        from moe_common import reference64

        ref = reference64(x, *full_weights, weights, ids, "swiglu_oai")
        row["ep_vs_float64"], row["one_gpu_vs_float64"] = _rel(got, ref), _rel(want, ref)
    checks = ("ep_vs_one_gpu", "functional_vs_plan", "ep_vs_float64", "one_gpu_vs_float64")
    row["ok"] = all(row[key]["rel_l2"] <= options["tol"] for key in checks if key in row)
    shown = {key: f"{row[key]['rel_l2']:.2e}" for key in checks if key in row}
    log(rank, f"T={tokens}: rel_l2 {shown} {'ok' if row['ok'] else 'FAILED'}; times (rank 0):")

    # 2. times (every rank the same calls, the same number of times)
    d = ep.dispatch(x, ids, weights)
    y = local.apply(d.x, d.topk_weights, d.topk_ids)
    out = torch.empty_like(x)
    payload = torch.empty(world * tokens, hidden, dtype=torch.bfloat16, device=device)
    received = torch.empty_like(payload)
    combine = ep.combine_spec.fn
    calls = {
        "one_gpu_T": lambda: full.apply(x, weights, ids),
        "one_gpu_WT": lambda: full.apply(x_all, weights_all, ids_all),
        "ep_layer": ep_layer,
        "ep_dispatch": lambda: ep.dispatch(x, ids, weights),
        "ep_experts": lambda: local.apply(d.x, d.topk_weights, d.topk_ids),
        "ep_combine": lambda: combine(MoECombineArgs(y, d.handle.route, group, out)),
        "nccl_all_to_all": lambda: dist.all_to_all_single(received, payload, group=group),
    }
    row["times"] = {name: clock.time(name, call) for name, call in calls.items()}
    row["combine_kernel"] = ep.combine_spec.name
    row["wire"] = "packed" if wire_layout(hidden, top_k, torch.bfloat16, world * tokens).packed else "split"
    # 2b. the other graph-safe exchange kernels this device accepts, timed the same way (the
    # core's padded dispatch and combine where the Triton wheel's rank above them), each
    # checked to deliver the plan's rows (dispatch) or sums (combine of the same y) bit for bit
    for spec in _alternates("moe.dispatch", ep.kernel, ep.dispatch_request, device):
        alt = moe_dispatch_plan(
            group, expert_map, max_tokens=tokens, hidden=hidden, top_k=top_k, x_dtype=torch.bfloat16, override=spec.name
        )
        a = alt.dispatch(x, ids, weights)  # d: the plan's buffers, after dispatches of the same tokens
        valid = d.topk_ids[:, 0] < shapes["experts"]
        same = all(torch.equal(u, v) for u, v in ((a.topk_ids, d.topk_ids), (a.topk_weights, d.topk_weights)))
        same = same and torch.equal(a.x[valid], d.x[valid]) and torch.equal(a.handle.route.slots, d.handle.route.slots)
        alt.combine(y, a.handle)
        row["ok"] = row["ok"] and same
        log(rank, f"  {spec.name}: {'bitwise equal to ' + ep.kernel if same else 'DIFFERS from ' + ep.kernel}")
        row["times"][f"ep_dispatch:{spec.name}"] = clock.time(spec.name, lambda alt=alt: alt.dispatch(x, ids, weights))
    for spec in _alternates("moe.combine", ep.combine_spec.name, ep.combine_request, device):
        out_alt = torch.empty_like(x)
        args = MoECombineArgs(y, d.handle.route, group, out_alt)
        spec.fn(args)
        combine(MoECombineArgs(y, d.handle.route, group, out))
        same = torch.equal(out_alt, out)
        row["ok"] = row["ok"] and same
        log(rank, f"  {spec.name}: {'bitwise equal to ' + ep.combine_spec.name if same else 'DIFFERS'}")
        row["times"][f"ep_combine:{spec.name}"] = clock.time(spec.name, lambda spec=spec, args=args: spec.fn(args))
    # 3. bandwidth over the same activation bytes
    row["bytes_per_rank"] = payload.numel() * payload.element_size()
    row["busbw_gbs"] = _busbw(row, world)
    row["wall_s"] = round(time.time() - t_start, 1)
    return row


def _alternates(op: str, chosen: str, request: Any, device: Any) -> list[Any]:
    """The graph-safe kernels of ``op`` other than ``chosen`` that the selector accepts for
    ``request`` on ``device`` (every rank decides alike: same wheels, same request)."""
    from tokenspeed_kernel.platform import platform_for
    from tokenspeed_kernel.registry import kernels
    from tokenspeed_kernel.selector import select

    found = []
    for spec in kernels(op):
        if spec.name == chosen or not spec.graph_safe:
            continue
        try:
            found.append(select(request, platform_for(device), spec.name))
        except Exception:  # not for this request or device
            continue
    return found


def _busbw(row: dict[str, Any], world: int) -> dict[str, float]:
    """Bus bandwidth (GB/s) of NCCL's all-to-all, our dispatch and our combine (and the
    alternates': ``dispatch:NAME``) over the row's activation bytes per rank:
    ``bytes * (W - 1) / W / time``."""
    bus = row["bytes_per_rank"] * (world - 1) / world
    keys = {"nccl": "nccl_all_to_all", "dispatch": "ep_dispatch", "combine": "ep_combine"}
    keys |= {key.removeprefix("ep_"): key for key in row["times"] if key.startswith(("ep_dispatch:", "ep_combine:"))}
    return {name: bus / (row["times"][key]["us"] * 1e-6) / 1e9 for name, key in keys.items()}


def _merge(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rank 0's rows, each time the slowest rank's and each check the worst rank's."""
    merged = []
    for i, row in enumerate(results[0]["rows"]):
        row = json.loads(json.dumps(row))
        for other in results[1:]:
            theirs = other["rows"][i]
            for name, t in theirs["times"].items():
                if t["us"] > row["times"][name]["us"]:
                    row["times"][name] = t
            for key in ("ep_vs_one_gpu", "functional_vs_plan", "ep_vs_float64", "one_gpu_vs_float64"):
                if key in theirs and theirs[key]["rel_l2"] > row[key]["rel_l2"]:
                    row[key] = theirs[key]
            row["ok"] = row["ok"] and theirs["ok"]
        row["busbw_gbs"] = _busbw(row, len(results))
        merged.append(row)
    return merged


def table(rows: list[dict[str, Any]], world: int) -> str:
    head = (
        f"{'T/rank':>7} {'1 GPU T':>9} {'1 GPU WT':>9} {'EP layer':>9} {'dispatch':>9} {'experts':>9} "
        f"{'combine':>9} {'nccl a2a':>9} {'busbw GB/s nccl/disp/comb':>27} {'rel_l2 EP vs 1':>14} ok"
    )
    lines = [f"times in µs (slowest of {world} ranks; g = CUDA graph, e = eager)", head]
    names = ("one_gpu_T", "one_gpu_WT", "ep_layer", "ep_dispatch", "ep_experts", "ep_combine", "nccl_all_to_all")
    for row in rows:
        cells = " ".join(f"{row['times'][n]['us']:8.1f}{'g' if row['times'][n]['graph'] else 'e'}" for n in names)
        bw = row["busbw_gbs"]
        lines.append(
            f"{row['tokens']:>7} {cells} "
            f"{bw['nccl']:>8.1f}/{bw['dispatch']:>8.1f}/{bw['combine']:>8.1f} "
            f"{row['ep_vs_one_gpu']['rel_l2']:>14.2e} {'yes' if row['ok'] else 'NO'}"
        )
    for row in rows:
        kernels = f"dispatch {row['dispatch_kernel']}, combine {row['combine_kernel']}, {row['wire']} wire rows"
        others = [f"{key.removeprefix('ep_')} {t['us']:.1f}" for key, t in row["times"].items() if ":" in key]
        lines.append(f"  T={row['tokens']}: {kernels}" + ("; others (µs): " + ", ".join(others) if others else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    os.environ.update(MULTICAST_OFF)
    env = dict(MULTICAST_OFF)
    if args.cpu:
        env.setdefault(
            "TOKENSPEED_KERNEL_DISABLE_BACKENDS",
            os.environ.get("TOKENSPEED_KERNEL_DISABLE_BACKENDS", "triton,nvidia,amd"),
        )
    else:
        import torch

        if torch.cuda.device_count() < args.world:
            print(f"ep_bench: needs {args.world} GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
            return 2
    from tokenspeed_kernel_dev.ranks import run_ranks

    names = ("cpu", "token_counts", "weights", "iters", "reps", "tol", "shapes", "no_graph")
    options = {k: getattr(args, k) for k in names}
    started = time.time()
    try:
        results = run_ranks(
            rank_main,
            args.world,
            args=(options,),
            backend="gloo" if args.cpu else "nccl",
            timeout_s=120.0,
            deadline_s=args.budget_s,
            env=env,
        )
    except (RuntimeError, TimeoutError) as exc:
        print(f"ep_bench: FAILED\n{exc}", file=sys.stderr)
        return 1
    rows = _merge(results)
    report = {
        "device": results[0]["device"],
        "world": args.world,
        "weights": args.weights,
        "shapes": args.shapes,
        "env": MULTICAST_OFF,
        "wall_s": round(time.time() - started, 1),
        "rows": rows,
    }
    try:
        from tokenspeed_kernel.tools.common import provenance

        report.update(provenance())
    except Exception:  # provenance is a courtesy: never fail the run over it
        report["provenance_error"] = traceback.format_exc(limit=1)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    ok = all(row["ok"] for row in rows)
    print(f"\n{report['device']} x{args.world}, {args.weights} weights, {report['wall_s']} s")
    print(table(rows, args.world))
    print("numerics: " + ("all within tolerance" if ok else f"FAILED (rel_l2 > {args.tol})"))
    return 0 if ok and all(math.isfinite(r["ep_vs_one_gpu"]["rel_l2"]) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
