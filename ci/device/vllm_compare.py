"""vLLM 0.33 on the GPU: the TOKENSPEED backend through vLLM's interface, our public calls
directly, and vLLM's own TRITON_ATTN backend, on the same metadata and the same KV cache, at
GPT-OSS-120B attention shapes (64 query heads, 8 KV heads, head dim 64, bf16, 16-token pages,
sinks; a 128-token window on the sliding layers).

1. numerics: (a) our backend (``impl.do_kv_cache_update`` + ``impl.forward``, as vLLM's
   ``unified_kv_cache_update``/``unified_attention_with_output`` call them), (b) the public
   calls on the same views, (c) vLLM's ``TritonAttentionImpl`` (its unified Triton kernel,
   no ``vllm._C``) with ``TritonAttentionMetadataBuilder``'s metadata; all against float64
   where that fits (B <= 64, the mixed batch), and against each other everywhere;
2. validation through vLLM's CUDA platform (``get_attn_backend_cls``): an fp8_e5m2 cache and
   block size 8 must fail with "Selected backend TOKENSPEED is not valid" and our reason;
3. per-layer times: decode at B = 1, 64, 256 and 8k context, eager and CUDA graph, each
   layer kind (window 128 / full), and one mixed batch (eager: vLLM runs mixed batches
   piecewise). (a) vs (b) is the backend's own cost; (a) vs (c) the comparison with vLLM.

A short table is printed last; everything goes to $OUT/vllm_compare.json.

Setup HERE: ``bash ci/device/vllm_bundle.sh`` (.whl-vllm/, ~24 MiB) and our wheels in .whl
(ci/device/README.md). On the device, carry .whl and .whl-vllm:

    python3 -m pip install -q --force-reinstall --no-deps --no-index .whl/*.whl && \
    python3 -m pip install -q --no-deps --no-index .whl-vllm/wheels/*.whl && \
    mkdir -p /tmp/vllm-py && tar -xJf .whl-vllm/vllm-py.tar.xz -C /tmp/vllm-py && \
    PYTHONPATH=/tmp/vllm-py python3 ci/device/vllm_compare.py

``--smoke`` runs tiny shapes on the CPU (Triton interpreter; no graphs, no vLLM Triton
kernel, no platform check) to exercise the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch

HQ, HKV, D, PAGE = 64, 8, 64, 16
WINDOW = 128
GPT_OSS_120B = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 36,
    "num_attention_heads": HQ,
    "num_key_value_heads": HKV,
    "head_dim": D,
    "num_local_experts": 128,
    "num_experts_per_tok": 4,
    "vocab_size": 201088,
    "sliding_window": WINDOW,
    "layer_types": ["sliding_attention", "full_attention"] * 18,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "attention_bias": True,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "original_max_position_embeddings": 4096,
        "truncate": False,
    },
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


@dataclass
class Report:
    device: str = ""
    platform: str = ""
    numerics: list[dict] = field(default_factory=list)
    validation: list[dict] = field(default_factory=list)
    timings: list[dict] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


# Every Python process of the run (vLLM inspects model classes in a subprocess) imports this
# first: empty stand-ins for vLLM's compiled extensions that are not carried (they target
# torch 2.14): its op library and its FlashAttention package, which vLLM's attention layer
# imports on a CUDA platform. A stand-in attribute raises when called; "is_*" answers False.
_STAND_IN = """
import importlib.util, sys, types


