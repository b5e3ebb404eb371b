"""transformers integration: an attention function and an experts implementation named
``"tokenspeed"`` that serve Hugging Face models through the public operators.

Importing this module (it imports ``transformers``; ``import tokenspeed_kernel`` never does)
registers, under the name ``"tokenspeed"``:

- an attention function in transformers' ``AttentionInterface`` (and a padding-mask builder
  in its ``AttentionMaskInterface``), served by :func:`~tokenspeed_kernel.mha_prefill`;
- an experts implementation in transformers' ``ExpertsInterface``, served by a
  :func:`~tokenspeed_kernel.moe_plan` per experts module (``MoEPlan.apply`` per step).

Then::

    import tokenspeed_kernel.integrations.transformers  # registers "tokenspeed"
    model = AutoModelForCausalLM.from_config(
        cfg, attn_implementation="tokenspeed", experts_implementation="tokenspeed"
    )

Attention. transformers calls ``fn(module, query, key, value, attention_mask, *, scaling,
dropout, sliding_window, s_aux, ...)`` with ``query [B, Hq, Lq, D]`` and ``key``/``value
[B, Hkv, Lk, D]``: with a ``DynamicCache`` the keys are the cached ones followed by the new
ones, so the queries are the last ``Lq`` of ``Lk`` positions (for a sliding layer the cache
holds only the last ``window - 1`` tokens; positions keep their differences, which is all a
window needs). That is ``mha_prefill``'s bottom-right causal alignment, so the prompt (and
any call with ``Lq > 1`` or padding) is one ``mha_prefill`` over the batch as a ragged
batch. A generated token (``Lq == 1``, no padding) is one ``mha_decode_with_kvcache`` over
the same keys laid out as a paged cache of page size 1 (the decode kernels split long
contexts; a prefill kernel would spend a whole query tile on one row). transformers'
``DynamicCache`` keeps no pages, so both calls copy the keys and values to our layout on
each call (``O(B·Lk)`` per layer per step): the simple correct choice, not the fastest; a
cache that writes straight into pages (``store_kvcache``) would remove the copy. GPT-OSS
specifics: sinks come from ``s_aux`` or ``module.sinks`` (cast to float32), the window from
``sliding_window`` or ``module.sliding_window`` (transformers' window ``w`` lets a query
see the ``w`` positions ending at itself, i.e. ``window_left = w - 1``), the scale from
``scaling``. ``softcap`` maps to ``logit_cap``. Padding: the mask builder gives ``None``
when no row is padded, else the 2-D boolean key mask; each row's valid keys must be one
contiguous run (left or right padding), its padded queries get zeros. Several sequences
packed into one row (``position_ids`` restarting inside a row) raise ``ValueError``.

Experts. transformers calls ``fn(module, hidden_states [T, H], top_k_index [T, k],
top_k_weights [T, k])``. The module's weights are converted once to ``moe_apply``'s layout
(``w13 [E, 2I, H]`` gate rows then up rows, ``w2 [E, H, I]``) and planned; the plan is
rebuilt when a weight tensor changes (pointer or in-place version). GPT-OSS stores
``gate_up_proj [E, H, 2I]`` with gate and up in interleaved columns (gate = even, up = odd),
``down_proj [E, I, H]``, biases ``[E, 2I]``/``[E, H]``, and gates with alpha 1.702 and limit
7.0: that is ``activation="swiglu_oai"``. Other models' experts are served when they use
transformers' default gate (``act_fn(gate) * up``) with SiLU (``"silu"``) or exact GELU
(``"gelu"``); anything else raises ``ValueError``. The copy doubles the experts' memory.

Routing. GPT-OSS's router takes the top k logits, then a softmax over those k: the same
weights as ``moe_topk(logits, k, scoring="softmax", renormalize=True)`` (a softmax over all
experts, top k, renormalized; the common denominator cancels). transformers' router runs
in torch by default; :func:`use_moe_topk_router` swaps it for ``moe_topk`` on a model whose
experts are ``"tokenspeed"``.

Inference only: a call that would need gradients raises ``ValueError``.
:func:`kernel_counts` counts the kernels that served this integration's calls.
"""

