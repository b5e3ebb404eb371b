"""FlashAttention-4's Hopper forward (CuTe DSL) behind ``fa4_prefill_sm90``: routes, variants, call.

FA4 compiles one kernel per :class:`Fa4Variant` (dtype, head dims, GQA group, causal,
window on/off, sinks on/off, LSE on/off); shapes and strides are run-time values. A variant
comes from one of two routes, both giving a TVM-FFI function with the same 18 positional
arguments (:func:`call_args`):

- **AOT bundle** (``TOKENSPEED_KERNEL_FA4_AOT=<dir>``): kernels compiled for sm_90a ahead of
  time on any machine (``ci/device/cutedsl_aot.py``, no GPU needed) and linked into one
  library, ``<dir>/fa4_sm90.so``, beside CuTe DSL's runtime ``libcute_dsl_runtime.so`` and a
  ``manifest.json`` listing the variants. Needs only ``apache-tvm-ffi`` at run time: neither
  flash-attn-4 nor nvidia-cutlass-dsl. Serves exactly the variants listed (the predicate
  rejects the others at selection).
- **JIT** (the ``cutedsl`` extra: ``flash-attn-4==4.0.0b36``, ``nvidia-cutlass-dsl[cu13]``):
  each variant is compiled in-process on its first call (:mod:`._fa4_build`, a few seconds).

Neither route is imported at backend load: :func:`fa4_missing` looks for the bundle's files
and the modules' specs only, and says what is missing.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from tokenspeed_kernel.kit import equal_head_dims
from tokenspeed_kernel.ops.attention.args import PrefillArgs
from tokenspeed_kernel.registry import Request

__all__ = [
    "AOT_ENV",
    "LIBRARY",
    "MANIFEST",
    "MANIFEST_FORMAT",
    "RUNTIME",
    "Fa4Variant",
    "call_args",
    "fa4_missing",
    "fa4_predicate",
    "run",
    "variant_of",
]

AOT_ENV = "TOKENSPEED_KERNEL_FA4_AOT"
MANIFEST = "manifest.json"
LIBRARY = "fa4_sm90.so"
RUNTIME = "libcute_dsl_runtime.so"
MANIFEST_FORMAT = 1
# The JIT route's modules: (import name, distribution that provides it).
_JIT_MODULES = (("flash_attn.cute", "flash-attn-4"), ("cutlass", "nvidia-cutlass-dsl"), ("tvm_ffi", "apache-tvm-ffi"))
_EXTRA = "pip install 'tokenspeed-kernel-nvidia[cutedsl]'"
_DTYPE_TAGS = {torch.bfloat16: "bf16", torch.float16: "fp16"}
_ALIGN = {"q": 16, "k": 16, "v": 16, "out": 16, "cu_seqlens_q": 4, "cu_seqlens_k": 4, "sinks": 4}


@dataclass(frozen=True, order=True)
class Fa4Variant:
    """What one compiled FA4 sm_90 forward is specialized for.

    Attributes:
        dtype: q/k/v/out dtype name, ``"bfloat16"`` or ``"float16"``.
        head_dim / head_dim_v: ``D`` of q/k and ``Dv`` of v.
        group: query heads per KV head, ``Hq // Hkv`` (FA4 packs a group into one tile).
        causal: bottom-right causal mask.
        window: a left window (its size is a run-time argument).
        sinks: a float32 ``[Hq]`` sink logit per query head.
        lse: writes the natural-log LSE.
    """

    dtype: str
    head_dim: int
    head_dim_v: int
    group: int
    causal: bool
    window: bool
    sinks: bool
    lse: bool

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def name(self) -> str:
        """A C identifier naming the variant (the exported symbol is ``__tvm_ffi_<name>``)."""
        tag = _DTYPE_TAGS[self.torch_dtype]
        flags = ("causal" if self.causal else "full") + "_win" * self.window + "_sink" * self.sinks
        return f"fa4_sm90_{tag}_d{self.head_dim}x{self.head_dim_v}_g{self.group}_{flags}" + "_lse" * self.lse

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, entry: dict[str, Any]) -> Fa4Variant:
        """Raises ``ValueError`` for a malformed manifest entry."""
        try:
            variant = cls(**{f.name: entry[f.name] for f in fields(cls)})
            variant.name  # noqa: B018 - validates the dtype
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"bad variant entry {entry!r}: {exc}") from None
        return variant


def variant_of(args: PrefillArgs) -> Fa4Variant:
    """The variant a call needs."""
    _, num_q_heads, head_dim = args.q.shape
    return Fa4Variant(
        dtype=str(args.q.dtype).removeprefix("torch."),
        head_dim=head_dim,
        head_dim_v=args.v.shape[-1],
        group=num_q_heads // args.k.shape[1],
        causal=args.causal,
        window=args.window_left >= 0,
        sinks=args.sinks is not None,
        lse=args.lse is not None,
    )


# ---------------------------------------------------------------------------------------
# Routes
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Bundle:
    """An AOT bundle directory whose files are all present."""

    directory: Path
    variants: frozenset[Fa4Variant]
    meta: dict[str, Any]


def _find_spec(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package that is missing or broken
        return False


@lru_cache(maxsize=8)
def _read_bundle(directory: str) -> _Bundle | str:
    """The bundle at ``directory``, or why it cannot be used (cached per directory)."""
    root = Path(directory)
    missing = [name for name in (MANIFEST, LIBRARY, RUNTIME) if not (root / name).is_file()]
    if missing:
        return f"FA4 AOT bundle {root} ({AOT_ENV}) lacks {', '.join(missing)}"
    try:
        meta = json.loads((root / MANIFEST).read_text())
        if meta.get("format") != MANIFEST_FORMAT:
            return f"FA4 AOT bundle {root}: manifest format {meta.get('format')!r}, expected {MANIFEST_FORMAT}"
        variants = frozenset(Fa4Variant.from_json(entry) for entry in meta["variants"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"FA4 AOT bundle {root}: unreadable {MANIFEST} ({exc})"
    if not _find_spec("tvm_ffi"):
        return f"FA4 AOT bundle {root} needs apache-tvm-ffi, which is not installed"
    return _Bundle(root, variants, meta)


def _route() -> _Bundle | str | None:
    """The bundle named by ``TOKENSPEED_KERNEL_FA4_AOT`` (or why it is unusable); else None
    for the JIT route when its modules are installed; else why neither route exists."""
    directory = os.environ.get(AOT_ENV)
    if directory:
        return _read_bundle(directory)
    absent = [dist for module, dist in _JIT_MODULES if not _find_spec(module)]
    if absent:
        return f"{', '.join(absent)} not installed ({_EXTRA}) and no AOT bundle ({AOT_ENV} unset)"
    return None


def fa4_missing() -> str | None:
    """``available`` hook: why no route can serve FA4 here, else None. Imports nothing."""
    route = _route()
    return route if isinstance(route, str) else None


def fa4_predicate(request: Request) -> str | None:
    """Equal q/k and v head dims (the variants built), and with an AOT bundle, a variant of
    the bundle for the request (fields the request leaves out match any)."""
    why = equal_head_dims(request)
    if why:
        return why
    d, dv = request.shape("head_dim"), request.shape("head_dim_v")
    route = _route()
    if not isinstance(route, _Bundle):
        return None
    hq, hkv = request.shape("num_q_heads"), request.shape("num_kv_heads")
    wanted = {
        "dtype": None if request.dtype("q") is None else str(request.dtype("q")).removeprefix("torch."),
        "head_dim": d,
        "head_dim_v": dv,
        "group": hq // hkv if hq and hkv else None,
        "causal": "non_causal" not in request.features,
        "window": "sliding_window" in request.features,
        "sinks": "sinks" in request.features,
        "lse": "return_lse" in request.features,
    }
    for variant in route.variants:
        if all(value is None or getattr(variant, key) == value for key, value in wanted.items()):
            return None
    shown = " ".join(f"{k}={v}" for k, v in wanted.items() if v is not None)
    return f"no variant in the FA4 AOT bundle for {shown} (build it with ci/device/cutedsl_aot.py)"


# ---------------------------------------------------------------------------------------
# Functions and the call
# ---------------------------------------------------------------------------------------

_lock = threading.Lock()
_functions: dict[tuple[str | None, Fa4Variant], Callable[..., Any]] = {}
_modules: dict[Path, Any] = {}


def _function(variant: Fa4Variant) -> Callable[..., Any]:
    """The compiled function for ``variant`` from the current route (loaded/compiled once)."""
    route = _route()
    if isinstance(route, str):
        raise RuntimeError(f"fa4_prefill_sm90: {route}")
    key = (None if route is None else str(route.directory), variant)
    fn = _functions.get(key)
    if fn is not None:
        return fn
    with _lock:
        fn = _functions.get(key)
        if fn is None:
            fn = _functions[key] = _load(route, variant)
    return fn


def _load(route: _Bundle | None, variant: Fa4Variant) -> Callable[..., Any]:
    if route is None:
        build = importlib.import_module("tokenspeed_kernel_nvidia.ops.attention._fa4_build")
        return build.compile_variant(variant)
    if variant not in route.variants:
        raise ValueError(f"fa4_prefill_sm90: {variant.name} is not in the FA4 AOT bundle {route.directory}")
    module = _modules.get(route.directory)
    if module is None:
        tvm_ffi = importlib.import_module("tvm_ffi")
        module = _modules[route.directory] = tvm_ffi.load_module(str(route.directory / LIBRARY))
    return getattr(module, variant.name)


def call_args(args: PrefillArgs, lse_heads_major: torch.Tensor | None) -> tuple[Any, ...]:
    """FA4's 18 positional arguments (``FlashAttentionForwardSm90.__call__``) for ``args``.

    ``lse_heads_major`` is FA4's varlen LSE layout, float32 ``[Hq, total_q]`` (stride 1 in
    ``total_q``), or None; the window's right edge is 0 when causal, unbounded otherwise.
    Order: q, k, v, out, lse, softmax_scale, cu_seqlens_q, cu_seqlens_k, seqused_q,
    seqused_k, page_table, window_size_left, window_size_right, learnable_sink,
    block-sparse tensors, aux data (tensors, scalars), cu_total_m_blocks,
    cu_total_splits_m_blocks.
    """
    window = args.window_left >= 0
    return (
        args.q,
        args.k,
        args.v,
        args.out,
        lse_heads_major,
        float(args.softmax_scale),
        args.cu_seqlens_q,
        args.cu_seqlens_k,
        None,
        None,
        None,
        args.window_left if window else None,
        0 if window and args.causal else None,
        args.sinks,
        None,
        (None, None),
        None,
        None,
    )


def _check(args: PrefillArgs) -> None:
    if args.logit_cap > 0:
        raise ValueError("fa4_prefill_sm90 has no logit_cap variant (logit_cap must be 0)")
    for name, align in _ALIGN.items():
        tensor = getattr(args, name)
        if tensor is not None and tensor.data_ptr() % align:
            raise ValueError(f"fa4_prefill_sm90: {name} must be {align}-byte aligned (FA4 assumes it)")


def run(args: PrefillArgs) -> None:
    """Launch FA4 for ``args`` (:class:`~tokenspeed_kernel.ops.attention.args.PrefillArgs`:
    q ``[total_q, Hq, D]``, k/v ``[total_k, Hkv, D]``, bf16/fp16, contiguous; writes ``out``
    ``[total_q, Hq, D]`` and ``lse`` float32 ``[total_q, Hq]`` when given)."""
    _check(args)
    total_q, num_q_heads, _ = args.q.shape
    if total_q == 0:
        return
    if args.k.shape[0] == 0:  # FA4 does not launch here either: no key anywhere
        args.out.zero_()
        if args.lse is not None and args.sinks is not None:
            args.lse.copy_(args.sinks.expand_as(args.lse))  # the sink is the only logit
        elif args.lse is not None:
            args.lse.fill_(float("-inf"))
        return
    lse_t = None if args.lse is None else torch.empty(num_q_heads, total_q, dtype=torch.float32, device=args.q.device)
    _function(variant_of(args))(*call_args(args, lse_t))
    if lse_t is not None:
        args.lse.copy_(lse_t.t())