class _NotCarried(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name.isupper():
            return False
        if name.startswith("is_"):
            return lambda *a, **k: False
        if name.endswith("_reason"):
            return lambda *a, **k: "not carried to this machine"

        def missing(*args, **kwargs):
            raise RuntimeError(f"{self.__name__}.{name}: compiled extension not carried to this machine")

        return missing


def _absent(name):
    try:
        return importlib.util.find_spec(name) is None
    except ImportError:
        return True


if _absent("vllm._C_stable_libtorch"):
    sys.modules["vllm._C_stable_libtorch"] = _NotCarried("vllm._C_stable_libtorch")
if _absent("vllm._vllm_fa2_C") and _absent("vllm._vllm_fa3_C"):
    sys.modules["vllm.vllm_flash_attn"] = _NotCarried("vllm.vllm_flash_attn")
if _absent("vllm._C"):  # capability queries some modules make at import: "not supported"
    import torch

    _LIB = torch.library.Library("_C", "FRAGMENT")
    for _name in ("fp4", "fp8", "block_fp8"):
        _LIB.define(f"cutlass_scaled_mm_supports_{_name}(int cuda_device_capability) -> bool")
        _LIB.impl(f"cutlass_scaled_mm_supports_{_name}", lambda cap: False, "CompositeExplicitAutograd")
    _LIB.define("cutlass_group_gemm_supported(int cuda_device_capability) -> bool")
    _LIB.impl("cutlass_group_gemm_supported", lambda cap: False, "CompositeExplicitAutograd")
"""
# The platform, and the model module vLLM's config inspects in a child process.
_PLATFORM_PROBE = (
    "from vllm.platforms import current_platform; import vllm.model_executor.models.gpt_oss; "
    "print(current_platform.device_type)"
)


def _install_stand_in() -> None:
    """Writes :data:`_STAND_IN` as a ``sitecustomize`` module on ``PYTHONPATH`` (for this
    process's children) and runs it here."""
    site = tempfile.mkdtemp(prefix="vllm-stand-in-")
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write(_STAND_IN)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH")) if p)
    exec(compile(_STAND_IN, "sitecustomize", "exec"), {})


def _prepare_vllm(smoke: bool) -> str:
    """Which vLLM platform this run uses; returns a note for the report.

    vLLM's CUDA platform module imports its torch-2.14 extension ``vllm._C_stable_libtorch``
    only to register ops this script never calls (the .so is not carried: the image has torch
    2.11). An empty stand-in, installed in this process and (as ``sitecustomize``) in every
    child (vLLM inspects model classes in a subprocess), lets the real CUDA platform class
    load; nothing here calls ``torch.ops._C``. If the CUDA platform still cannot load (probed
    in a subprocess), vLLM is told it runs on its CPU platform: its config and layer classes,
    its Triton kernels and ours still run on the GPU tensors, only the platform validation step
    is skipped. The CPU smoke run uses the CPU platform too."""
    import subprocess

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if smoke:
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        os.environ.setdefault("TRITON_INTERPRET", "1")
        return "cpu platform (smoke)"
    _install_stand_in()
    probe = subprocess.run([sys.executable, "-c", _PLATFORM_PROBE], capture_output=True, text=True, timeout=300)
    device_type = probe.stdout.strip().splitlines()[-1] if probe.stdout.strip() else ""
    if probe.returncode == 0 and device_type == "cuda":
        return "cuda platform"
    os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    tail = (probe.stderr.strip().splitlines() or ["?"])[-1]
    return f"cpu platform (vLLM's CUDA platform did not load: {tail[:200]})"


def _vllm_config(model_dir: str, max_model_len: int, cudagraph: bool):
    from vllm.config import CacheConfig, CUDAGraphMode, ModelConfig, VllmConfig

    model = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=max_model_len)
    config = VllmConfig(model_config=model, cache_config=CacheConfig(block_size=PAGE))
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE if cudagraph else CUDAGraphMode.NONE
    if cudagraph and not config.compilation_config.cudagraph_capture_sizes:  # vLLM's CPU platform sets none
        config.compilation_config.cudagraph_capture_sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    return config


_names = iter(range(10_000))


def _layers(config, window: int | None, sinks: torch.Tensor, device: torch.device):
    """(ours, vLLM Triton) Attention layers built as GPT-OSS builds them."""
    from tokenspeed_kernel_vllm.attention.backend import TokenspeedAttentionBackend
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention import Attention
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

    made = []
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with set_current_vllm_config(config), torch.device(device):
            for backend in (TokenspeedAttentionBackend, TritonAttentionBackend):
                sink = torch.nn.Parameter(sinks.to(device), requires_grad=False)
                layer = Attention(
                    HQ,
                    D,
                    D**-0.5,
                    num_kv_heads=HKV,
                    cache_config=config.cache_config,
                    per_layer_sliding_window=window,
                    prefix=f"model.layers.{next(_names)}.self_attn.attn",
                    attn_backend=backend,
                    sinks=sink,
                )
                layer.process_weights_after_loading(torch.bfloat16)
                made.append(layer)
    finally:
        torch.set_default_dtype(default)
    return made


def _kv_cache(spec, num_blocks: int, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """One layer's cache in vLLM's default layout (LBNHC), filled with random values."""
    from vllm.v1.kv_cache_interface import KVCacheLayout, compute_layout_strides

    strides = compute_layout_strides(spec, num_blocks, 1, KVCacheLayout.LBNHC)
    shape = (1, num_blocks, HKV, PAGE, 2 * D * 2)
    size = 1 + sum((n - 1) * s for n, s in zip(shape, strides))
    raw = torch.empty(size, dtype=torch.int8, device=device)
    view = torch.as_strided(raw, shape, strides)[0].view(torch.bfloat16)
    for start in range(0, num_blocks, 4096):  # in chunks: the full cache is GBs
        chunk = view[start : start + 4096]
        chunk.copy_(torch.randn(chunk.shape, generator=gen, device=device, dtype=torch.bfloat16) * 0.5)
    return view


def _step(requests, num_blocks: int, device: torch.device, gen: torch.Generator):
    """vLLM's CommonAttentionMetadata for (cached prefix, query length) requests, decodes
    first; q/k/v for the new tokens."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    batch = len(requests)
    max_pages = max((c + q + PAGE - 1) // PAGE for c, q in requests)
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1
    block_table = torch.zeros(batch, max_pages, dtype=torch.int32)
    seq_lens = torch.tensor([c + q for c, q in requests], dtype=torch.int32)
    slots, used = [], 0
    for b, (ctx, q_len) in enumerate(requests):
        pages = (ctx + q_len + PAGE - 1) // PAGE
        block_table[b, :pages] = perm[used : used + pages].to(torch.int32)
        used += pages
        for pos in range(ctx, ctx + q_len):
            slots.append(int(block_table[b, pos // PAGE]) * PAGE + pos % PAGE)
    assert used < num_blocks
    qsl = torch.zeros(batch + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor([q for _, q in requests], dtype=torch.int32), 0)
    tokens = int(qsl[-1])
    common = CommonAttentionMetadata(
        query_start_loc=qsl.to(device),
        query_start_loc_cpu=qsl,
        seq_lens=seq_lens.to(device),
        num_reqs=batch,
        num_actual_tokens=tokens,
        max_query_len=max(q for _, q in requests),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=block_table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        causal=True,
        seq_lens_cpu_upper_bound=seq_lens,
    )

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 0.8).to(torch.bfloat16).to(device)

    return common, rand(tokens, HQ, D), rand(tokens, HKV, D), rand(tokens, HKV, D)


def _fused_q(q: torch.Tensor) -> torch.Tensor:
    """``q [tokens, HQ, D]``'s values as vLLM's qkv split hands q over: the first ``HQ * D``
    columns of rows ``(HQ + 2 HKV) * D`` wide (NaN in the k and v columns), a row-strided view."""
    tokens = q.shape[0]
    qkv = torch.full((tokens, (HQ + 2 * HKV) * D), float("nan"), dtype=q.dtype, device=q.device)
    qkv[:, : HQ * D] = q.flatten(1)
    return qkv[:, : HQ * D].view(tokens, HQ, D)


def _reference(common, q, kv_cache, window: int | None, sinks: torch.Tensor) -> torch.Tensor:
    """float64 attention of every query over its sequence as the cache holds it."""
    k_cache = kv_cache.transpose(1, 2)[..., :D]
    v_cache = kv_cache.transpose(1, 2)[..., D:]
    qsl = common.query_start_loc_cpu.tolist()
    seq = common.seq_lens.cpu().tolist()
    table = common.block_table_tensor
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    sink = sinks.to(q.device, torch.float64).view(HKV, HQ // HKV, 1)
    for b in range(len(seq)):
        q_b = q[qsl[b] : qsl[b + 1]].double()  # [Lq, HQ, D]
        n = seq[b]
        pos = torch.arange(n, device=q.device)
        blocks = table[b, pos // PAGE].long()
        k = k_cache[blocks, pos % PAGE].double()  # [n, HKV, D]
        v = v_cache[blocks, pos % PAGE].double()
        lq = q_b.shape[0]
        qpos = torch.arange(n - lq, n, device=q.device)
        logits = torch.einsum("qhgd,khd->hgqk", q_b.view(lq, HKV, HQ // HKV, D), k) * D**-0.5
        mask = pos[None, :] <= qpos[:, None]
        if window is not None:
            mask &= (qpos[:, None] - pos[None, :]) <= window - 1
        logits = logits.masked_fill(~mask, float("-inf"))
        m = torch.maximum(logits.amax(-1), sink)
        p = torch.exp(logits - m[..., None])
        denom = p.sum(-1) + torch.exp(sink - m)
        o = torch.einsum("hgqk,khd->qhgd", p / denom[..., None], v)
        out[qsl[b] : qsl[b + 1]] = o.reshape(lq, HQ, D)
    return out


def _public(common, q, kv_cache, window, sinks32, num_decodes: int, plan=None) -> torch.Tensor:
    """The same step through the public calls on the same cache views (no vLLM)."""
    from tokenspeed_kernel import mha_decode_with_kvcache, mha_extend_with_kvcache

    k_cache = kv_cache.transpose(1, 2)[..., :D]
    v_cache = kv_cache.transpose(1, 2)[..., D:]
    out = torch.empty_like(q)
    wl = -1 if window is None else window - 1
    nd = int(common.query_start_loc_cpu[num_decodes])
    if num_decodes:
        if plan is not None:
            plan.run(q[:nd], out=out[:nd])
        else:
            mha_decode_with_kvcache(
                q[:nd],
                k_cache,
                v_cache,
                common.block_table_tensor[:num_decodes],
                common.seq_lens[:num_decodes],
                common.max_seq_len,
                window_left=wl,
                sinks=sinks32,
                out=out[:nd],
            )
    if num_decodes < common.num_reqs:
        loc = common.query_start_loc[num_decodes:]
        lens = common.query_start_loc_cpu[num_decodes + 1 :] - common.query_start_loc_cpu[num_decodes:-1]
        mha_extend_with_kvcache(
            q[nd:],
            k_cache,
            v_cache,
            common.block_table_tensor[num_decodes:],
            (loc - loc[0]).to(torch.int32),
            common.seq_lens[num_decodes:],
            int(lens.max()),
            common.max_seq_len,
            window_left=wl,
            sinks=sinks32,
            out=out[nd:],
        )
    return out


def _forward(layer, builder, common, q, k, v, kv_cache, *, update: bool = True) -> torch.Tensor:
    metadata = builder.build(0, common)
    if update:
        layer.impl.do_kv_cache_update(layer, k, v, kv_cache, common.slot_mapping)
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    layer.impl.forward(layer, q, k, v, kv_cache, metadata, output=out)
    return out


def _time(fn, iters: int, warmup: int = 3) -> float:
    """Median milliseconds of fn() (CUDA events; host wall time on the CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _graph_time(fn, iters: int, per_graph: int = 10) -> float:
    """Median milliseconds per fn() replayed from a CUDA graph holding ``per_graph`` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            fn()
    return _time(graph.replay, iters) / per_graph


def _close(name, got, want, tol, report: Report, case: str) -> None:
    got64 = got.double()
    err = (got64 - want).abs().max().item()
    scale = want.abs().max().item() + 1
    ok = bool(torch.isfinite(got64).all()) and err <= tol * scale
    report.numerics.append({"case": case, "pair": name, "max_abs_err": err, "scale": scale, "ok": ok})
    if not ok:
        report.failures.append(f"{case}: {name} max abs err {err:.3g} (tol {tol * scale:.3g})")


def _validation(report: Report) -> None:
    """Bad input through vLLM's own CUDA platform selection."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

    cases = {
        "kv fp8_e5m2": {"kv_cache_dtype": "fp8_e5m2", "block_size": 16},
        "block_size 8": {"kv_cache_dtype": "auto", "block_size": 8},
        "gpt-oss (valid)": {"kv_cache_dtype": "auto", "block_size": 16},
    }
    for name, extra in cases.items():
        config = AttentionSelectorConfig(head_size=D, dtype=torch.bfloat16, has_sink=True, **extra)
        try:
            path = current_platform.get_attn_backend_cls(AttentionBackendEnum["TOKENSPEED"], config)
            result, ok = f"selected {path}", name.endswith("(valid)")
        except ValueError as exc:
            result = str(exc)
            ok = "Selected backend" in result and "TOKENSPEED: " in result
        report.validation.append({"case": name, "ok": ok, "result": result})
        if not ok:
            report.failures.append(f"validation {name}: {result}")


@dataclass
class _Kit:
    """One layer kind's layers, builders, cache and options (see main)."""

    ours: object
    triton: object
    ours_g: object
    ours_b: object
    tri_b: object
    ours_gb: object
    kv_cache: torch.Tensor
    window: int | None
    sinks: torch.Tensor
    sinks32: torch.Tensor
    iters: int
    smoke: bool


def _case(kit: _Kit, case: str, requests, num_decodes: int, num_blocks: int, gen, report: Report) -> dict:
    """Numerics, then per-layer times, of one batch for one layer kind."""
    from tokenspeed_kernel import last_kernel, mha_decode_plan

    ours, triton, ours_g, kv_cache, window, sinks32, iters = (
        kit.ours,
        kit.triton,
        kit.ours_g,
        kit.kv_cache,
        kit.window,
        kit.sinks32,
        kit.iters,
    )
    device = kv_cache.device
    common, q, k, v = _step(requests, num_blocks, device, gen)
    out_a = _forward(ours, kit.ours_b, common, q, k, v, kv_cache)
    kernel_a = last_kernel()
    out_b = _public(common, q, kv_cache, window, sinks32, num_decodes)
    tol = 1.6e-2
    _close("backend vs public", out_a, out_b.double(), 1e-3, report, case)
    if len(requests) <= 66:
        want = _reference(common, q, kv_cache, window, kit.sinks.float())
        _close("backend vs float64", out_a, want, tol, report, case)
        _close("public vs float64", out_b, want, tol, report, case)
    if not kit.smoke:
        out_c = _forward(triton, kit.tri_b, common, q, k, v, kv_cache)
        _close("backend vs vLLM TRITON_ATTN", out_a, out_c.double(), tol, report, case)

    # Times per layer (the step's KV write is timed apart).
    row: dict = {"case": case, "kernel": kernel_a}
    md_a = kit.ours_b.build(0, common)
    out = torch.empty_like(q)
    row["ours_eager_ms"] = _time(lambda: ours.impl.forward(ours, q, k, v, kv_cache, md_a, output=out), iters)
    row["public_eager_ms"] = _time(lambda: _public(common, q, kv_cache, window, sinks32, num_decodes), iters)
    row["ours_store_ms"] = _time(lambda: ours.impl.do_kv_cache_update(ours, k, v, kv_cache, common.slot_mapping), iters)
    if kit.smoke:
        return row
    md_c = kit.tri_b.build(0, common)
    row["vllm_eager_ms"] = _time(lambda: triton.impl.forward(triton, q, k, v, kv_cache, md_c, output=out), iters)
    row["vllm_store_ms"] = _time(
        lambda: triton.impl.do_kv_cache_update(triton, k, v, kv_cache, common.slot_mapping), iters
    )
    if num_decodes < len(requests):
        return row  # a mixed batch: vLLM runs it eagerly between piecewise graphs
    md_g = kit.ours_gb.build(0, common)  # a pure decode with full graphs configured: the plan path
    ours_g.impl.forward(ours_g, q, k, v, kv_cache, md_g, output=out)  # vLLM's warm-up makes the plan
    # The plan runs with max_seqlen_k = max_model_len (its capacity): a kernel may split the
    # keys differently, so bf16 rounding, not bit equality.
    _close("backend (plan) vs public", out, out_b.double(), tol, report, case)
    row["ours_graph_ms"] = _graph_time(lambda: ours_g.impl.forward(ours_g, q, k, v, kv_cache, md_g, output=out), iters)
    # A fused qkv's q (row-strided, as vLLM's models hand it over): the plan made with its row
    # stride reads it in place, no copy in the graph.
    qf = _fused_q(q)
    out.fill_(float("nan"))
    ours_g.impl.forward(ours_g, qf, k, v, kv_cache, md_g, output=out)
    _close("backend (plan, fused-qkv q) vs public", out, out_b.double(), tol, report, case)
    row["ours_graph_fused_q_ms"] = _graph_time(
        lambda: ours_g.impl.forward(ours_g, qf, k, v, kv_cache, md_g, output=out), iters
    )
    plan = mha_decode_plan(
        kv_cache.transpose(1, 2)[..., :D],
        kv_cache.transpose(1, 2)[..., D:],
        common.block_table_tensor,
        common.seq_lens,
        common.max_seq_len,
        num_q_heads=HQ,
        q_dtype=q.dtype,
        window_left=-1 if window is None else window - 1,
        sinks=sinks32,
        capturable=True,
    )
    row["plan_kernel"] = plan.kernel
    row["public_graph_ms"] = _graph_time(lambda: plan.run(q, out=out), iters)
    row["vllm_graph_ms"] = _graph_time(lambda: triton.impl.forward(triton, q, k, v, kv_cache, md_c, output=out), iters)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (interpreter)")
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args()
    smoke = args.smoke
    platform_note = _prepare_vllm(smoke)
    print(f"vLLM platform: {platform_note}", flush=True)
    device = torch.device("cpu" if smoke else "cuda")
    if not smoke and not torch.cuda.is_available():
        print("no CUDA device: run with --smoke on the CPU")
        return 2
    report = Report(device="cpu (smoke)" if smoke else torch.cuda.get_device_name(), platform=platform_note)
    ctx = 64 if smoke else 8192
    batches = (1, 2) if smoke else (1, 64, 256)
    iters = 2 if smoke else args.iters
    gen = torch.Generator().manual_seed(0)
    dev_gen = torch.Generator(device=device).manual_seed(1)

    import tokenspeed_kernel_vllm

    tokenspeed_kernel_vllm.register()
    tmp = tempfile.mkdtemp(prefix="gpt-oss-120b-config-")
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(GPT_OSS_120B, f)
    eager_cfg = _vllm_config(tmp, 256 if smoke else 16384, cudagraph=False)
    graph_cfg = _vllm_config(tmp, 256 if smoke else 16384, cudagraph=not smoke)
    if platform_note == "cuda platform":
        _validation(report)

    sinks = (torch.rand(HQ, generator=gen) * 4 - 2).to(torch.bfloat16)
    num_blocks = max(batches) * (ctx + PAGE) // PAGE + 64
    spec = None
    for window in (WINDOW, None):
        kind = f"window {WINDOW}" if window else "full"
        ours, triton = _layers(eager_cfg, window, sinks, device)
        ours_g, _ = _layers(graph_cfg, window, sinks, device)
        spec = spec or ours.get_kv_cache_spec(eager_cfg)
        kv_cache = _kv_cache(spec, num_blocks, device, dev_gen)
        ours_b = ours.attn_backend.get_builder_cls()(spec, [ours.layer_name], eager_cfg, device)
        ours_gb = ours.attn_backend.get_builder_cls()(spec, [ours_g.layer_name], graph_cfg, device)
        tri_b = triton.attn_backend.get_builder_cls()(spec, [triton.layer_name], graph_cfg, device)
        sinks32 = ours.impl._sinks()

        mixed = [(ctx, 1)] * (4 if smoke else 64) + [(0, 32 if smoke else 1024), (ctx // 2, 16 if smoke else 512)]
        cases = [(f"decode B={b}", [(ctx, 1)] * b, b) for b in batches] + [("mixed", mixed, len(mixed) - 2)]
        kit = _Kit(ours, triton, ours_g, ours_b, tri_b, ours_gb, kv_cache, window, sinks, sinks32, iters, smoke)
        for name, requests, num_decodes in cases:
            row = _case(kit, f"{name} ctx={ctx} {kind}", requests, num_decodes, num_blocks, gen, report)
            report.timings.append(row)
            print(json.dumps(row), flush=True)

    out_dir = os.environ.get("OUT", ".")
    with open(os.path.join(out_dir, "vllm_compare.json"), "w") as f:
        json.dump(report.__dict__, f, indent=1)

    print(f"\nvLLM 0.33 TOKENSPEED vs public calls vs TRITON_ATTN on {report.device} (per layer, ms)")
    for v in report.validation:
        print(f"validation {v['case']}: {'ok' if v['ok'] else 'FAIL'}: {v['result'][:160]}")
    bad = [n for n in report.numerics if not n["ok"]]
    print(f"numerics: {len(report.numerics) - len(bad)}/{len(report.numerics)} within tolerance")
    head = f"{'case':<34} {'kernel':<18} {'ours':>7} {'public':>7} {'vLLM':>7} {'ours/pub':>8} {'vLLM/ours':>9}"
    print(head)
    for row in report.timings:
        for mode in ("eager", "graph"):
            a, b, c = (row.get(f"{who}_{mode}_ms") for who in ("ours", "public", "vllm"))
            if a is None:
                continue
            ratio_pub = f"{a / b:.2f}" if b else "-"
            ratio_vllm = f"{c / a:.2f}x" if c else "-"
            cs = f"{c:7.3f}" if c else "      -"
            print(
                f"{row['case'] + ' ' + mode:<34} {row['kernel'][:18]:<18} {a:7.3f} {b:7.3f} {cs} "
                f"{ratio_pub:>8} {ratio_vllm:>9}"
            )
    for failure in report.failures:
        print("FAIL", failure)
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