from __future__ import annotations

import collections
import importlib
import threading
import types
import weakref
from typing import Any

import torch

try:
    from transformers import AttentionInterface
    from transformers.activations import GELUActivation, SiLUActivation
    from transformers.masking_utils import AttentionMaskInterface
except ImportError as exc:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "tokenspeed_kernel.integrations.transformers needs transformers>=5: pip install 'transformers>=5' "
        "(or pip install tokenspeed-kernel[transformers])"
    ) from exc

try:  # transformers 5.x: experts implementations registered by name
    _hf_moe: types.ModuleType | None = importlib.import_module("transformers.integrations.moe")
except ImportError:  # pragma: no cover - an older transformers without the interface
    _hf_moe = None

from tokenspeed_kernel import MoEPlan, last_kernel, mha_decode_with_kvcache, mha_prefill, moe_plan, moe_topk

ExpertsInterface: Any = getattr(_hf_moe, "ExpertsInterface", None)
_default_apply_gate: Any = getattr(_hf_moe, "_default_apply_gate", None)

__all__ = [
    "NAME",
    "kernel_counts",
    "moe_weights",
    "register",
    "reset_kernel_counts",
    "tokenspeed_attention_forward",
    "tokenspeed_experts_forward",
    "tokenspeed_padding_mask",
    "use_moe_topk_router",
]

NAME = "tokenspeed"

_counts: collections.Counter[tuple[str, str]] = collections.Counter()
_counts_lock = threading.Lock()


def _count(op: str) -> None:
    name = last_kernel()
    with _counts_lock:
        _counts[(op, name or "?")] += 1


def kernel_counts() -> dict[tuple[str, str], int]:
    """``{(op, kernel): calls}`` of the calls this integration made since the last
    :func:`reset_kernel_counts` (ops ``attention.prefill``, ``attention.decode``,
    ``moe.apply``, ``moe.topk``)."""
    with _counts_lock:
        return dict(_counts)


def reset_kernel_counts() -> None:
    """Forget the counts :func:`kernel_counts` returns."""
    with _counts_lock:
        _counts.clear()


def _inference_only(what: str, *tensors: torch.Tensor) -> None:
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise ValueError(
            f"{what} is inference-only (no backward): run the model under torch.no_grad() or "
            "torch.inference_mode(), or pick transformers' own implementation to train"
        )


# --------------------------------------------------------------------------- attention


def tokenspeed_padding_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """The mask transformers hands to :func:`tokenspeed_attention_forward`: None when no key
    is padding, else the bool ``[B, kv_length]`` key-validity mask (the last ``kv_length``
    columns of the 2-D mask: a sliding layer's cache holds only the most recent keys).
    Causality and windows are not in it; the attention call applies them."""
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:]
    if attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
        return None
    return attention_mask


def _sinks(module: torch.nn.Module, s_aux: torch.Tensor | None, num_q_heads: int) -> torch.Tensor | None:
    sinks = s_aux if s_aux is not None else getattr(module, "sinks", None)
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor) or sinks.numel() != num_q_heads:
        raise ValueError(f"sinks (s_aux or module.sinks) must be a tensor of {num_q_heads} per-head logits")
    return sinks.detach().reshape(num_q_heads).to(torch.float32)


def _window_left(module: torch.nn.Module, sliding_window: int | None) -> int:
    window = sliding_window if sliding_window is not None else getattr(module, "sliding_window", None)
    if window is None:
        return -1
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"sliding_window must be a positive int or None, got {window!r}")
    return window - 1


_checked_positions: list[weakref.ref] = []  # the last position_ids tensor found unpacked


