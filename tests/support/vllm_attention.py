"""Builds what vLLM's model runner would hand the TOKENSPEED backend for one step.

- the layer's KV cache: a raw byte buffer viewed ``[num_blocks, Hkv, block_size, 2*D]`` with
  the byte strides vLLM's own ``compute_layout_strides`` gives for a KV cache layout (LBNHC
  = vLLM's default, NHD pages; LBHNC = HND pages), poisoned with NaN;
- vLLM's real ``CommonAttentionMetadata`` for a batch of requests given as
  ``(cached_prefix_len, query_len)``, decodes first (as vLLM orders them), pages allocated
  from a shuffled pool with block 0 left as vLLM's null block;
- the float64 expectation, from the independent attention in ``tests/support``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from support.naive_attention import naive_prefill


@dataclass
class Step:
    """One scheduled step: vLLM's metadata plus the test's own copy of every K/V row."""

    common: object  # vllm.v1.attention.backend.CommonAttentionMetadata
    q: torch.Tensor  # [tokens, Hq, D] activations
    k_new: torch.Tensor  # [tokens, Hkv, D]
    v_new: torch.Tensor
    k_prefix: list[torch.Tensor]  # per request [ctx, Hkv, D] (already in the cache)
    v_prefix: list[torch.Tensor]
    block_table: torch.Tensor  # int32 [B, max_blocks] (persistent, like vLLM's)
    seq_lens: torch.Tensor  # int32 [B]
    requests: list[tuple[int, int]]


def kv_cache_view(spec, num_blocks: int, layout_name: str, dtype: torch.dtype) -> torch.Tensor:
    """One layer's cache as vLLM 0.33 allocates it: ``[num_blocks, Hkv, block_size, D + Dv]``
    over raw bytes, strides from vLLM's ``compute_layout_strides``; filled with NaN bytes."""
    from vllm.v1.kv_cache_interface import KVCacheLayout, compute_layout_strides

    layout = KVCacheLayout[layout_name]
    strides = compute_layout_strides(spec, num_blocks, 1, layout)
    elem = torch.empty((), dtype=dtype).element_size()
    content = spec.head_size + spec.head_size_v
    shape = (1, num_blocks, spec.num_kv_heads, spec.block_size, content * elem)
    size = 1 + sum((n - 1) * s for n, s in zip(shape, strides))
    raw = torch.empty(size, dtype=torch.int8)
    raw.view(torch.uint8).fill_(0xFF)  # all-ones bytes: NaN in bf16, fp16, fp32 and e4m3fn
    view = torch.as_strided(raw, shape, strides)[0]
    return view.view(dtype)


def make_step(
    requests: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    num_blocks: int,
    dtype: torch.dtype,
    seed: int,
    max_blocks: int = 8,
    pad_reqs: int = 0,
) -> Step:
    from vllm.v1.attention.backend import CommonAttentionMetadata

    gen = torch.Generator().manual_seed(seed)
    batch = len(requests)
    rows = batch + pad_reqs
    pool = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0: vLLM's null block
    block_table = torch.zeros(rows, max_blocks, dtype=torch.int32)
    q_lens = [q for _, q in requests]
    seq_lens = torch.zeros(rows, dtype=torch.int32)
    slots: list[int] = []
    for b, (ctx, q_len) in enumerate(requests):
        total = ctx + q_len
        pages = math.ceil(total / block_size)
        assert pages <= max_blocks
        block_table[b, :pages] = torch.tensor([pool.pop() for _ in range(pages)], dtype=torch.int32)
        seq_lens[b] = total
        for pos in range(ctx, total):
            slots.append(int(block_table[b, pos // block_size]) * block_size + pos % block_size)
    qsl = torch.zeros(rows + 1, dtype=torch.int32)
    qsl[1 : batch + 1] = torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0)
    qsl[batch + 1 :] = qsl[batch]
    tokens = int(qsl[-1])

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 0.8).to(dtype)

    common = CommonAttentionMetadata(
        query_start_loc=qsl.clone(),
        query_start_loc_cpu=qsl.clone(),
        seq_lens=seq_lens,
        num_reqs=rows,
        num_actual_tokens=tokens,
        max_query_len=max(q_lens),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=block_table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        causal=True,
        seq_lens_cpu_upper_bound=seq_lens.clone(),
    )
    return Step(
        common=common,
        q=rand(tokens, num_heads, head_size),
        k_new=rand(tokens, num_kv_heads, head_size),
        v_new=rand(tokens, num_kv_heads, head_size),
        k_prefix=[rand(ctx, num_kv_heads, head_size) for ctx, _ in requests],
        v_prefix=[rand(ctx, num_kv_heads, head_size) for ctx, _ in requests],
        block_table=block_table,
        seq_lens=seq_lens,
        requests=requests,
    )


def cache_kv(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The test's own ``[num_blocks, block_size, Hkv, D]`` views of K and V."""
    kv = kv_cache.transpose(1, 2)
    return kv[..., :head_size], kv[..., head_size:]


def write_prefixes(step: Step, kv_cache: torch.Tensor, head_size: int, scale: float = 1.0) -> None:
    """Put every request's cached prefix into its pages (what earlier steps would have
    written); an fp8 cache stores ``value / scale``."""
    k_cache, v_cache = cache_kv(kv_cache, head_size)
    page = k_cache.shape[1]
    for b, (ctx, _) in enumerate(step.requests):
        for pos in range(ctx):
            blk, off = int(step.block_table[b, pos // page]), pos % page
            k_cache[blk, off] = (step.k_prefix[b][pos].float() / scale).to(k_cache.dtype)
            v_cache[blk, off] = (step.v_prefix[b][pos].float() / scale).to(v_cache.dtype)


def read_sequences(step: Step, kv_cache: torch.Tensor, head_size: int, scale: float = 1.0):
    """Every request's full K and V as the cache holds them now, float64 (dequantized)."""
    k_cache, v_cache = cache_kv(kv_cache, head_size)
    page = k_cache.shape[1]
    ks, vs = [], []
    for b, (ctx, q_len) in enumerate(step.requests):
        pos = torch.arange(ctx + q_len)
        blocks = step.block_table[b, pos // page].long()
        ks.append(k_cache[blocks, pos % page].to(torch.float64) * scale)
        vs.append(v_cache[blocks, pos % page].to(torch.float64) * scale)
    return ks, vs


def expected(step: Step, ks, vs, *, scale: float, window_left: int, sinks, logit_cap: float):
    """float64 attention of the step's queries over the given full sequences."""
    q_lens = [q for _, q in step.requests]
    seq = [c + q for c, q in step.requests]
    cu_q = torch.tensor([0, *torch.cumsum(torch.tensor(q_lens), 0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.cumsum(torch.tensor(seq), 0).tolist()], dtype=torch.int32)
    out, _ = naive_prefill(
        step.q.to(torch.float64),
        torch.cat(ks),
        torch.cat(vs),
        cu_q,
        cu_k,
        causal=True,
        softmax_scale=scale,
        window_left=window_left,
        sinks=sinks,
        logit_cap=logit_cap,
    )
    return out
