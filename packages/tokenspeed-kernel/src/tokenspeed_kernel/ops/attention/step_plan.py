"""``mha_prefill_plan`` / ``mha_extend_plan`` / ``mha_decode_step_plan``: one eager step's call
checked and its kernel selected once, run per layer.

A serving engine's eager step calls ``mha_prefill``, ``mha_extend_with_kvcache`` or
``mha_decode_with_kvcache`` once per attention layer with the same batch tables
(``cu_seqlens_*``, a page table, ``cache_seqlens`` and their host bounds) and the same options;
only q, the layer's keys and values (or caches), its sinks (and fp8 scales) and out change from
layer to layer. Each
functional call pays its call key (every tensor's shape, strides, dtype, device), the
plan-cache lookup and the selection again. A step plan pays them once per step:

- :func:`mha_prefill_plan` / :func:`mha_extend_plan` / :func:`mha_decode_step_plan` take the
  arguments of the step's first call, check them in full exactly as the functional call would
  (the same errors), and select the kernel once (``override=`` respected); nothing is computed;
- ``plan.run`` is the call of every layer, the first one's included: the layer's tensors must have the layout of the plan's (shape, strides, storage
  offset, dtype, device: what the checks and the selection read of them; ``out``: shape,
  strides, dtype, device); the run then builds the kernel's arguments and launches: no call
  key, no lookup, no selection. A kernel with a ``step_runner`` hook is asked for the runner of
  the plan's layout on the plan's first run outside CUDA-graph capture (that runner, its launch
  work done, serves the later runs: the kernel's own key is skipped too). A run whose tensors differ in
  layout is checked in full like a functional call (raising what is wrong, naming the
  argument) and served by the plan's kernel when it asks for the same selection, else refused
  with a ``ValueError``. Under ``torch.compile``, ``TOKENSPEED_KERNEL_DEBUG`` or a capture file
  a run is the functional call; so is every run of a plan whose first call had a per-layer
  argument no call key stands for (a tensor subclass: ``torch.nn.Parameter`` sinks; before
  2026-11-28 such a plan skipped the layout check on runs of that kind).

The tables are kept by the plan and read by every run: an engine may rewrite their contents in
place between runs, within the plan's bounds and row counts. No kernel of these operators
plans on the host per batch layout, so a step plan has no ``update``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

import torch

from tokenspeed_kernel import config
from tokenspeed_kernel.ops._checks import Uncacheable, arg_key
from tokenspeed_kernel.ops._dispatch import check_capturable, is_capturing, record
from tokenspeed_kernel.ops._operator import Operator
from tokenspeed_kernel.ops.attention._validate import kv_scales
from tokenspeed_kernel.ops.attention.api import DECODE, EXTEND, PREFILL, DecodeCall, ExtendCall, PrefillCall
from tokenspeed_kernel.ops.attention.args import ExtendArgs, Heads, PrefillArgs
from tokenspeed_kernel.platform import platform_for
from tokenspeed_kernel.registry import KernelSpec, Request
from tokenspeed_kernel.selector import select

__all__ = ["DecodeStepPlan", "ExtendPlan", "PrefillPlan", "mha_decode_step_plan", "mha_extend_plan", "mha_prefill_plan"]


def _layout(layer: tuple) -> tuple | None:
    """What the checks and the selection read of a run's per-layer arguments (their
    :func:`~tokenspeed_kernel.ops._checks.arg_key`), or None for an argument no key stands for."""
    try:
        return tuple(map(arg_key, layer))
    except Uncacheable:
        return None


def _same_layout(layer: tuple, layout: tuple | None) -> bool:
    """Whether ``layer``'s layout is ``layout`` (``_layout`` of the plan's first call): each
    tensor's key read inline (no ``arg_key`` call per argument), each other argument's as
    ``arg_key`` reads a scalar's (a weight container never matches: the checked run serves it).
    False when ``layout`` is None: a plan whose first call had an argument no key stands for
    (a tensor subclass: ``torch.nn.Parameter`` sinks) checks every run in full."""
    if layout is None:
        return False
    for x, want in zip(layer, layout):
        if type(x) is torch.Tensor:
            if (x.shape, x.dtype, x.device, x.stride(), x.storage_offset()) != want:
                return False
        elif (type(x), x) != want:
            return False
    return True


def _out_layout(out: torch.Tensor) -> tuple:
    """What the checks read of ``out`` (its shape, dtype, device and strides; its address
    reaches no check nor the selection)."""
    return (out.shape, out.dtype, out.device, out.stride())


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


@dataclass(frozen=True, eq=False, kw_only=True)
class _StepPlan:
    """What both step plans hold and how they run (see the module docstring).

    Attributes:
        kernel: the selected kernel's name. spec: its :class:`~tokenspeed_kernel.registry.KernelSpec`.
        request: the selection request.
        max_seqlen_k: the step's host bound of the key lengths.
        heads: head counts and dims.
        window_left, logit_cap, return_lse: as in the call. softmax_scale: resolved.
        device: the device of every tensor.
    """

    # The operator and its call's plan class, the positions of the per-layer arguments in its
    # public call (out's is OUT); a run builds the kernel's typed arguments in :meth:`_args`.
    OP: ClassVar[Operator]
    CALL: ClassVar[type[PrefillCall] | type[ExtendCall] | type[DecodeCall]]
    LAYER: ClassVar[tuple[int, ...]]
    OUT: ClassVar[int]
    # The fields taken from the first call as given (name, position in the public call: the
    # tables, the host bounds, options), and those its checked call plan derived (by name).
    FROM_CALL: ClassVar[tuple[tuple[str, int], ...]]
    FROM_CHECK: ClassVar[tuple[str, ...]]

    kernel: str
    spec: KernelSpec
    request: Request
    max_seqlen_k: int
    heads: Heads
    softmax_scale: float
    window_left: int
    logit_cap: float
    return_lse: bool
    device: torch.device
    # The functional call's plan (outputs' shapes, the kernel's window and cap), the first
    # call's arguments with the per-layer ones and out left out (None) and the plan's kernel
    # as the override, the per-layer layout every quick run must have (None: no quick run),
    # and out's.
    _call: PrefillCall | ExtendCall | DecodeCall = field(repr=False)
    _base: tuple = field(repr=False)
    _layout: tuple | None = field(repr=False)
    _out: tuple = field(repr=False)
    # What serves the quick runs: [the kernel's step runner], empty until the first run
    # outside capture asks for it (``spec.fn`` serves until then, and for a kernel without one).
    _runner: list[Callable[[Any], None]] = field(default_factory=list, repr=False)

    @classmethod
    def _make(cls, call: tuple) -> Any:
        """The plan of a step whose first call is ``call`` (the public call's arguments, in
        order), checked in full."""
        checked = cls.CALL.check(False, *call)
        request = checked.request
        assert request is not None  # checked outside tracing
        spec = select(request, platform_for(checked.device), call[-1])
        base = list(call)
        for position in (*cls.LAYER, cls.OUT):
            base[position] = None
        base[-1] = spec.name
        q = call[0]
        return cls(
            kernel=spec.name,
            spec=spec,
            request=request,
            heads=checked.heads,
            softmax_scale=checked.scale,
            logit_cap=checked.logit_cap,
            device=checked.device,
            **{name: call[position] for name, position in cls.FROM_CALL},
            **{name: getattr(checked, name) for name in cls.FROM_CHECK},
            _call=checked,
            _base=tuple(base),
            _layout=_layout(tuple(call[p] for p in cls.LAYER)),
            _out=(torch.Size(checked.out_shape), q.dtype, q.device, _contiguous_strides(checked.out_shape)),
        )

    def _run(self, layer: tuple, out: torch.Tensor | None) -> Any:
        """One layer's run (``layer``: its per-layer arguments in ``LAYER``'s order)."""
        if (
            not _same_layout(layer, self._layout)
            or (out is not None and (type(out) is not torch.Tensor or _out_layout(out) != self._out))
            or torch.compiler.is_compiling()
            or config.debug()
            or config.capture_path() is not None
        ):
            return self._checked_run(layer, out)
        check_capturable(self.spec)
        record(self.spec, self.request)
        return self._launch(layer, out)

    def _launch(self, layer: tuple, out: torch.Tensor | None) -> Any:
        """The outputs allocated (``out`` may be given), the kernel's typed arguments built and
        run (its bound runner, or ``spec.fn``); the public result."""
        raise NotImplementedError

    def _serve(self, args: Any) -> None:
        """Run the kernel's typed arguments ``args``: the step runner (asked for on the first
        run outside capture and kept), or ``spec.fn`` (no hook; or while capturing, where hooks
        are never called: a later run asks)."""
        if self._runner:
            self._runner[0](args)
        elif self.spec.step_runner is None:
            self._runner.append(self.spec.fn)
            self.spec.fn(args)
        elif not is_capturing():
            self._runner.append(self.spec.step_runner(args))
            self._runner[0](args)
        else:
            self.spec.fn(args)

    def _checked_run(self, layer: tuple, out: object) -> Any:
        """A run the quick path does not take (another layout, ``torch.compile``, debug or
        capture-file mode): the functional call with the plan's kernel, checked in full; a
        layout that asks for another selection than the plan's is refused."""
        call = list(self._base)
        for position, value in zip(self.LAYER, layer):
            call[position] = value
        call[self.OUT] = out
        if not torch.compiler.is_compiling():
            checked = self.CALL.check(False, *call)  # raises what is wrong, naming the argument
            if checked.request != self.request or checked.out_shape != self._call.out_shape:
                raise ValueError(
                    f"{type(self).__name__} ({self.kernel}): this run's tensors differ from the plan's in what "
                    f"selects the kernel or in their rows (plan: {self.request}, out {list(self._call.out_shape)}; "
                    f"run: {checked.request}, out {list(checked.out_shape)}); make a plan for them"
                )
        return self.OP.call(*call)