def _check_not_packed(position_ids: object) -> None:
    """``ValueError`` when ``position_ids [B, L]`` restart inside a row (several sequences
    packed in one row, which transformers' mask builders detect and our mask builder does
    not serve). Reads the device once per position_ids tensor (the layers of one forward
    share it), not once per layer."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.ndim != 2 or position_ids.shape[1] < 2:
        return
    if _checked_positions and _checked_positions[0]() is position_ids:
        return
    if bool((position_ids[:, 1:] - position_ids[:, :-1] != 1).any()):
        raise ValueError(
            "position_ids restart inside a row (packed sequences): the tokenspeed attention serves one "
            "sequence per row; pass an attention_mask with padding instead"
        )
    _checked_positions[:] = [weakref.ref(position_ids)]


def _packed_rows(mask: torch.Tensor, q_len: int) -> list[tuple[int, int, int, int]]:
    """``(row, key_start, key_end, num_queries)`` per row with a valid query, from the bool
    key mask ``[B, Lk]`` (host read). The valid queries of a row are its last positions that
    fall inside its key run, so they end where the run ends (bottom-right alignment)."""
    kv_len = mask.shape[1]
    valid = mask.to(torch.int32)
    counts = valid.sum(dim=1).tolist()
    starts = valid.argmax(dim=1).tolist()
    rows = []
    for b, (count, start) in enumerate(zip(counts, starts)):
        if count == 0:
            continue
        end = start + count
        if not bool(mask[b, start:end].all()):
            raise ValueError(
                f"attention_mask row {b}: the tokenspeed attention serves left or right padding "
                "(each row's valid tokens one contiguous run); this row's valid tokens are not contiguous"
            )
        num_q = end - max(start, kv_len - q_len)
        if num_q > 0:
            rows.append((b, start, end, num_q))
    return rows


def tokenspeed_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    s_aux: torch.Tensor | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract, served by ``mha_prefill`` (or
    ``mha_decode_with_kvcache`` for one unpadded query per sequence).

    Args:
        module: the attention module (read: ``sinks``, ``sliding_window``, ``scaling``,
            ``is_causal``, ``training``).
        query: ``[B, Hq, Lq, D]``; key/value: ``[B, Hkv, Lk, D]`` / ``[B, Hkv, Lk, Dv]``, the
            queries being the last ``Lq`` of the ``Lk`` positions. Any strides.
        attention_mask: None, or bool ``[B, Lk]`` key validity from
            :func:`tokenspeed_padding_mask`.
        scaling: softmax scale (default ``module.scaling``, else ``1/sqrt(D)``).
        dropout: must be 0 (inference).
        sliding_window: a query sees the ``sliding_window`` positions ending at itself.
        s_aux: GPT-OSS's per-head sink logits ``[Hq]`` (default ``module.sinks``).
        softcap: logit cap (default none).
        is_causal: default ``module.is_causal`` (True).

    Returns:
        ``(out [B, Lq, Hq, Dv] in query's dtype, None)`` (no attention weights); rows of padded
        queries are zeros.
    """
    if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
        raise ValueError(
            f"query/key/value must be [B, H, L, D], got {list(query.shape)}, {list(key.shape)}, {list(value.shape)}"
        )
    if dropout and module.training:
        raise ValueError("dropout must be 0: the tokenspeed attention is inference-only")
    _inference_only("the tokenspeed attention", query, key, value)
    batch, num_q_heads, q_len, _ = query.shape
    kv_len, head_dim_v = key.shape[2], value.shape[3]
    if key.shape[0] != batch or value.shape[:3] != key.shape[:3]:
        raise ValueError(f"key {list(key.shape)} and value {list(value.shape)} must match query's batch {batch}")
    if q_len > kv_len:
        raise ValueError(f"query length {q_len} exceeds key length {kv_len}: the queries must be the last keys")
    scale = scaling if scaling is not None else getattr(module, "scaling", None)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    options: dict[str, Any] = {
        "causal": bool(causal),
        "softmax_scale": None if scale is None else float(scale),
        "window_left": _window_left(module, sliding_window),
        "sinks": _sinks(module, s_aux, num_q_heads),
        "logit_cap": float(softcap) if softcap else 0.0,
    }
    if attention_mask is None and q_len > 1:
        _check_not_packed(kwargs.get("position_ids"))
    q = query.transpose(1, 2)  # [B, Lq, Hq, D]
    k = key.transpose(1, 2)
    v = value.transpose(1, 2)
    if attention_mask is None and q_len == 1:
        return _decode(q.reshape(batch, num_q_heads, -1).contiguous(), k, v, options), None
    if attention_mask is None:
        seq = torch.arange(batch + 1, device=query.device, dtype=torch.int32)
        out = mha_prefill(
            q.reshape(batch * q_len, num_q_heads, -1).contiguous(),
            k.reshape(batch * kv_len, k.shape[2], -1).contiguous(),
            v.reshape(batch * kv_len, v.shape[2], -1).contiguous(),
            seq * q_len,
            seq * kv_len,
            q_len,
            kv_len,
            **options,
        )
        _count("attention.prefill")
        return out.view(batch, q_len, num_q_heads, head_dim_v), None
    if attention_mask.dtype != torch.bool or tuple(attention_mask.shape) != (batch, kv_len):
        raise ValueError(
            f"attention_mask must be None or bool [B, Lk] = [{batch}, {kv_len}] (tokenspeed_padding_mask), "
            f"got {attention_mask.dtype} {list(attention_mask.shape)}; a StaticCache is not served"
        )
    out = query.new_zeros(batch, q_len, num_q_heads, head_dim_v)
    rows = _packed_rows(attention_mask, q_len)
    if not rows:
        return out, None
    first_q = kv_len - q_len  # position of query 0
    q_parts = [q[b, end - n - first_q : end - first_q] for b, _, end, n in rows]
    k_parts = [k[b, start:end] for b, start, end, _ in rows]
    v_parts = [v[b, start:end] for b, start, end, _ in rows]
    q_lens = [n for *_, n in rows]
    k_lens = [end - start for _, start, end, _ in rows]
    cu_q = torch.tensor([0, *_cumsum(q_lens)], dtype=torch.int32, device=query.device)
    cu_k = torch.tensor([0, *_cumsum(k_lens)], dtype=torch.int32, device=query.device)
    packed = mha_prefill(
        torch.cat(q_parts), torch.cat(k_parts), torch.cat(v_parts), cu_q, cu_k, max(q_lens), max(k_lens), **options
    )
    _count("attention.prefill")
    offset = 0
    for b, _, end, n in rows:
        out[b, end - n - first_q : end - first_q] = packed[offset : offset + n]
        offset += n
    return out, None


