"""Registration metadata shared by the NVIDIA attention kernels (data, not branches).

Every kernel of this wheel registers at ``Priority.OPT_IN``, below the portable Triton
kernels: it is selected only where no Triton kernel serves the request, or when named by an
override. The FlashInfer kernels and the Gluon prefill have not yet passed numerics on a
GPU, and the Gluon decode measured 2.66 TB/s at B=64 ctx 8192, the Triton
decode 2.73 TB/s in another run (docs/history.md). A kernel moves up to ``Priority.PERFORMANT`` once a
device run shows it correct and faster than Triton.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypeVar

import torch

from tokenspeed_kernel_nvidia._workspace import workspace

VENDORS = ("cuda",)
Q_DTYPES = (torch.bfloat16, torch.float16)
KV_DTYPES = (*Q_DTYPES, torch.float8_e4m3fn)
# FlashInfer's prebuilt/JIT attention templates cover these head dims (q/k and v equal).
FLASHINFER_HEAD_DIMS = (64, 128, 256)
PAGE_SIZES = tuple(2**i for i in range(9))  # 1 .. 256
# FlashInfer's FA2 templates need Ampere-class features (bf16 MMA, cp.async): sm_80 and newer.
FLASHINFER_CAPABILITIES = ("bf16", "cp_async")
# ... but our wrappers (CSR translation, sink route, plan caching) have been compiled and run
# against float64 only on sm_90 (H100, FlashInfer 0.7.2.post1; docs/history.md), where the
# sink route uses FA3. Other architectures take FlashInfer's FA2 path, which we have not run:
# they are refused until a GPU of theirs passes test_flashinfer_gpu.py.
FLASHINFER_ARCHS = ("sm_90",)
FLASHINFER_FEATURES = ("sinks", "sliding_window", "logit_cap", "return_lse")
TMA_ALIGN = 16  # bytes: TMA's global base address and strides (but the last)


A = TypeVar("A")


def planned_runner(check: Callable[[A], None], run: Callable[[A], None]) -> Callable[[A], None]:
    """A ``step_runner`` hook's runner (the core's ``PrefillPlan``/``ExtendPlan``):
    ``run`` (the runner of the plan's key) after ``check`` of what differs between the plan's
    runs, their tensors' addresses (TMA alignment)."""

    def planned(args: A) -> None:
        check(args)
        run(args)

    return planned


def row_stride(x: torch.Tensor) -> int:
    """The element stride between the rows (first axis) of ``x [rows, ...]`` whose rows are
    each contiguous (a contiguous tensor, or a row-strided q: ``strided_q``), as a kernel
    addresses them: ``x.stride(0)``, or the dense row size ``x[0].numel()`` where that stride
    means nothing (at most one row) or is not a real one (below the dense size: the broadcast
    placeholders a plan binds with, ``ops.attention._validate.placeholder``). So a contiguous
    ``x`` and one row always give the dense row, and its build."""
    dense = math.prod(x.shape[1:])
    stride = x.stride(0)
    return stride if x.shape[0] > 1 and stride > dense else dense


def head_tile_descriptor(x: torch.Tensor, block_rows: int, layout):
    """A TMA descriptor over ``x [rows, heads, dim]`` viewed as ``[rows, heads * dim]`` with
    its own row stride (:func:`row_stride`: contiguous, or a row-strided q whose row stride
    and base are 16-byte multiples, as TMA needs; the columns past ``heads * dim`` are never
    read), box ``[block_rows, dim]``: ``block_rows`` consecutive tokens of one head are one
    copy at ``[row, head * dim]``. An empty ``x`` gets a one-row zero stand-in (TMA needs
    a positive extent; nothing is read from it)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    rows, heads, dim = x.shape
    flat = x.view(rows, heads * dim) if rows > 0 else x.new_zeros(1, heads * dim)
    return TensorDescriptor(flat, list(flat.shape), [row_stride(x), 1], [block_rows, dim], layout)


def check_tma_q(name: str, q: torch.Tensor) -> None:
    """A row-strided q read by TMA: its row stride a 16-byte multiple (``ValueError`` naming
    the kernel; the selector already passes such a q over by its request: ``unaligned_qkv``
    for prefill, ``q_align`` for extend). The base is checked per run with the addresses."""
    if (row_stride(q) * q.element_size()) % TMA_ALIGN:
        raise ValueError(
            f"{name} reads q by TMA: its row stride ({q.stride(0)} elements) must be a multiple of {TMA_ALIGN} bytes"
        )


def attention_call_key(args, k: torch.Tensor, v: torch.Tensor) -> tuple:
    """What a Gluon attention launch building reads of a call (``PrefillArgs`` with its k/v,
    ``ExtendArgs`` with its caches) besides its tensors' addresses, but the grid and the
    kernel's own tables: the shapes, strides, dtypes and device of q, k and v (their TMA
    descriptors' shapes and strides follow), out's strides, the batch, which optional tensors
    are present and the scalar options (the runner-cache key contract of
    ``tokenspeed_kernel_triton._runners``)."""
    q = args.q
    return (
        q.shape,
        q.stride(),
        q.dtype,
        q.device,
        k.shape,
        k.stride(),
        k.dtype,
        v.shape,
        v.stride(),
        args.out.stride(),
        args.cu_seqlens_q.shape[0],
        args.lse is None,
        args.sinks is None,
        args.causal,
        args.softmax_scale,
        args.window_left,
        args.logit_cap,
    )


def never_read(device: torch.device) -> torch.Tensor:
    """A 16-byte int32 buffer per device standing for a pointer argument a kernel never
    dereferences (an absent lse or sinks, an unlisted walk's tile list: their flags are off).
    A launch builder returns it among its kept objects, so a runner binds it once (checked
    per launch by address only) instead of taking a call tensor there per run."""
    return workspace(device, "never_read", (4,), torch.int32)


def written_and_sinks(args) -> tuple:
    """``(out, lse, sinks)`` launch tensors of a Gluon attention call: an absent lse or sinks
    takes :func:`never_read`'s place (a pointer the kernel never reads when its flag is off;
    before 2026-11-28 ``cu_seqlens_q``'s, a tensor a runner passed per run)."""
    dummy = never_read(args.q.device)
    return (args.out, dummy if args.lse is None else args.lse, dummy if args.sinks is None else args.sinks)


def fa3_head_constexprs(args, num_kv_heads: int) -> dict:
    """The head and flag constexprs of the FA3-style kernels (prefill and extend): ``HQ``,
    ``G`` (query heads per KV head), ``D`` and whether sinks and lse are given."""
    _, num_q_heads, head_dim = args.q.shape
    return dict(
        HQ=num_q_heads,
        G=num_q_heads // num_kv_heads,
        D=head_dim,
        HAS_SINKS=args.sinks is not None,
        HAS_LSE=args.lse is not None,
    )