@dataclass(frozen=True, eq=False, kw_only=True)
class _RaggedPlan(_StepPlan):
    """A step plan over ragged query rows (prefill, extend): ``max_seqlen_q`` their host bound,
    ``total_q`` the rows of every run, ``causal`` as in the call."""

    max_seqlen_q: int
    total_q: int
    causal: bool

    def _launch(self, layer: tuple, out: torch.Tensor | None) -> Any:
        call = self._call
        if out is None:
            out = layer[0].new_empty(*call.out_shape)
        lse = torch.empty(*call.lse_shape, dtype=torch.float32, device=self.device) if self.return_lse else None
        if self.total_q:  # no queries (an empty batch): nothing to compute, nothing launched
            self._serve(self._args(layer, out, lse))
        return (out, lse) if self.return_lse else out

    def _args(self, layer: tuple, out: torch.Tensor, lse: torch.Tensor | None) -> Any:
        raise NotImplementedError


@dataclass(frozen=True, eq=False, kw_only=True)
class PrefillPlan(_RaggedPlan):
    """A prefill kernel chosen once for one step's ragged batch and options.

    Attributes (besides those of every step plan: ``kernel``, ``spec``, ``request``,
    ``max_seqlen_q``, ``max_seqlen_k``, ``total_q``, ``heads``, ``causal``,
    ``softmax_scale``, ``window_left``, ``logit_cap``, ``return_lse``, ``device``):
        cu_seqlens_q, cu_seqlens_k: int32 ``[batch + 1]`` (one tensor for both when keys are
            queries), read by every run. total_k: key rows of every run.
    """

    OP = PREFILL
    CALL = PrefillCall
    LAYER = (0, 1, 2, 10)  # q, k, v, sinks
    OUT = 13
    FROM_CALL = (
        ("cu_seqlens_q", 3), ("cu_seqlens_k", 4), ("max_seqlen_q", 5), ("max_seqlen_k", 6), ("causal", 7),
        ("window_left", 9), ("return_lse", 12),
    )  # fmt: skip
    FROM_CHECK = ("total_q", "total_k")

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    total_k: int

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        sinks: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> Any:
        """``mha_prefill`` of one layer with the plan's lengths, options and kernel.

        Args:
            q: ``[total_q, Hq, D]``; k: ``[total_k, Hkv, D]``; v: ``[total_k, Hkv, Dv]``: each
                laid out as the plan's first call's (shape, strides, storage offset, dtype, device).
            sinks: float32 ``[Hq]`` when the plan was made with sinks, else None.
            out: optional ``[total_q, Hq, Dv]`` in q's dtype, contiguous.

        Returns:
            ``out``, or ``(out, lse)`` with lse float32 ``[total_q, Hq]`` when the plan was
            made with ``return_lse``.
        """
        return self._run((q, k, v, sinks), out)

    def _args(self, layer: tuple, out: torch.Tensor, lse: torch.Tensor | None) -> PrefillArgs:
        q, k, v, sinks = layer
        call = cast(PrefillCall, self._call)
        return PrefillArgs(
            q,
            k,
            v,
            self.cu_seqlens_q,
            self.cu_seqlens_k,
            min(self.max_seqlen_q, self.total_q),
            min(self.max_seqlen_k, self.total_k),
            self.causal,
            self.softmax_scale,
            call.window,
            sinks,
            call.logit_cap,
            out,
            lse,
        )