def _decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: dict[str, Any]) -> torch.Tensor:
    """One new token per sequence: ``mha_decode_with_kvcache`` over the keys laid out as a
    paged cache of page size 1 (``k``/``v [B, Lk, Hkv, D]`` copied to ``[B·Lk, 1, Hkv, D]``,
    page table ``[B, Lk]`` = 0, 1, …). The one query is the last position, so causal or not
    is the same call. Returns ``[B, 1, Hq, Dv]``."""
    batch, kv_len, num_kv_heads = k.shape[:3]
    k_cache = k.reshape(batch * kv_len, 1, num_kv_heads, -1).contiguous()
    v_cache = v.reshape(batch * kv_len, 1, num_kv_heads, -1).contiguous()
    pages = torch.arange(batch * kv_len, device=q.device, dtype=torch.int32).view(batch, kv_len)
    lengths = torch.full((batch,), kv_len, device=q.device, dtype=torch.int32)
    options = {name: value for name, value in options.items() if name != "causal"}
    out = mha_decode_with_kvcache(q, k_cache, v_cache, pages, lengths, kv_len, **options)
    _count("attention.decode")
    return out.unsqueeze(1)


def _cumsum(values: list[int]) -> list[int]:
    total, sums = 0, []
    for value in values:
        total += value
        sums.append(total)
    return sums


# --------------------------------------------------------------------------- experts


