"""The exchange's wire rows and buffers: the byte layout a padded dispatch sends, and where the
kernels of ``moe.dispatch`` / ``moe.combine`` keep them (:class:`~tokenspeed_kernel.ops.moe.args.ExchangeBuffers`).

A padded dispatch moves, for each row of the exchange, its activations and its token's
routing. Small exchanges (``W * C * R <= PACK_BYTES``) send both in one row of ``R`` bytes,
so one fixed-size ``all_to_all_single`` (over uint8) moves everything (*packed*)::

    bytes [0, H*s)            the row's activations, in x's dtype (s: x's itemsize)
    bytes [A, A + 4k)         its token's topk_ids, int32            (A: H*s rounded up to 16)
    bytes [A + 4k, A + 8k)    its token's topk_weights, float32
    bytes [A + 8k, R)         unused                                 (R: A + 8k rounded up to 16)

and the receiving rank copies the three fields out into ``MoEDispatched``'s buffers. Larger
ones (*split*) send the activations in an ``all_to_all_single`` of their own, straight into
``MoEDispatched.x`` (no copy out of the wire: at thousands of tokens that copy costs more
than a second collective's latency), and the routing in a second one of rows ``[A = 0,
R = 8k rounded up to 16)``. Both forms deliver the same bits. Padding rows carry the ids
``E`` and the weights 0 (their activations: whatever the send buffer held). Rows and fields
start at multiples of 16 bytes.

Buffers (all on x's device): ``send`` (:func:`send_rows`), uint8 ``[W * C + 1, R]``, and, split,
``send_x`` (:func:`send_act_rows`), ``[W * C + 1, H]`` in x's dtype: zeros when allocated;
their last row takes the writes of the (token, rank) pairs that are not sent. ``recv``, one
flat uint8 arena shared by the dispatch and the combine: the dispatch receives its wire rows
in the first ``W * C * R`` bytes (:func:`recv_rows`); the combine receives the computed rows
coming back in the last ``(W * C + 1) * H * s`` bytes, as ``[W * C + 1, H]``
(:func:`returned_rows`), whose last row is zero for the slots that were not sent: the last
``H * s`` bytes are zeroed when the arena is allocated and no kernel writes them. A step's
dispatch is done with ``recv`` once it has copied the fields out, so its combine reuses the
memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from tokenspeed_kernel.ops.moe.args import ExchangeBuffers, MoECombineArgs, MoEDispatchArgs

__all__ = [
    "PACK_BYTES",
    "WireLayout",
    "block_rows",
    "exchange_back",
    "exchange_wire",
    "recv_rows",
    "returned_rows",
    "send_act_rows",
    "send_rows",
    "send_wire",
    "wide",
    "wire_layout",
]

_ALIGN = 16  # bytes: where each row and its routing start

# The largest packed exchange, in wire bytes per rank (W * C * R). A guess until measured on
# GPUs: where copying the activations out of the wire (read and write, ~2 * 16 MiB) costs
# about one small collective's latency.
PACK_BYTES = 16 << 20


def _round_up(n: int, to: int = _ALIGN) -> int:
    return -(-n // to) * to


@dataclass(frozen=True, slots=True)
class WireLayout:
    """The wire row of an exchange of ``hidden`` activations in ``dtype`` with ``top_k``
    choices per token: the activations and the routing (``packed``), or the routing alone
    (see the module docstring)."""

    hidden: int
    top_k: int
    dtype: torch.dtype
    packed: bool = True

    @property
    def act_bytes(self) -> int:
        """``H * s``: the activations' bytes."""
        return self.hidden * self.dtype.itemsize

    @property
    def meta_offset(self) -> int:
        """``A``: where the ids start (packed: the activations' bytes rounded up to 16; else 0)."""
        return _round_up(self.act_bytes) if self.packed else 0

    @property
    def row_bytes(self) -> int:
        """``R``: one row's bytes (a multiple of 16)."""
        return _round_up(self.meta_offset + 8 * self.top_k)

    def act(self, wire: torch.Tensor) -> torch.Tensor:
        """``[N, H]`` in the layout's dtype: the activations of the packed rows ``wire [N, R]`` (a view)."""
        if not self.packed:
            raise ValueError("a split wire row holds no activations")
        return wire.view(self.dtype)[:, : self.hidden]

    def ids(self, wire: torch.Tensor) -> torch.Tensor:
        """int32 ``[N, k]``: the ids of ``wire [N, R]`` (a view)."""
        a = self.meta_offset
        return wire[:, a : a + 4 * self.top_k].view(torch.int32)

    def weights(self, wire: torch.Tensor) -> torch.Tensor:
        """float32 ``[N, k]``: the weights of ``wire [N, R]`` (a view)."""
        a = self.meta_offset + 4 * self.top_k
        return wire[:, a : a + 4 * self.top_k].view(torch.float32)


