"""``mha_decode_plan``: select a decode kernel once for fixed caches and batch tables, plan, run.

A serving engine's decode step reads batch tables with fixed addresses (``page_table``,
``cache_seqlens``) that it rewrites in place between steps, and is often captured once in
a CUDA graph and replayed. Some kernels need host-side work per batch layout (a library
that builds its split-KV schedule from the lengths, on the host), which must happen outside
capture and again whenever the tables change. A plan splits the call into a plan step and
a run step, the way :func:`~tokenspeed_kernel.moe_plan` fixes weights:

- :func:`mha_decode_plan` validates the caches, tables and options, selects the kernel once
  (``override=`` respected; ``capturable=True`` admits only ``graph_safe`` kernels) and runs
  the kernel's ``prepare_layout`` hook for the tables' current contents;
- :meth:`DecodePlan.update` runs the hook again (no selection) after the engine rewrote the
  tables in place: outside capture, before every replay. A no-op for kernels without one;
- :meth:`DecodePlan.run` is the decode itself with the plan's kernel: checks q (and out)
  only, never selects, adds no host sync, and is capturable when the kernel is. A kernel
  with a ``bind`` hook is bound once, after the first ``prepare_layout``: its runner, which
  has its launch work (grid, configuration, workspaces, compiled kernel) done, serves the runs.

The ``prepare_layout`` hook (``@register_kernel("attention.decode", prepare_layout=...)``)::

    def prepare_layout(args: DecodeArgs) -> None

receives the typed arguments a run would receive: ``page_table``, ``cache_seqlens``,
``max_seqlen_k``, the caches, scales, sinks and scalar options are the plan's own, while
``q``, ``out`` and ``lse`` are placeholders with the run's shape, dtype, device and (q) strides
whose memory must be neither read nor written (broadcast views of one element; for a plan
made with ``q_row_stride``, q is ``[batch, 1, Hq, D]`` with the runs' row stride, a view of a
shared buffer: ``_validate.row_placeholder``). The hook may read
the tables on the host and keep state keyed by them; it must not compute the attention. It
is never called while a stream is capturing.

A row-strided q (``[batch, Hq, D]`` rows with a row stride of their own, as a fused qkv
projection's q): ``mha_decode_plan(..., q_row_stride=S)`` selects with the request the
functional call builds for such a q (``strided_q``, and ``q_align`` from ``S`` with q's base
taken as 16-byte aligned), so a kernel that does not list ``strided_q`` is never chosen; every
run's q must then have exactly strides ``(S, D, 1)`` (and, for a kernel that lists ``q_align``,
an address aligned as assumed: checked per run).

The ``bind`` hook (``@register_kernel("attention.decode", bind=...)``)::

    def bind(args: DecodeArgs) -> Callable[[DecodeArgs], None]

receives the same arguments once per plan and returns the runner called for every run with
that run's ``DecodeArgs`` (the plan's caches, tables and options; the run's q, out and lse:
same shapes and dtypes as the placeholders, new memory). The runner may rely on everything
but q, out and lse being the plan's own objects, and on the tables' contents changing only
between runs (``update`` is called then). Never called while a stream is capturing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from tokenspeed_kernel import config
from tokenspeed_kernel.ops._checks import check_tensor
from tokenspeed_kernel.ops._dispatch import capture_signature, check_capturable, is_capturing, record
from tokenspeed_kernel.ops.attention._validate import (
    check_decode_plan,
    check_out,
    kv_scales,
    placeholder,
    q_layout,
    row_placeholder,
)
from tokenspeed_kernel.ops.attention.api import DecodeCall
from tokenspeed_kernel.ops.attention.args import DecodeArgs, Heads
from tokenspeed_kernel.platform import platform_for
from tokenspeed_kernel.registry import KernelSpec, Request
from tokenspeed_kernel.selector import select

__all__ = ["DecodePlan", "mha_decode_plan"]


@dataclass(frozen=True, eq=False)
class DecodePlan:
    """A decode kernel chosen once for fixed caches and batch tables, planned for their layout.

    Attributes:
        kernel: the selected kernel's name.
        spec: the selected :class:`~tokenspeed_kernel.registry.KernelSpec`.
        request: the selection request (``capturable`` as asked).
        k_cache: ``[num_pages, P, Hkv, D]``. v_cache: ``[num_pages, P, Hkv, Dv]``. Either
            may be a strided view (stride 1 in the head dim), as in the functional call.
        page_table: int32 ``[batch, max_pages_per_seq]``; cache_seqlens: int32 ``[batch]``,
            tokens in the cache INCLUDING the ``q_len`` new ones. The engine rewrites both in
            place (same tensors, same addresses) and calls :meth:`update` before each run
            or replay that follows.
        max_seqlen_k: host bound of ``cache_seqlens`` (a captured step passes its capacity).
        batch, q_len: sequences and queries per sequence of every run.
        heads: head counts and dims. page_size: ``P``.
        q_dtype: the dtype every run's q must have.
        softmax_scale: resolved scale. window_left, logit_cap, return_lse: as in the call.
        sinks: float32 ``[Hq]`` or None.
        k_scale, v_scale: float32 ``[1]`` (fp8 cache) or None.
        capturable: whether the kernel was selected for CUDA-graph capture.
        device: the caches' device (q must be there too).
        q_row_stride: the row stride (elements) every run's 3-D q ``[batch, Hq, D]`` has,
            strides ``(q_row_stride, D, 1)`` (request feature ``strided_q``); None where the
            runs' q is contiguous (also for ``q_row_stride == Hq * D`` and a batch of at most
            one row, which torch calls contiguous at any row stride).
    """

    kernel: str
    spec: KernelSpec
    request: Request
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    page_table: torch.Tensor
    cache_seqlens: torch.Tensor
    max_seqlen_k: int
    batch: int
    q_len: int
    heads: Heads
    page_size: int
    q_dtype: torch.dtype
    softmax_scale: float
    window_left: int
    logit_cap: float
    return_lse: bool
    sinks: torch.Tensor | None
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    capturable: bool
    device: torch.device
    q_row_stride: int | None
    _layout_args: DecodeArgs = field(repr=False)
    # The plan of a run with a 4-D q, and with a 3-D q (None unless q_len == 1): the same
    # DecodeCall the functional call runs, selected once, whose launch serves every run.
    _call4: DecodeCall = field(repr=False)
    _call3: DecodeCall | None = field(repr=False)
    # What serves each run: the kernel's bound runner (its ``bind`` hook), else its ``fn``.
    _run: Callable[[DecodeArgs], None] = field(repr=False)
    # A row-strided plan's q: its strides (3-D) and the byte multiple its address must be
    # (the plan's q_align where the kernel lists q_align, else 1: nothing checked).
    _q_strides: tuple[int, int, int] | None = field(default=None, repr=False)
    _q_align: int = field(default=1, repr=False)
    # For :meth:`_quick_run`: (q's 3-D shape or None, q's 4-D shape or None, the device's
    # index as ``Tensor.get_device`` gives it); None where a run must take the checked path (a
    # kernel that is not graph-safe: the capture state is read at every run; an empty batch).
    _quick: tuple[tuple[int, ...] | None, tuple[int, ...] | None, int] | None = field(default=None, repr=False)

    @property
    def has_layout_hook(self) -> bool:
        """Whether the kernel plans per batch layout (then :meth:`update` does work)."""
        return self.spec.prepare_layout is not None

    def update(self) -> None:
        """Plan again for the current contents of ``page_table``/``cache_seqlens``.

        Call it outside CUDA-graph capture after rewriting the tables in place and before
        the run or replay that reads them. Runs the kernel's ``prepare_layout`` hook (which
        may synchronize with the host); a no-op for kernels without one. ``RuntimeError``
        while the current stream is capturing.
        """
        if is_capturing():
            raise RuntimeError(
                f"DecodePlan.update() ({self.kernel}) must run outside CUDA-graph capture: plan after "
                "rewriting page_table/cache_seqlens and before capturing or replaying"
            )
        if self.spec.prepare_layout is not None and self.batch:  # an empty batch has no layout
            self.spec.prepare_layout(self._layout_args)

    def run(self, q: torch.Tensor, *, out: torch.Tensor | None = None) -> Any:
        """``mha_decode_with_kvcache`` with the plan's kernel, caches, tables and options.

        Args:
            q: ``[batch, Hq, D]`` (when ``q_len == 1``) or ``[batch, q_len, Hq, D]``, in
                ``q_dtype``, contiguous, on the plan's device; for a plan made with
                ``q_row_stride=S``: ``[batch, Hq, D]`` with strides ``(S, D, 1)`` exactly.
            out: optional output shaped like q with ``Dv`` last, in q's dtype.

        Returns:
            ``out`` (shaped like q with ``Dv`` last, q's dtype), or ``(out, lse)`` with lse
            float32 ``[batch * q_len, Hq]`` when the plan was made with ``return_lse``.

        Raises ``ValueError`` naming q for another shape, dtype, device or layout (the
        expected strides), ``RuntimeError`` while the stream is capturing if the kernel is not
        graph-safe.
        """
        if out is None and type(q) is torch.Tensor and q.dtype is self.q_dtype and self._quick is not None:
            run = self._quick_run(q)
            if run is not None:
                return run
        return self._checked_run(q, out)

    def _launch(self, call: DecodeCall, q: torch.Tensor, out: torch.Tensor | None) -> Any:
        """``call.launch`` with the plan's runner, caches, tables and options."""
        return call.launch(
            self._run,
            q,
            self.k_cache,
            self.v_cache,
            self.page_table,
            self.cache_seqlens,
            self.max_seqlen_k,
            self.sinks,
            self.k_scale,
            self.v_scale,
            self.return_lse,
            out,
        )

    def _quick_run(self, q: torch.Tensor) -> Any:
        """The common step, checked with fewer calls: q of the plan's dtype, one of its two
        shapes, its layout (contiguous, or the plan's row strides and alignment) and on its
        device, no ``out``, no compile/debug/capture-file mode, a graph-safe kernel. None when
        anything differs: :meth:`_checked_run` then checks it all and raises what is wrong."""
        assert self._quick is not None  # run() calls this only with one
        shape3, shape4, index = self._quick
        shape, strides = q.shape, self._q_strides
        if (
            (shape != shape4 and shape != shape3)
            or q.get_device() != index
            or (index < 0 and not q.is_cpu)
            or (not q.is_contiguous() if strides is None else q.stride() != strides)
            or (self._q_align > 1 and q.data_ptr() % self._q_align)
        ):
            return None
        if torch.compiler.is_compiling() or config.debug() or config.capture_path() is not None:
            return None
        record(self.spec, self.request)
        return self._launch(self._call4 if len(shape) == 4 else self._call3, q, None)  # type: ignore[arg-type]

    def _check_q_layout(self, q: torch.Tensor) -> None:
        """q contiguous, or (a row-strided plan) 3-D with exactly the plan's strides at an
        address the kernel can read (the byte multiple the plan assumed, where the kernel
        lists ``q_align``). ``ValueError`` naming q and what is expected."""
        strides = self._q_strides
        if strides is None:
            if not q.is_contiguous():
                raise ValueError(
                    f"q must be contiguous for this plan (got strides {q.stride()} for shape {list(q.shape)}); "
                    "a row-strided q [batch, Hq, D] runs through a plan made with q_row_stride=q.stride(0)"
                )
            return
        if q.dim() != 3 or q.stride() != strides:
            raise ValueError(
                f"q must be [batch, Hq, D] with strides {strides} for this plan (made with q_row_stride="
                f"{self.q_row_stride}), got strides {q.stride()} for shape {list(q.shape)}"
            )
        if q.data_ptr() % self._q_align:
            raise ValueError(
                f"q's address must be a multiple of {self._q_align} bytes for this plan's kernel {self.kernel} "
                f"(mha_decode_plan takes a row-strided q's base as 16-byte aligned), got address {q.data_ptr():#x}"
            )

    def _checked_run(self, q: torch.Tensor, out: torch.Tensor | None) -> Any:
        heads = self.heads
        check_tensor("q", q, ndim=(3, 4), dtypes=(self.q_dtype,), contiguous=False)
        q4 = q if q.dim() == 4 else q.unsqueeze(1)
        want = (self.batch, self.q_len, heads.num_q_heads, heads.head_dim)
        if tuple(q4.shape) != want:
            also = f" or {[want[0], *want[2:]]}" if self.q_len == 1 else ""
            raise ValueError(f"q must have shape {list(want)}{also} for this plan, got {list(q.shape)}")
        if q.device != self.device:
            raise ValueError(f"q is on {q.device} but the plan's caches are on {self.device}")
        self._check_q_layout(q)
        call = self._call4 if q.dim() == 4 else self._call3
        assert call is not None  # a 3-D q has q_len == 1, where the plan has its call
        out = check_out(out, call.out_shape, q)

        if torch.compiler.is_compiling():
            return call.trace(
                q,
                self.k_cache,
                self.v_cache,
                self.page_table,
                self.cache_seqlens,
                self.max_seqlen_k,
                self.softmax_scale,
                self.window_left,
                self.sinks,
                self.logit_cap,
                self.k_scale,
                self.v_scale,
                self.return_lse,
                out,
                self.kernel,
            )

        check_capturable(self.spec)
        if config.debug():
            call.debug_check(self.page_table, self.cache_seqlens, self.max_seqlen_k)
        record(self.spec, self.request)
        if config.capture_path() is not None:
            capture_signature("attention.decode", self.kernel, call.signature(max_seqlen_k=self.max_seqlen_k))
        return self._launch(call, q, out)


def mha_decode_plan(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    max_seqlen_k: int,
    *,
    num_q_heads: int,
    q_len: int = 1,
    q_dtype: torch.dtype | None = None,
    softmax_scale: float | None = None,
    window_left: int = -1,
    sinks: torch.Tensor | None = None,
    logit_cap: float = 0.0,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    return_lse: bool = False,
    override: str | None = None,
    capturable: bool = False,
    q_row_stride: int | None = None,
) -> DecodePlan:
    """Validate a decode's fixed inputs, select its kernel once and plan for the tables' layout.

    Arguments mean what they mean for :func:`~tokenspeed_kernel.mha_decode_with_kvcache`
    (the same tensors an engine would pass it every step); ``q`` is described instead of
    passed, since it only exists inside the step:

    Args:
        k_cache: ``[num_pages, P, Hkv, D]`` bf16/fp16/fp32 or float8_e4m3fn; any
            page/token/head strides, stride 1 in the head dim (never copied).
        v_cache: ``[num_pages, P, Hkv, Dv]``, k_cache's dtype, same layout rules.
        page_table: int32 ``[batch, max_pages_per_seq]``; cache_seqlens: int32 ``[batch]``.
            Both are kept by the plan: rewrite them in place, then call ``plan.update()``.
        max_seqlen_k: host bound of ``cache_seqlens`` (for a captured step, the capacity).
        num_q_heads: ``Hq`` of q. q_len: queries per sequence (> 1: speculative decode).
        q_dtype: q's dtype; default k_cache's dtype (required for an fp8 cache).
        softmax_scale, window_left, sinks, logit_cap, k_scale, v_scale, return_lse: as in
            the call; fixed for every run of the plan.
        override: force a kernel by name.
        capturable: select only kernels that can be captured in a CUDA graph (others are
            rejected with "synchronizes with the host; cannot be captured in a CUDA graph";
            an override naming one raises ``KernelOverrideError``).
        q_row_stride: the runs' q is a row-strided ``[batch, Hq, D]`` (``q_len`` 1) with
            strides ``(q_row_stride, D, 1)``, in elements, ``>= Hq * D`` (a fused qkv
            projection's q: ``(Hq + 2 Hkv) * D``), read in place. The kernel is selected for
            such a q as the functional call selects it (``strided_q``; ``q_align`` from the
            row stride's bytes, q's base taken as 16-byte aligned); a kernel that lists
            ``q_align`` gets each run's address checked. None (default): a contiguous q.
            ``ValueError`` for a stride below ``Hq * D`` or with ``q_len > 1``.

    Returns:
        A :class:`DecodePlan`; ``plan.run(q)`` is the per-step call.
    """
    q_dtype, heads, page_size, scale, row_stride = check_decode_plan(
        k_cache,
        v_cache,
        page_table,
        cache_seqlens,
        max_seqlen_k,
        num_q_heads=num_q_heads,
        q_len=q_len,
        q_dtype=q_dtype,
        softmax_scale=softmax_scale,
        window_left=window_left,
        sinks=sinks,
        logit_cap=logit_cap,
        k_scale=k_scale,
        v_scale=v_scale,
        return_lse=return_lse,
        override=override,
        capturable=capturable,
        q_row_stride=q_row_stride,
    )
    batch, device, fp8 = page_table.shape[0], k_cache.device, k_cache.dtype == torch.float8_e4m3fn
    shape4 = (batch, q_len, heads.num_q_heads, heads.head_dim)
    q_like, strided_q, q_align = placeholder(shape4, q_dtype, device), False, None
    if row_stride is not None:  # the runs' layout: what the functional call's request and the hooks see of such a q
        q3 = row_placeholder((batch, *shape4[2:]), row_stride, q_dtype, device)
        (strided_q, q_align), q_like = q_layout(q3), q3.view(shape4)

    def call(q_dims: int) -> DecodeCall:
        return DecodeCall.make(
            q_dtype,
            device,
            k_cache,
            v_cache,
            page_table,
            heads,
            page_size,
            scale,
            window_left=window_left,
            sinks=sinks is not None,
            logit_cap=logit_cap,
            return_lse=return_lse,
            q_len=q_len,
            q_dims=q_dims,
            capturable=capturable,
            strided_q=strided_q,
            q_align=q_align,
        )

    call4 = call(4)
    request = call4.request
    assert request is not None
    spec = select(request, platform_for(device), override)
    ks, vs = kv_scales(fp8, k_scale, v_scale, k_cache)
    layout_args = DecodeArgs(
        q_like,
        k_cache,
        v_cache,
        page_table,
        cache_seqlens,
        max_seqlen_k,
        scale,
        call4.window,
        sinks,
        call4.logit_cap,
        ks,
        vs,
        placeholder(call4.out4, q_dtype, device),
        placeholder(call4.lse3, torch.float32, device) if return_lse else None,
    )
    plan = DecodePlan(
        kernel=spec.name,
        spec=spec,
        request=request,
        k_cache=k_cache,
        v_cache=v_cache,
        page_table=page_table,
        cache_seqlens=cache_seqlens,
        max_seqlen_k=max_seqlen_k,
        batch=batch,
        q_len=q_len,
        heads=heads,
        page_size=page_size,
        q_dtype=q_dtype,
        softmax_scale=scale,
        window_left=window_left,
        logit_cap=float(logit_cap),
        return_lse=return_lse,
        sinks=sinks,
        k_scale=ks,
        v_scale=vs,
        capturable=capturable,
        device=device,
        q_row_stride=row_stride,
        _layout_args=layout_args,
        _call4=call4,
        _call3=call(3) if q_len == 1 else None,
        _run=spec.fn,
        _q_strides=None if row_stride is None else (row_stride, heads.head_dim, 1),
        _q_align=q_align if q_align is not None and "q_align" in dict(spec.shapes) else 1,
    )
    plan.update()
    quick = None
    if spec.graph_safe and batch:
        index = -1 if device.type == "cpu" else (device.index if device.index is not None else 0)
        shape3 = (batch, heads.num_q_heads, heads.head_dim) if q_len == 1 else None
        quick = (shape3, shape4 if row_stride is None else None, index)
    run = spec.bind(layout_args) if spec.bind is not None else spec.fn
    return replace(plan, _run=run, _quick=quick)