def _gating(module: torch.nn.Module) -> tuple[str, bool]:
    """``(moe_apply activation, interleaved)`` of a transformers experts module, read from its
    gate function (not from the ``is_concatenated`` flag, which transformers 5.0 lacks):
    GPT-OSS's gate reads gate/up from even/odd columns, transformers' default gate from the
    two halves. ``ValueError`` for a gate ``moe_apply`` has no activation for."""
    cls = type(module)
    if not getattr(module, "has_gate", True):
        raise ValueError(f"{cls.__name__}: experts without a gate projection are not served by moe_apply")
    if cls.__module__.endswith("gpt_oss.modeling_gpt_oss"):
        if getattr(module, "alpha", None) != 1.702 or getattr(module, "limit", None) != 7.0:
            raise ValueError(
                f"{cls.__name__}: swiglu_oai needs alpha 1.702 and limit 7.0, got "
                f"alpha={getattr(module, 'alpha', None)} limit={getattr(module, 'limit', None)}"
            )
        return "swiglu_oai", True
    if _default_apply_gate is not None and getattr(cls, "_apply_gate", None) is _default_apply_gate:
        act = getattr(module, "act_fn", None)
        if isinstance(act, (torch.nn.SiLU, SiLUActivation)):
            return "silu", False
        if isinstance(act, GELUActivation) or (isinstance(act, torch.nn.GELU) and act.approximate == "none"):
            return "gelu", False
        raise ValueError(f"{cls.__name__}: activation {type(act).__name__} has no moe_apply equivalent (silu, gelu)")
    raise ValueError(
        f"{cls.__name__}: its own gating (_apply_gate) has no moe_apply equivalent; only GPT-OSS's "
        "and transformers' default gate (SiLU or exact GELU) are served"
    )