def wire_layout(hidden: int, top_k: int, dtype: torch.dtype, rows: int) -> WireLayout:
    """The layout of an exchange of ``rows`` (``W * C``) rows: packed when its packed rows
    take at most :data:`PACK_BYTES`, else split."""
    packed = WireLayout(hidden, top_k, dtype)
    return packed if rows * packed.row_bytes <= PACK_BYTES else WireLayout(hidden, top_k, dtype, packed=False)


_WIDE = (torch.int64, torch.int32, torch.int16, torch.uint8)


def _fits(t: torch.Tensor, width: int) -> bool:
    size = t.element_size()
    return (t.shape[-1] * size) % width == 0 and all(
        (n * size) % width == 0 for n in (*t.stride()[:-1], t.storage_offset())
    )


def wide(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The same bytes of each tensor (rows of a contiguous last axis) seen as the widest integer
    elements all of them allow (int64 when every row's bytes, row stride and offset are
    multiples of 8): a gather, scatter or strided copy of whole rows then moves 8 bytes per
    element instead of 2, with the same bits."""
    width = next(dt for dt in _WIDE if all(_fits(t, dt.itemsize) for t in tensors))
    return tuple(t.view(width) for t in tensors)


def send_rows(buffers: ExchangeBuffers, layout: WireLayout, rows: int, device: torch.device) -> torch.Tensor:
    """uint8 ``[rows + 1, R]``: ``buffers.send``, allocated (zeros) unless it has that shape
    on ``device`` already (a plan's earlier step)."""
    send = buffers.send
    shape = (rows + 1, layout.row_bytes)
    if send is None or send.shape != shape or send.device != device:
        send = buffers.send = torch.zeros(shape, dtype=torch.uint8, device=device)
    return send


def send_act_rows(
    buffers: ExchangeBuffers, rows: int, hidden: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``[rows + 1, hidden]`` in ``dtype``: ``buffers.send_x`` (a split dispatch's activations),
    allocated (zeros) unless it has that shape, dtype and device already."""
    send_x = buffers.send_x
    shape = (rows + 1, hidden)
    if send_x is None or send_x.shape != shape or send_x.dtype != dtype or send_x.device != device:
        send_x = buffers.send_x = torch.zeros(shape, dtype=dtype, device=device)
    return send_x


def _arena_bytes(wire_bytes: int, rows: int, row_back: int) -> int:
    """The arena that holds ``wire_bytes`` of dispatch rows first and ``rows + 1`` rows of
    ``row_back`` bytes last (their start rounded up to 16), the last row past the dispatch's bytes."""
    return _round_up(max(wire_bytes - rows * row_back, 0)) + (rows + 1) * row_back


def recv_rows(buffers: ExchangeBuffers, layout: WireLayout, rows: int, device: torch.device) -> torch.Tensor:
    """uint8 ``[rows, R]``: the first ``rows * R`` bytes of ``buffers.recv`` (allocated unless
    it holds them and the combine's zero row past them)."""
    wire = rows * layout.row_bytes
    arena = _recv_arena(buffers, wire, rows, layout.act_bytes, device)
    return arena[:wire].view(rows, layout.row_bytes)


def returned_rows(
    buffers: ExchangeBuffers, rows: int, hidden: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``[rows + 1, hidden]`` in ``dtype``: the last ``(rows + 1) * hidden * s`` bytes of
    ``buffers.recv`` (allocated unless there), the last row zero (never written)."""
    row_back = hidden * dtype.itemsize
    arena = _recv_arena(buffers, rows * row_back, rows, row_back, device)
    start = arena.numel() - (rows + 1) * row_back
    return arena[start:].view(dtype).view(rows + 1, hidden)


def _recv_arena(buffers: ExchangeBuffers, wire: int, rows: int, row_back: int, device: torch.device) -> torch.Tensor:
    """``buffers.recv``, or a new arena for ``wire`` bytes of dispatch rows and ``rows + 1``
    returned rows of ``row_back`` bytes (:func:`_arena_bytes`): the current one serves when it
    is on ``device``, holds ``wire`` bytes before its last ``row_back`` bytes (which stay
    zero), and its returned rows start 16-byte aligned."""
    recv = buffers.recv
    if recv is not None and recv.device == device:
        n = recv.numel()
        if n >= wire + row_back and n >= (rows + 1) * row_back and (n - (rows + 1) * row_back) % _ALIGN == 0:
            return recv
    need = _arena_bytes(wire, rows, row_back)
    recv = buffers.recv = torch.empty(need, dtype=torch.uint8, device=device)
    recv[need - row_back :].zero_()
    return recv


def send_wire(args: MoEDispatchArgs) -> tuple[WireLayout, torch.Tensor, torch.Tensor]:
    """A padded dispatch's layout (:func:`wire_layout` of its ``W * C`` rows), its send rows
    ``[W * C + 1, R]`` (:func:`send_rows`) and where the activations go: a view of the send
    rows (packed) or :func:`send_act_rows`, ``[W * C + 1, H]`` in x's dtype."""
    rows, hidden, device = args.recv_x.shape[0], args.x.shape[1], args.x.device
    layout = wire_layout(hidden, args.topk_ids.shape[1], args.x.dtype, rows)
    send = send_rows(args.buffers, layout, rows, device)
    if layout.packed:
        return layout, send, layout.act(send)
    return layout, send, send_act_rows(args.buffers, rows, hidden, args.x.dtype, device)


def exchange_wire(args: MoEDispatchArgs, layout: WireLayout, send: torch.Tensor, send_x: torch.Tensor) -> torch.Tensor:
    """The collectives of a padded dispatch (every rank the same, fixed sizes): the first
    ``W * C`` send rows, and split the activations ``send_x`` straight into ``args.recv_x``
    first. Returns the received wire rows, uint8 ``[W * C, R]`` (:func:`recv_rows`)."""
    rows = args.recv_x.shape[0]
    recv = recv_rows(args.buffers, layout, rows, args.x.device)
    if not layout.packed:
        dist.all_to_all_single(args.recv_x, send_x[:rows], group=args.group)
    dist.all_to_all_single(recv, send[:rows], group=args.group)
    return recv


def block_rows(counts: list[int] | tuple[int, ...], capacity: int, device: torch.device) -> torch.Tensor:
    """int64: the first ``counts[r]`` rows of each block r of C rows, blocks in rank order."""
    return torch.cat([torch.arange(n, device=device) + r * capacity for r, n in enumerate(counts)])


def exchange_back(args: MoECombineArgs) -> torch.Tensor:
    """The collective of a combine: every rank's ``y`` rows back to the ranks they came from,
    the way the dispatch moved them (whole blocks, or the routed rows when ``route.counts``
    says how many: an all-to-all-v). Returns ``[W * C + 1, H]`` in y's dtype
    (:func:`returned_rows`): row ``slots[t, r]`` is the row rank r computed for token t, the
    last row zero (the slots not sent)."""
    route, y = args.route, args.y
    rows, hidden = y.shape
    back = returned_rows(route.buffers, rows, hidden, y.dtype, y.device)
    if route.counts is None:
        dist.all_to_all_single(back[:rows], y, group=args.group)
    else:
        sent_n, received_n = route.counts
        returned = y.new_empty(sum(sent_n), hidden)
        src = block_rows(received_n, route.capacity, y.device)
        dist.all_to_all_single(returned, y[src], list(sent_n), list(received_n), group=args.group)
        back.index_copy_(0, block_rows(sent_n, route.capacity, y.device), returned)
    return back
