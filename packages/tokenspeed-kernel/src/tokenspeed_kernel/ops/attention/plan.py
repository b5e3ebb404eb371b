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
``q``, ``out`` and ``lse`` are placeholders with the run's shape, dtype and device whose
memory must be neither read nor written (broadcast views of one element). The hook may read
the tables on the host and keep state keyed by them; it must not compute the attention. It
is never called while a stream is capturing.

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

import torch

from tokenspeed_kernel import config
from tokenspeed_kernel.ops._checks import ACT_DTYPES, check_int, check_same_device, check_tensor, dtype_name
from tokenspeed_kernel.ops._dispatch import capture_signature, check_capturable, is_capturing, record
from tokenspeed_kernel.ops.attention._validate import (
    cache_layout,
    check_decode,
    check_out,
    check_paged_cache_pair,
    debug_check_pages,
)
from tokenspeed_kernel.ops.attention.api import _kernel_window, _result, _signature, attention_request
from tokenspeed_kernel.ops.attention.args import DecodeArgs, Heads
from tokenspeed_kernel.platform import platform_for
from tokenspeed_kernel.registry import KernelSpec, Request
from tokenspeed_kernel.selector import select

__all__ = ["DecodePlan", "mha_decode_plan"]


def _placeholder(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` on ``device`` backed by one element (a broadcast
    view): carries shape, dtype and device to a ``prepare_layout`` hook, never data."""
    return torch.empty((1,) * len(shape), dtype=dtype, device=device).expand(shape)


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
    _layout_args: DecodeArgs = field(repr=False)
    # What serves each run: the kernel's bound runner (its ``bind`` hook), else its ``fn``.
    _run: Callable[[DecodeArgs], None] = field(repr=False)
    # For :meth:`_quick_run`: (q's 3-D shape or None, q's 4-D shape, the device's index as
    # ``Tensor.get_device`` gives it); None where a run must take the checked path (a kernel
    # that is not graph-safe: the capture state is read at every run; an empty batch).
    _quick: tuple[tuple[int, ...] | None, tuple[int, ...], int] | None = field(default=None, repr=False)

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

    def run(self, q: torch.Tensor, *, out: torch.Tensor | None = None):
        """``mha_decode_with_kvcache`` with the plan's kernel, caches, tables and options.

        Args:
            q: ``[batch, Hq, D]`` (when ``q_len == 1``) or ``[batch, q_len, Hq, D]``, in
                ``q_dtype``, contiguous, on the plan's device.
            out: optional output shaped like q with ``Dv`` last, in q's dtype.

        Returns:
            ``out`` (shaped like q with ``Dv`` last, q's dtype), or ``(out, lse)`` with lse
            float32 ``[batch * q_len, Hq]`` when the plan was made with ``return_lse``.

        Raises ``RuntimeError`` while the stream is capturing if the kernel is not graph-safe.
        """
        if out is None and type(q) is torch.Tensor and q.dtype is self.q_dtype and self._quick is not None:
            run = self._quick_run(q)
            if run is not None:
                return run
        return self._checked_run(q, out)

    def _args(self, q4: torch.Tensor, out4: torch.Tensor, lse3: torch.Tensor | None) -> DecodeArgs:
        """The plan's caches, tables and options with this run's q, out and lse, built field by
        field (``dataclasses.replace`` costs microseconds per call)."""
        p = self._layout_args
        return DecodeArgs(
            q4,
            p.k_cache,
            p.v_cache,
            p.page_table,
            p.cache_seqlens,
            p.max_seqlen_k,
            p.softmax_scale,
            p.window_left,
            p.sinks,
            p.logit_cap,
            p.k_scale,
            p.v_scale,
            out4,
            lse3,
        )

    def _quick_run(self, q: torch.Tensor):
        """The common step, checked with fewer calls: q of the plan's dtype, one of its two
        shapes, contiguous and on its device, no ``out``, no compile/debug/capture-file mode,
        a graph-safe kernel. None when anything differs: :meth:`_checked_run` then checks it
        all and raises what is wrong."""
        assert self._quick is not None  # run() calls this only with one
        shape3, shape4, index = self._quick
        shape = q.shape
        if (
            (shape != shape4 and shape != shape3)
            or q.get_device() != index
            or (index < 0 and not q.is_cpu)
            or not q.is_contiguous()
        ):
            return None
        if torch.compiler.is_compiling() or config.debug() or config.capture_path() is not None:
            return None
        record(self.spec, self.request)
        out = q.new_empty(shape4)
        lse = torch.empty(shape4[:3], dtype=torch.float32, device=q.device) if self.return_lse else None
        self._run(self._args(q if len(shape) == 4 else q.view(shape4), out, lse))
        out = out.view(shape) if len(shape) == 3 else out  # a 3-D q has shape3
        return _result(out, None if lse is None else lse.view(shape4[0] * shape4[1], shape4[2]), self.return_lse)

    def _checked_run(self, q: torch.Tensor, out: torch.Tensor | None):
        heads = self.heads
        check_tensor("q", q, ndim=(3, 4), dtypes=(self.q_dtype,))
        q4 = q if q.dim() == 4 else q.unsqueeze(1)
        want = (self.batch, self.q_len, heads.num_q_heads, heads.head_dim)
        if tuple(q4.shape) != want:
            also = f" or {[want[0], *want[2:]]}" if self.q_len == 1 else ""
            raise ValueError(f"q must have shape {list(want)}{also} for this plan, got {list(q.shape)}")
        if q.device != self.device:
            raise ValueError(f"q is on {q.device} but the plan's caches are on {self.device}")
        out_shape = (*q.shape[:-1], heads.head_dim_v)
        out = check_out(out, out_shape, q)

        if torch.compiler.is_compiling():
            result, lse = torch.ops.tokenspeed_kernel.mha_decode_with_kvcache(
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
                self.kernel,
            )
            if out is not None:
                result = out.copy_(result)
            return _result(result, lse, self.return_lse)

        check_capturable(self.spec)
        if config.debug():
            debug_check_pages(
                self.page_table,
                self.cache_seqlens,
                [self.q_len] * self.batch,
                self.page_size,
                self.k_cache.shape[0],
                self.max_seqlen_k,
            )
        record(self.spec, self.request)
        if config.capture_path() is not None:
            signature = _signature(
                q,
                self.k_cache.dtype,
                heads,
                batch=self.batch,
                q_len=self.q_len,
                max_seqlen_k=self.max_seqlen_k,
                page_size=self.page_size,
                window_left=self.window_left,
                sinks=self.sinks is not None,
                logit_cap=self.logit_cap,
                return_lse=self.return_lse,
            )
            capture_signature("attention.decode", self.kernel, signature)
        if out is None:
            out = q.new_empty(out_shape)
        rows = self.batch * self.q_len
        lse = torch.empty((rows, heads.num_q_heads), dtype=torch.float32, device=q.device) if self.return_lse else None
        if not rows:  # a step without decodes: nothing to compute, nothing launched
            return _result(out, lse, self.return_lse)
        self._run(
            self._args(
                q4,
                out.view(self.batch, self.q_len, heads.num_q_heads, heads.head_dim_v),
                None if lse is None else lse.view(self.batch, self.q_len, heads.num_q_heads),
            )
        )
        return _result(out, lse, self.return_lse)


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

    Returns:
        A :class:`DecodePlan`; ``plan.run(q)`` is the per-step call.
    """
    check_paged_cache_pair(k_cache, v_cache)
    check_tensor("page_table", page_table, ndim=2, dtypes=(torch.int32,))
    check_int("num_q_heads", num_q_heads, min_value=1)
    check_int("q_len", q_len, min_value=1)
    if q_dtype is None:
        if k_cache.dtype == torch.float8_e4m3fn:
            raise TypeError("q_dtype is required for a float8_e4m3fn cache (the activations' dtype)")
        q_dtype = k_cache.dtype
    if not isinstance(q_dtype, torch.dtype) or q_dtype not in ACT_DTYPES:
        names = ", ".join(dtype_name(d) for d in ACT_DTYPES)
        raise TypeError(f"q_dtype must be one of {{{names}}}, got {q_dtype}")
    if not isinstance(capturable, bool):
        raise TypeError(f"capturable must be a bool, got {type(capturable).__name__}")
    batch, device = page_table.shape[0], k_cache.device
    # q does not exist yet: its placeholder sits on k_cache's device, so the tensors are
    # compared with k_cache here, by name (check_decode would blame "q" instead).
    check_same_device(
        "k_cache",
        k_cache,
        **{
            n: t
            for n, t in (
                ("v_cache", v_cache),
                ("page_table", page_table),
                ("cache_seqlens", cache_seqlens),
                ("sinks", sinks),
                ("k_scale", k_scale),
                ("v_scale", v_scale),
            )
            if isinstance(t, torch.Tensor)
        },
    )
    q_like = _placeholder((batch, q_len, num_q_heads, k_cache.shape[-1]), q_dtype, device)
    heads, page_size, ks, vs, scale = check_decode(
        q_like,
        k_cache,
        v_cache,
        page_table,
        cache_seqlens,
        max_seqlen_k,
        q_len=q_len,
        k_scale=k_scale,
        v_scale=v_scale,
        softmax_scale=softmax_scale,
        window_left=window_left,
        logit_cap=logit_cap,
        return_lse=return_lse,
        override=override,
        sinks=sinks,
    )
    if config.debug():
        debug_check_pages(page_table, cache_seqlens, [q_len] * batch, page_size, k_cache.shape[0], max_seqlen_k)
    strided, align = cache_layout(k_cache, v_cache)
    request = attention_request(
        "attention.decode",
        q_dtype=q_dtype,
        kv_dtype=k_cache.dtype,
        heads=heads,
        window_left=window_left,
        sinks=sinks is not None,
        logit_cap=logit_cap,
        return_lse=return_lse,
        page_size=page_size,
        q_len=q_len,
        capturable=capturable,
        batch=batch,
        strided_kv=strided,
        kv_align=align,
    )
    spec = select(request, platform_for(device), override)
    out_like = _placeholder((batch, q_len, heads.num_q_heads, heads.head_dim_v), q_dtype, device)
    lse_like = _placeholder((batch, q_len, heads.num_q_heads), torch.float32, device) if return_lse else None
    layout_args = DecodeArgs(
        q_like,
        k_cache,
        v_cache,
        page_table,
        cache_seqlens,
        max_seqlen_k,
        scale,
        _kernel_window(window_left, page_table.shape[1] * page_size),
        sinks,
        float(logit_cap),
        ks,
        vs,
        out_like,
        lse_like,
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
        _layout_args=layout_args,
        _run=spec.fn,
    )
    plan.update()
    shape4 = (batch, q_len, heads.num_q_heads, heads.head_dim)
    quick = None
    if spec.graph_safe and batch and heads.head_dim_v == heads.head_dim:
        index = -1 if device.type == "cpu" else (device.index if device.index is not None else 0)
        quick = ((batch, heads.num_q_heads, heads.head_dim) if q_len == 1 else None, shape4, index)
    run = spec.bind(layout_args) if spec.bind is not None else spec.fn
    return replace(plan, _run=run, _quick=quick)
