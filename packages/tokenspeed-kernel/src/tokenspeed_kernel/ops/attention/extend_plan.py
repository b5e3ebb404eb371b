"""``mha_extend_plan``: one step's extend checked and its kernel selected once, run per layer.

A serving engine's prefill or mixed step calls ``mha_extend_with_kvcache`` once per attention
layer with the same batch tables (``page_table``, ``cu_seqlens_q``, ``cache_seqlens`` and
their host bounds) and the same options; only q, the layer's caches, its sinks (and fp8
scales) and out change from layer to layer. Each functional call pays its call key (every
tensor's shape, strides, dtype, device), the plan-cache lookup and the selection again. A
plan pays them once per step:

- :func:`mha_extend_plan` takes the arguments of the step's first call, checks them in full
  exactly as ``mha_extend_with_kvcache`` would (the same errors), and selects the kernel once
  (``override=`` respected);
- :meth:`ExtendPlan.run` is the call of every layer: q, the caches, sinks, scales and out
  must have the layout of the plan's own (shape, strides, storage offset, dtype, device: what
  the checks and the selection read of them); it then builds the kernel's arguments and
  launches: no call key, no lookup, no selection. A kernel with a ``bind`` hook is bound on
  the plan's first run outside CUDA-graph capture (its runner, which has the launch work of
  the plan's layout done, serves the later runs: the kernel's own key is skipped too). A run
  whose tensors differ
  in layout is checked in full like a functional call (raising what is wrong) and served by
  the plan's kernel when it asks for the same selection, else refused with a ``ValueError``.

The tables are kept by the plan and read by every run: an engine may rewrite their contents
in place between runs, within the plan's ``max_seqlen_q``/``max_seqlen_k`` bounds and the
same ``total_q``. No kernel of this operator plans on the host per batch layout, so a plan
has no ``update``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenspeed_kernel import config
from tokenspeed_kernel.ops._checks import Uncacheable, arg_key
from tokenspeed_kernel.ops._dispatch import check_capturable, is_capturing, record
from tokenspeed_kernel.ops.attention._validate import kv_scales
from tokenspeed_kernel.ops.attention.api import EXTEND, ExtendCall
from tokenspeed_kernel.ops.attention.args import ExtendArgs, Heads
from tokenspeed_kernel.platform import platform_for
from tokenspeed_kernel.registry import KernelSpec, Request
from tokenspeed_kernel.selector import select

__all__ = ["ExtendPlan", "mha_extend_plan"]


def _layout(
    q: object, k_cache: object, v_cache: object, sinks: object, k_scale: object, v_scale: object
) -> Hashable | None:
    """What the checks and the selection read of a run's per-layer arguments (their
    :func:`~tokenspeed_kernel.ops._checks.arg_key`), or None for an argument no key stands for."""
    try:
        return (arg_key(q), arg_key(k_cache), arg_key(v_cache), arg_key(sinks), arg_key(k_scale), arg_key(v_scale))
    except Uncacheable:
        return None


def _out_layout(out: torch.Tensor) -> tuple:
    """What the checks read of ``out`` (its shape, dtype, device and strides; its address
    reaches no check nor the selection)."""
    return (out.shape, out.dtype, out.device, out.stride())


@dataclass(frozen=True, eq=False)
class ExtendPlan:
    """An extend kernel chosen once for one step's batch tables and options.

    Attributes:
        kernel: the selected kernel's name. spec: its :class:`~tokenspeed_kernel.registry.KernelSpec`.
        request: the selection request.
        page_table: int32 ``[batch, max_pages_per_seq]``; cu_seqlens_q: int32 ``[batch + 1]``;
            cache_seqlens: int32 ``[batch]`` (tokens in the cache INCLUDING the chunk): the
            step's tables, read by every run (see the module docstring).
        max_seqlen_q, max_seqlen_k: their host bounds. total_q: query rows of every run.
        heads: head counts and dims. page_size: ``P``.
        causal, window_left, logit_cap, return_lse: as in the call. softmax_scale: resolved.
        device: the device of every tensor.
    """

    kernel: str
    spec: KernelSpec
    request: Request
    page_table: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cache_seqlens: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    total_q: int
    heads: Heads
    page_size: int
    causal: bool
    softmax_scale: float
    window_left: int
    logit_cap: float
    return_lse: bool
    device: torch.device
    # The functional call's plan (outputs' shapes, the kernel's window and cap, fp8), the
    # per-layer layout every quick run must have, and out's.
    _call: ExtendCall = field(repr=False)
    _layout: Hashable = field(repr=False)
    _out: tuple = field(repr=False)
    # What serves the quick runs: [the kernel's bound runner], empty until the first run
    # outside capture binds it (``spec.fn`` serves until then, and for a kernel without one).
    _runner: list[Callable[[ExtendArgs], None]] = field(default_factory=list, repr=False)

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        *,
        sinks: torch.Tensor | None = None,
        k_scale: float | torch.Tensor | None = None,
        v_scale: float | torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> Any:
        """``mha_extend_with_kvcache`` of one layer with the plan's tables, options and kernel.

        Args:
            q: ``[total_q, Hq, D]``, contiguous, the dtype and device of the plan's first call.
            k_cache, v_cache: ``[num_pages, P, Hkv, D]`` / ``[..., Dv]``, any page/token/head
                strides (stride 1 in the head dim), laid out as the plan's first call's.
            sinks: float32 ``[Hq]`` when the plan was made with sinks, else None.
            k_scale, v_scale: an fp8 cache's scales (as in the call), else None.
            out: optional ``[total_q, Hq, Dv]`` in q's dtype, contiguous.

        Returns:
            ``out`` (``[total_q, Hq, Dv]``, q's dtype), or ``(out, lse)`` with lse float32
            ``[total_q, Hq]`` when the plan was made with ``return_lse``.
        """
        if (
            _layout(q, k_cache, v_cache, sinks, k_scale, v_scale) != self._layout
            or (out is not None and (type(out) is not torch.Tensor or _out_layout(out) != self._out))
            or torch.compiler.is_compiling()
            or config.debug()
            or config.capture_path() is not None
        ):
            return self._checked_run(q, k_cache, v_cache, sinks, k_scale, v_scale, out)
        call = self._call
        check_capturable(self.spec)
        record(self.spec, self.request)
        if out is None:
            out = q.new_empty(*call.out_shape)
        lse = torch.empty(*call.lse_shape, dtype=torch.float32, device=self.device) if self.return_lse else None
        if self.total_q:  # no queries (an empty batch): nothing to compute, nothing launched
            ks, vs = kv_scales(call.fp8, k_scale, v_scale, q)
            args = ExtendArgs(
                q,
                k_cache,
                v_cache,
                self.page_table,
                self.cu_seqlens_q,
                self.cache_seqlens,
                min(self.max_seqlen_q, self.total_q),
                self.max_seqlen_k,
                self.causal,
                self.softmax_scale,
                call.window,
                sinks,
                call.logit_cap,
                ks,
                vs,
                out,
                lse,
            )
            (self._runner[0] if self._runner else self._bind(args))(args)
        return (out, lse) if self.return_lse else out

    def _bind(self, args: ExtendArgs) -> Callable[[ExtendArgs], None]:
        """What serves ``args`` (the first quick run's): the kernel's ``bind`` hook's runner,
        kept for the later runs, or ``spec.fn`` (no hook; or while capturing, where hooks are
        never called: a later run binds)."""
        if self.spec.bind is None:
            self._runner.append(self.spec.fn)
        elif not is_capturing():
            self._runner.append(self.spec.bind(args))
        else:
            return self.spec.fn
        return self._runner[0]

    def _call_args(
        self, q: object, k_cache: object, v_cache: object, sinks: object, k_scale: object, v_scale: object, out: object
    ) -> tuple:
        """The functional call of this run, in ``mha_extend_with_kvcache``'s order."""
        return (
            q,
            k_cache,
            v_cache,
            self.page_table,
            self.cu_seqlens_q,
            self.cache_seqlens,
            self.max_seqlen_q,
            self.max_seqlen_k,
            self.causal,
            self.softmax_scale,
            self.window_left,
            sinks,
            self.logit_cap,
            k_scale,
            v_scale,
            self.return_lse,
            out,
            self.kernel,
        )

    def _checked_run(
        self, q: object, k_cache: object, v_cache: object, sinks: object, k_scale: object, v_scale: object, out: object
    ) -> Any:
        """A run the quick path does not take (another layout, ``torch.compile``, debug or
        capture-file mode): the functional call with the plan's kernel, checked in full; a
        layout that asks for another selection than the plan's is refused."""
        call = self._call_args(q, k_cache, v_cache, sinks, k_scale, v_scale, out)
        if not torch.compiler.is_compiling():
            checked = ExtendCall.check(False, *call)  # raises what is wrong, naming the argument
            if checked.request != self.request or checked.total_q != self.total_q:
                raise ValueError(
                    f"ExtendPlan ({self.kernel}): this run's q/k_cache/v_cache/sinks differ from the plan's in what "
                    f"selects the kernel (plan: {self.request}, total_q {self.total_q}; run: {checked.request}, "
                    f"total_q {checked.total_q}); make a plan for them"
                )
        return EXTEND.call(*call)


def mha_extend_plan(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cache_seqlens: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    window_left: int = -1,
    sinks: torch.Tensor | None = None,
    logit_cap: float = 0.0,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    override: str | None = None,
) -> ExtendPlan:
    """Check one step's first extend call in full, select its kernel once, and plan the rest.

    Takes exactly the arguments of :func:`~tokenspeed_kernel.mha_extend_with_kvcache` (see
    there for every tensor's shape, dtype and layout) and raises what that call would raise.
    Nothing is computed: run the first layer too with ``plan.run(q, k_cache, v_cache, ...)``.

    Returns:
        An :class:`ExtendPlan`: the tables, their host bounds and the options are fixed; q,
        the caches, sinks, scales and out are each run's, laid out as the ones given here.
    """
    call = (
        q,
        k_cache,
        v_cache,
        page_table,
        cu_seqlens_q,
        cache_seqlens,
        max_seqlen_q,
        max_seqlen_k,
        causal,
        softmax_scale,
        window_left,
        sinks,
        logit_cap,
        k_scale,
        v_scale,
        return_lse,
        out,
        override,
    )
    checked = ExtendCall.check(False, *call)
    request = checked.request
    assert request is not None  # checked outside tracing
    spec = select(request, platform_for(checked.device), override)
    return ExtendPlan(
        kernel=spec.name,
        spec=spec,
        request=request,
        page_table=page_table,
        cu_seqlens_q=cu_seqlens_q,
        cache_seqlens=cache_seqlens,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        total_q=checked.total_q,
        heads=checked.heads,
        page_size=checked.page_size,
        causal=causal,
        softmax_scale=checked.scale,
        window_left=window_left,
        logit_cap=float(logit_cap),
        return_lse=return_lse,
        device=checked.device,
        _call=checked,
        _layout=_layout(q, k_cache, v_cache, sinks, k_scale, v_scale),
        _out=(torch.Size(checked.out_shape), q.dtype, q.device, _contiguous_strides(checked.out_shape)),
    )


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
