"""An independent float64 attention, written plainly for tests.

Loops over sequences, heads and queries with positions computed from Python ints; shares no
code with the library. Every function takes the public API's keyword arguments (minus
``out``, ``override`` and ``return_lse``) and returns float64 ``(out, lse)`` shaped like
the public outputs (``lse`` ``[tokens, Hq]``, ``-inf`` for a row that sees nothing and has
no sink). ``naive_store`` returns the expected ``(k_cache, v_cache)``.

    naive_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=True, softmax_scale=None,
                  window_left=-1, sinks=None, logit_cap=0.0)
    naive_extend(q, k_cache, v_cache, page_table, cu_seqlens_q, cache_seqlens, *, causal=True,
                 softmax_scale=None, window_left=-1, sinks=None, logit_cap=0.0, k_scale=None, v_scale=None)
    naive_decode(q, k_cache, v_cache, page_table, cache_seqlens, *, softmax_scale=None,
                 window_left=-1, sinks=None, logit_cap=0.0, k_scale=None, v_scale=None)
    naive_store(k, v, k_cache, v_cache, slot_mapping, *, k_scale=None, v_scale=None)
"""

from __future__ import annotations

import math

import torch


def _f64(t):
    return None if t is None else t.detach().cpu().to(torch.float64)


def _scale_value(scale) -> float:
    if scale is None:
        return 1.0
    return float(scale.reshape(-1)[0]) if isinstance(scale, torch.Tensor) else float(scale)


def _one_row(qv, keys, values, positions, qpos, *, causal, scale, window_left, sink, cap):
    """Attention of a single query vector over lists of key/value vectors (float64)."""
    logits, kept = [], []
    for j, pos in enumerate(positions):
        if causal and pos > qpos:
            continue
        if window_left >= 0 and qpos - pos > window_left:
            continue
        s = float(torch.dot(qv, keys[j])) * scale
        if cap > 0:
            s = cap * math.tanh(s / cap)
        logits.append(s)
        kept.append(j)
    all_logits = logits + ([sink] if sink is not None else [])
    if not all_logits:
        return torch.zeros(values.shape[-1], dtype=torch.float64), float("-inf")
    m = max(all_logits)
    denom = sum(math.exp(s - m) for s in all_logits)
    out = torch.zeros(values.shape[-1], dtype=torch.float64)
    for s, j in zip(logits, kept):
        out += math.exp(s - m) / denom * values[j]
    return out, m + math.log(denom)


def _sequence(q, k, v, q_positions, *, causal, scale, window_left, sinks, cap):
    """q [Lq, Hq, D], k [Lk, Hkv, D], v [Lk, Hkv, Dv] float64; keys at positions 0..Lk-1."""
    num_q, num_q_heads, _ = q.shape
    num_kv_heads = k.shape[1]
    group = num_q_heads // num_kv_heads
    out = torch.zeros(num_q, num_q_heads, v.shape[-1], dtype=torch.float64)
    lse = torch.zeros(num_q, num_q_heads, dtype=torch.float64)
    positions = list(range(k.shape[0]))
    for h in range(num_q_heads):
        kvh = h // group
        sink = None if sinks is None else float(sinks[h])
        for i in range(num_q):
            out[i, h], lse[i, h] = _one_row(
                q[i, h],
                k[:, kvh],
                v[:, kvh],
                positions,
                q_positions[i],
                causal=causal,
                scale=scale,
                window_left=window_left,
                sink=sink,
                cap=cap,
            )
    return out, lse


def _default_scale(softmax_scale, head_dim):
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)


def naive_prefill(
    q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=True, softmax_scale=None, window_left=-1, sinks=None, logit_cap=0.0
):
    q, k, v, sinks = _f64(q), _f64(k), _f64(v), _f64(sinks)
    cq, ck = [int(x) for x in cu_seqlens_q], [int(x) for x in cu_seqlens_k]
    scale = _default_scale(softmax_scale, q.shape[-1])
    outs, lses = [], []
    for b in range(len(cq) - 1):
        lq, lk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        o, lse_b = _sequence(
            q[cq[b] : cq[b + 1]],
            k[ck[b] : ck[b + 1]],
            v[ck[b] : ck[b + 1]],
            [lk - lq + i for i in range(lq)],
            causal=causal,
            scale=scale,
            window_left=window_left,
            sinks=sinks,
            cap=logit_cap,
        )
        outs.append(o)
        lses.append(lse_b)
    return torch.cat(outs), torch.cat(lses)