def _deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``[.., gate0, up0, gate1, up1, ..]`` along ``dim`` → ``[gates.., ups..]``."""
    idx = [slice(None)] * t.ndim
    idx[dim] = slice(0, None, 2)
    gates = t[tuple(idx)]
    idx[dim] = slice(1, None, 2)
    return torch.cat((gates, t[tuple(idx)]), dim=dim)


def _weight(module: torch.nn.Module, name: str) -> torch.Tensor:
    """``module.<name>`` detached; TypeError naming it when it is not a tensor."""
    value = getattr(module, name)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{type(module).__name__}.{name} must be a tensor, got {type(value).__name__}")
    return value.detach()


def moe_weights(
    module: torch.nn.Module, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """A transformers experts module's weights in ``moe_apply``'s layout (new tensors).

    Args:
        module: an experts module decorated by transformers' ``use_experts_implementation``
            (attributes ``gate_up_proj``, ``down_proj``, optional ``*_bias``, the flags
            ``is_transposed``/``has_bias``) with a gate :func:`_gating` knows.
        dtype: the weights' dtype (default: theirs).

    Returns:
        ``(w13 [E, 2I, H], w2 [E, H, I], w13_bias [E, 2I] | None, w2_bias [E, H] | None)``,
        contiguous; ``w13`` rows ``[0, I)`` gate, ``[I, 2I)`` up.
    """
    gate_up, down = _weight(module, "gate_up_proj"), _weight(module, "down_proj")
    if getattr(module, "is_transposed", False):  # [E, H, 2I] / [E, I, H]
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    b13 = b2 = None
    if getattr(module, "has_bias", False):
        b13, b2 = _weight(module, "gate_up_proj_bias"), _weight(module, "down_proj_bias")
    _, interleaved = _gating(module)
    if interleaved:
        gate_up = _deinterleave(gate_up, 1)
        b13 = None if b13 is None else _deinterleave(b13, 1)
    dtype = dtype or gate_up.dtype
    b13, b2 = (None if t is None else t.to(dtype).contiguous() for t in (b13, b2))
    return gate_up.to(dtype).contiguous(), down.to(dtype).contiguous(), b13, b2


def _version(t: torch.Tensor) -> int:
    """The in-place version counter (0 for an inference tensor, which has none)."""
    try:
        return t._version
    except RuntimeError:
        return 0


def _plan(module: torch.nn.Module, x_dtype: torch.dtype, top_k: int) -> MoEPlan:
    """The module's cached plan, rebuilt when its weights change (pointer or version)."""
    names = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")
    params = [getattr(module, n, None) for n in names]
    key = (x_dtype, top_k, *((p.data_ptr(), _version(p), p.device) for p in params if p is not None))
    cached = getattr(module, "_tokenspeed_plan", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    activation, _ = _gating(module)
    w13, w2, b13, b2 = moe_weights(module, x_dtype)
    plan = moe_plan(w13, w2, x_dtype=x_dtype, top_k=top_k, activation=activation, w13_bias=b13, w2_bias=b2)
    # A plain attribute, not a parameter or buffer: never saved. Module.__setattr__ stores such
    # a value in __dict__; written there directly since its annotation admits tensors and modules only.
    module.__dict__["_tokenspeed_plan"] = (key, plan)
    return plan


def tokenspeed_experts_forward(
    module: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' experts-implementation contract, served by a cached ``moe_plan``.

    Args:
        module: the experts module (weights as :func:`moe_weights` reads them).
        hidden_states: ``[T, H]``.
        top_k_index: integer ``[T, k]`` expert ids (int32 or int64).
        top_k_weights: ``[T, k]`` routing weights (any float dtype; cast to float32).

    Returns:
        ``[T, H]`` in hidden_states' dtype: ``Σ_j w[t, j] · expert_{id[t, j]}(x[t])``.
    """
    _inference_only("the tokenspeed experts", hidden_states, top_k_weights)
    if hidden_states.ndim != 2 or top_k_index.ndim != 2:
        raise ValueError(
            f"hidden_states must be [T, H] and top_k_index [T, k], got {list(hidden_states.shape)} "
            f"and {list(top_k_index.shape)}"
        )
    plan = _plan(module, hidden_states.dtype, top_k_index.shape[1])
    out = plan.apply(
        hidden_states.contiguous(),
        top_k_weights.to(torch.float32).contiguous(),
        top_k_index.to(torch.int32).contiguous(),
    )
    _count("moe.apply")
    return out


def _moe_topk_router_forward(self: Any, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPT-OSS's router (``F.linear`` then top k then a softmax over those k) with the top
    k and softmax done by ``moe_topk``: returns ``(logits [T, E], weights float32 [T, k],
    ids int32 [T, k])``; the ids are int32, which only the ``"tokenspeed"`` experts accept.
    ``self``: transformers' ``GptOssTopKRouter`` (``weight``, ``bias``, ``top_k``)."""
    logits = torch.nn.functional.linear(hidden_states, self.weight, self.bias)
    weights, ids = moe_topk(logits, self.top_k, scoring="softmax", renormalize=True)
    _count("moe.topk")
    return logits, weights, ids


def use_moe_topk_router(model: torch.nn.Module) -> int:
    """Route every GPT-OSS router of ``model`` through ``moe_topk`` (the same weights as
    transformers' top-k-then-softmax, computed in float32). The model's experts must be
    ``"tokenspeed"`` (the swapped router returns int32 ids that transformers' own experts do
    not take). Returns the number of routers swapped; ``ValueError`` when none is found or
    the experts are not ``"tokenspeed"``."""
    config = getattr(model, "config", None)
    if getattr(config, "_experts_implementation", None) != NAME:
        raise ValueError(
            f'use_moe_topk_router needs experts_implementation="{NAME}", got '
            f"{getattr(config, '_experts_implementation', None)!r}"
        )
    swapped = 0
    for module in model.modules():
        if type(module).__name__ == "GptOssTopKRouter":
            module.forward = types.MethodType(_moe_topk_router_forward, module)
            swapped += 1
    if not swapped:
        raise ValueError("use_moe_topk_router: the model has no GPT-OSS router (GptOssTopKRouter)")
    return swapped


# --------------------------------------------------------------------------- registration


def register() -> None:
    """Register ``"tokenspeed"`` with transformers (attention, its mask builder, experts).
    Idempotent; importing this module already calls it."""
    AttentionInterface.register(NAME, tokenspeed_attention_forward)
    AttentionMaskInterface.register(NAME, tokenspeed_padding_mask)
    if ExpertsInterface is not None:
        ExpertsInterface.register(NAME, tokenspeed_experts_forward)


register()