@dataclass(frozen=True, eq=False, kw_only=True)
class ExtendPlan(_RaggedPlan):
    """An extend kernel chosen once for one step's batch tables and options.

    Attributes (besides those of every step plan, as :class:`PrefillPlan` lists):
        page_table: int32 ``[batch, max_pages_per_seq]``; cu_seqlens_q: int32 ``[batch + 1]``;
            cache_seqlens: int32 ``[batch]`` (tokens in the cache INCLUDING the chunk): the
            step's tables, read by every run. page_size: ``P``.
    """

    OP = EXTEND
    CALL = ExtendCall
    LAYER = (0, 1, 2, 11, 13, 14)  # q, k_cache, v_cache, sinks, k_scale, v_scale
    OUT = 16
    FROM_CALL = (
        ("page_table", 3), ("cu_seqlens_q", 4), ("cache_seqlens", 5), ("max_seqlen_q", 6), ("max_seqlen_k", 7),
        ("causal", 8), ("window_left", 10), ("return_lse", 15),
    )  # fmt: skip
    FROM_CHECK = ("total_q", "page_size")

    page_table: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cache_seqlens: torch.Tensor
    page_size: int

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
            q: ``[total_q, Hq, D]`` laid out as the plan's first call's q (contiguous, or rows
                with a stride of their own: ``strided_q``), its dtype and device.
            k_cache, v_cache: ``[num_pages, P, Hkv, D]`` / ``[..., Dv]``, any page/token/head
                strides (stride 1 in the head dim), laid out as the plan's first call's.
            sinks: float32 ``[Hq]`` when the plan was made with sinks, else None.
            k_scale, v_scale: an fp8 cache's scales (as in the call), else None.
            out: optional ``[total_q, Hq, Dv]`` in q's dtype, contiguous.

        Returns:
            ``out`` (``[total_q, Hq, Dv]``, q's dtype), or ``(out, lse)`` with lse float32
            ``[total_q, Hq]`` when the plan was made with ``return_lse``.
        """
        return self._run((q, k_cache, v_cache, sinks, k_scale, v_scale), out)

    def _args(self, layer: tuple, out: torch.Tensor, lse: torch.Tensor | None) -> ExtendArgs:
        q, k_cache, v_cache, sinks, k_scale, v_scale = layer
        call = cast(ExtendCall, self._call)
        ks, vs = kv_scales(call.fp8, k_scale, v_scale, q)
        return ExtendArgs(
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


@dataclass(frozen=True, eq=False, kw_only=True)
class DecodeStepPlan(_StepPlan):
    """A decode kernel chosen once for one eager step's batch tables and options, run per layer
    with each layer's caches (:func:`mha_decode_step_plan`; for a CUDA-graph step, whose plan
    keeps one layer's caches, :func:`~tokenspeed_kernel.mha_decode_plan`).

    Attributes (besides those of every step plan, as :class:`PrefillPlan` lists):
        page_table: int32 ``[batch, max_pages_per_seq]``; cache_seqlens: int32 ``[batch]``
            (tokens in the cache including this step's): read by every run.
        batch, q_len: sequences and queries per sequence. page_size: ``P``.

    A kernel's ``bind`` hook is not called (its contract is :class:`DecodePlan`'s, the plan's
    own caches bound, and here every run brings its own): its ``step_runner`` serves the runs.
    """

    OP = DECODE
    CALL = DecodeCall
    LAYER = (0, 1, 2, 8, 10, 11)  # q, k_cache, v_cache, sinks, k_scale, v_scale
    OUT = 13
    FROM_CALL = (
        ("page_table", 3), ("cache_seqlens", 4), ("max_seqlen_k", 5), ("window_left", 7), ("return_lse", 12),
    )  # fmt: skip
    FROM_CHECK = ("batch", "q_len", "page_size")

    page_table: torch.Tensor
    cache_seqlens: torch.Tensor
    batch: int
    q_len: int
    page_size: int

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
        """``mha_decode_with_kvcache`` of one layer with the plan's tables, options and kernel.

        Args:
            q: ``[batch, Hq, D]`` or ``[batch, q_len, Hq, D]`` laid out as the plan's first
                call's q (contiguous, or a 3-D q's rows with a stride of their own). k_cache, v_cache: ``[num_pages, P, Hkv, D]`` / ``[..., Dv]``, laid
                out as the plan's first call's. sinks, k_scale, v_scale, out: as in
                :meth:`ExtendPlan.run` (out shaped like q with ``Dv`` last).

        Returns:
            ``out``, or ``(out, lse)`` with lse float32 ``[batch * q_len, Hq]`` when the plan
            was made with ``return_lse``.
        """
        return self._run((q, k_cache, v_cache, sinks, k_scale, v_scale), out)

    def _launch(self, layer: tuple, out: torch.Tensor | None) -> Any:
        q, k_cache, v_cache, sinks, k_scale, v_scale = layer
        call = cast(DecodeCall, self._call)
        ks, vs = kv_scales(call.fp8, k_scale, v_scale, q)
        return call.launch(
            self._serve,
            q,
            k_cache,
            v_cache,
            self.page_table,
            self.cache_seqlens,
            self.max_seqlen_k,
            sinks,
            ks,
            vs,
            self.return_lse,
            out,
        )


def mha_prefill_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    window_left: int = -1,
    sinks: torch.Tensor | None = None,
    logit_cap: float = 0.0,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    override: str | None = None,
) -> PrefillPlan:
    """Check one step's first prefill call in full, select its kernel once, and plan the rest.

    Takes exactly the arguments of :func:`~tokenspeed_kernel.mha_prefill` (see there for every
    tensor's shape, dtype and layout) and raises what that call would raise. Nothing is
    computed: run the first layer too with ``plan.run(q, k, v, ...)``.

    Returns:
        A :class:`PrefillPlan`: the lengths, their host bounds and the options are fixed; q, k,
        v, sinks and out are each run's, laid out as the ones given here.
    """
    call = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, window_left,
            sinks, logit_cap, return_lse, out, override)  # fmt: skip
    return PrefillPlan._make(call)


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
    call = (q, k_cache, v_cache, page_table, cu_seqlens_q, cache_seqlens, max_seqlen_q, max_seqlen_k, causal,
            softmax_scale, window_left, sinks, logit_cap, k_scale, v_scale, return_lse, out, override)  # fmt: skip
    return ExtendPlan._make(call)


def mha_decode_step_plan(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    max_seqlen_k: int,
    *,
    softmax_scale: float | None = None,
    window_left: int = -1,
    sinks: torch.Tensor | None = None,
    logit_cap: float = 0.0,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    override: str | None = None,
) -> DecodeStepPlan:
    """Check one eager step's first decode call in full, select its kernel once, and plan the
    rest (every layer's decode with its own q, caches and sinks; the CUDA-graph plan, which
    keeps one layer's caches, is :func:`~tokenspeed_kernel.mha_decode_plan`).

    Takes exactly the arguments of :func:`~tokenspeed_kernel.mha_decode_with_kvcache` (see
    there for every tensor's shape, dtype and layout) and raises what that call would raise.
    Nothing is computed: run the first layer too with ``plan.run(q, k_cache, v_cache, ...)``.
    """
    call = (q, k_cache, v_cache, page_table, cache_seqlens, max_seqlen_k, softmax_scale, window_left, sinks, logit_cap,
            k_scale, v_scale, return_lse, out, override)  # fmt: skip
    return DecodeStepPlan._make(call)