def _read_sequence(cache, page_table_row, length, scale):
    """The first ``length`` tokens of one sequence from its pages, float64 and dequantized."""
    page_size = cache.shape[1]
    rows = []
    for j in range(length):
        page = int(page_table_row[j // page_size])
        rows.append(cache[page, j % page_size].to(torch.float64) * _scale_value(scale))
    return torch.stack(rows) if rows else torch.zeros(0, *cache.shape[2:], dtype=torch.float64)


def naive_extend(
    q,
    k_cache,
    v_cache,
    page_table,
    cu_seqlens_q,
    cache_seqlens,
    *,
    causal=True,
    softmax_scale=None,
    window_left=-1,
    sinks=None,
    logit_cap=0.0,
    k_scale=None,
    v_scale=None,
):
    q, sinks = _f64(q), _f64(sinks)
    k_cache, v_cache, page_table = k_cache.cpu(), v_cache.cpu(), page_table.cpu()
    cq = [int(x) for x in cu_seqlens_q]
    scale = _default_scale(softmax_scale, q.shape[-1])
    outs, lses = [], []
    for b, length in enumerate(int(x) for x in cache_seqlens):
        lq = cq[b + 1] - cq[b]
        k = _read_sequence(k_cache, page_table[b], length, k_scale)
        v = _read_sequence(v_cache, page_table[b], length, v_scale)
        o, lse_b = _sequence(
            q[cq[b] : cq[b + 1]],
            k,
            v,
            [length - lq + i for i in range(lq)],
            causal=causal,
            scale=scale,
            window_left=window_left,
            sinks=sinks,
            cap=logit_cap,
        )
        outs.append(o)
        lses.append(lse_b)
    return torch.cat(outs), torch.cat(lses)


def naive_decode(
    q,
    k_cache,
    v_cache,
    page_table,
    cache_seqlens,
    *,
    softmax_scale=None,
    window_left=-1,
    sinks=None,
    logit_cap=0.0,
    k_scale=None,
    v_scale=None,
):
    three_d = q.dim() == 3
    q4 = _f64(q).unsqueeze(1) if three_d else _f64(q)
    batch, q_len = q4.shape[:2]
    cu = torch.arange(0, (batch + 1) * q_len, q_len)
    out, lse = naive_extend(
        q4.flatten(0, 1),
        k_cache,
        v_cache,
        page_table,
        cu,
        cache_seqlens,
        causal=True,
        softmax_scale=softmax_scale,
        window_left=window_left,
        sinks=sinks,
        logit_cap=logit_cap,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    out = out.view(batch, q_len, *out.shape[1:])
    return (out.squeeze(1) if three_d else out), lse


def naive_store(k, v, k_cache, v_cache, slot_mapping, *, k_scale=None, v_scale=None):
    k_out, v_out = k_cache.clone().cpu(), v_cache.clone().cpu()
    page_size = k_cache.shape[1]
    for t, slot in enumerate(int(s) for s in slot_mapping):
        if slot < 0:
            continue
        for src, dst, scale in ((k, k_out, k_scale), (v, v_out, v_scale)):
            row = src[t].detach().cpu().to(torch.float64)
            if dst.dtype == torch.float8_e4m3fn:
                row = (row / _scale_value(scale)).clamp(-448.0, 448.0)
            dst[slot // page_size, slot % page_size] = row.to(dst.dtype)
    return k_out, v_out


NAIVE = {"attention.prefill": naive_prefill, "attention.extend": naive_extend, "attention.decode": naive_decode}


def naive_for_case(case, inputs):
    """The float64 ``(out, lse)`` of a ``tokenspeed_kernel.tools.cases`` attention case."""
    kwargs = {k: v for k, v in inputs.items() if k not in ("max_seqlen_q", "max_seqlen_k", "return_lse")}
    return NAIVE[case.op](**kwargs)


def check_case(case, inputs, *, kernel: str, tol: float, device, expected=None) -> None:
    """Run ``case`` through the public call into a NaN-poisoned output, assert the selector
    picked ``kernel``, that every element was written, and that out (and LSE when asked)
    match ``expected`` (default: :func:`naive_for_case`) within ``tol`` relative to scale."""
    from tokenspeed_kernel.ops._dispatch import last_kernel
    from tokenspeed_kernel.tools import cases

    expected_out, expected_lse = expected or naive_for_case(case, inputs)
    poisoned = torch.full(expected_out.shape, float("nan"), dtype=case.dtype, device=device)
    result = cases.call(case, inputs, out=poisoned)
    assert last_kernel() == kernel, f"selector picked {last_kernel()}"
    out, lse = result if case.return_lse else (result, None)
    assert not torch.isnan(out).any(), "NaN in the output: a poisoned key or an unwritten element"
    scale = float(expected_out.abs().max()) + 1.0
    torch.testing.assert_close(out.double().cpu(), expected_out, atol=tol * scale, rtol=tol)
    if case.return_lse:
        torch.testing.assert_close(lse.double().cpu(), expected_lse, atol=2e-3, rtol=2e-3)
