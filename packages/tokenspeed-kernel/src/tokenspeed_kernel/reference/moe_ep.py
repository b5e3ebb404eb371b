"""Expert-parallel exchange kernels over ``torch.distributed``: ``torch_moe_dispatch`` and
``torch_moe_combine`` (the reference) and ``torch_moe_dispatch_padded`` (opt-in).

Every kernel here only calls ``torch.distributed`` collectives (``all_to_all_single``) on the
group it is given, so it runs wherever that group does (GPUs or CPUs, whatever its backend) and names
no vendor; the layout they write is the one of :class:`~tokenspeed_kernel.ops.moe.args.ExchangeRoute`.

- ``torch_moe_dispatch`` (reference): the obvious exchange. It routes on the device, exchanges
  the per-rank row counts first and reads them on the host, then moves exactly the rows that
  were routed with an all-to-all-v (``all_to_all_single`` with split sizes) and places them
  in the receive blocks. Synchronizes with the host: not graph-safe.
- ``torch_moe_dispatch_padded`` (opt-in): the same routing, but every block of C rows moves
  whole (padding included) in one fixed-size ``all_to_all_single`` whose sizes are known
  before any count is: no host synchronization, so a plan's step can be captured in a CUDA
  graph. In small exchanges each row travels as one wire row of bytes with its token's
  ``topk_ids`` and ``topk_weights`` (:mod:`~tokenspeed_kernel.ops.moe.ep_wire`), so
  activations and routing move in that one collective; large ones move the activations
  straight into the receive buffer and the routing in a second collective. It moves
  ``W * C`` rows per rank whatever the routing (the reference moves only the routed ones).
  Opt-in until it has been run and timed on GPUs (``ci/device/ep_bench.py``). It lives in
  the core because it is PyTorch and ``torch.distributed`` only, like the reference: no
  compiled kernel, no library beyond torch. Per call, whatever W: 15 launches (torch ops)
  and one collective, or (large) 14 and two.
- ``torch_moe_combine`` (reference): moves the computed rows back the way the dispatch moved
  them (whole blocks, or exactly the routed rows when the dispatch says how many) into the
  route's buffers, gathers each token's W rows at once and sums them in rank order, in
  float32. It reads only host values the dispatch already holds, so it is graph-safe. After
  a padded dispatch: one collective and two launches for W = 2 (W + 1 for more).

In the reference dispatch each row's metadata (its token's ``topk_ids`` and ``topk_weights``
rows) travels in a second all-to-all next to the activations, as one int32 ``[rows, 2k]``
tensor (the weights' bits).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from tokenspeed_kernel.ops.moe.args import MoECombineArgs, MoEDispatchArgs
from tokenspeed_kernel.ops.moe.ep_wire import block_rows, exchange_back, exchange_wire, send_wire, wide
from tokenspeed_kernel.registry import Priority, register_kernel

__all__ = ["torch_moe_combine", "torch_moe_dispatch", "torch_moe_dispatch_padded"]


def _distributed() -> str | None:
    return None if dist.is_available() else "torch.distributed is not available in this torch build"


# Every kernel here: PyTorch and torch.distributed, wherever the group runs.
_register = functools.partial(
    register_kernel, solution="torch", vendors=("cuda", "rocm", "cpu"), available=_distributed
)


def _route(args: MoEDispatchArgs) -> torch.Tensor:
    """Write ``args.slots`` (see ``ExchangeRoute``) and return ``unsent``, bool ``[W, T]``:
    token t does not go to rank r. A token's row in its block to r is its rank among the
    tokens sent to r: ``t`` less the tokens before it that are not sent to r. Seven launches,
    the scan along the contiguous token axis."""
    world, capacity = args.world_size, args.capacity
    num_tokens = args.x.shape[0]
    device = args.x.device
    dest = args.owner[args.topk_ids]  # [T, k] int64: the rank holding each choice
    unsent = torch.ones(world, num_tokens, dtype=torch.bool, device=device).scatter_(0, dest.t(), False)
    slots = args.slots.t()  # [W, T], contiguous
    torch.cumsum(unsent, 1, out=slots)  # the tokens up to t not sent to r
    first = torch.arange(world * capacity, device=device).view(world, capacity)[:, :num_tokens]  # r * C + t
    torch.sub(first, slots, out=slots)
    slots.masked_fill_(unsent, world * capacity)
    return unsent


def _metadata(args: MoEDispatchArgs, token: torch.Tensor) -> torch.Tensor:
    """int32 ``[len(token), 2k]``: the ``topk_ids`` and the ``topk_weights`` bits of each row's
    token; ``token == T`` is padding (ids E, weights 0)."""
    ids, weights = args.topk_ids, args.topk_weights
    k = ids.shape[1]
    pad_ids = ids.new_full((1, k), args.owner.shape[0])
    ids = torch.cat([ids, pad_ids])[token]
    weights = torch.cat([weights, weights.new_zeros(1, k)])[token]
    return torch.cat([ids, weights.view(torch.int32)], dim=1)


def _unpack(args: MoEDispatchArgs, metadata: torch.Tensor) -> None:
    """The received ``[W * C, 2k]`` metadata into ``recv_topk_ids`` / ``recv_topk_weights``."""
    k = args.topk_ids.shape[1]
    args.recv_topk_ids.copy_(metadata[:, :k])
    args.recv_topk_weights.copy_(metadata[:, k:].view(torch.float32))


@_register(
    "moe.dispatch",
    name="torch_moe_dispatch",
    priority=Priority.REFERENCE,
    graph_safe=False,  # reads the row counts on the host (.tolist()) to size the all-to-all-v
)
def torch_moe_dispatch(args: MoEDispatchArgs) -> None:
    """Reference dispatch: counts exchanged and read on the host, then an exact all-to-all-v."""
    sent = _route(args).logical_not()
    device, capacity = args.x.device, args.capacity
    sent_counts = sent.sum(1)
    received_counts = torch.empty_like(sent_counts)
    dist.all_to_all_single(received_counts, sent_counts, group=args.group)
    sent_n, received_n = sent_counts.tolist(), received_counts.tolist()
    token = sent.nonzero()[:, 1]  # rank by rank, each in token order: the send order
    rows = block_rows(received_n, capacity, device)
    x = args.x.new_empty(rows.shape[0], args.x.shape[1])
    dist.all_to_all_single(x, args.x[token], received_n, sent_n, group=args.group)
    send_meta = _metadata(args, token)
    meta = send_meta.new_empty(rows.shape[0], send_meta.shape[1])
    dist.all_to_all_single(meta, send_meta, received_n, sent_n, group=args.group)
    padding = torch.full((args.recv_x.shape[0],), args.x.shape[0], dtype=torch.long, device=device)
    full_meta = _metadata(args, padding).index_copy_(0, rows, meta)
    args.recv_x.zero_().index_copy_(0, rows, x)
    _unpack(args, full_meta)
    args.counts = (tuple(sent_n), tuple(received_n))


@_register("moe.dispatch", name="torch_moe_dispatch_padded", priority=Priority.OPT_IN)
def torch_moe_dispatch_padded(args: MoEDispatchArgs) -> None:
    """Fixed-size dispatch: whole blocks of C rows, no host sync. Small exchanges move each
    row's activations and routing as one wire row in one uint8 all_to_all_single; large ones
    the activations straight into ``recv_x`` and the routing in a second one
    (:mod:`~tokenspeed_kernel.ops.moe.ep_wire`).

    Per call: the routing (seven launches), the send rows (the ids and weights of every row
    set to the padding's, then the sent rows' activations, ids and weights put in place:
    five launches), the all-to-all(s), and the copies out of the received rows (three packed,
    two split)."""
    _route(args)
    layout, send, send_x = send_wire(args)
    layout.ids(send).fill_(args.owner.shape[0])
    layout.weights(send).zero_()
    slots = (args.slots.t(),)  # [W, T]: each (rank, token)'s send row, W * C if not sent
    send_wide, x = wide(send_x, args.x)  # 8-byte elements where the rows allow
    send_wide.index_put_(slots, x)
    layout.ids(send).index_put_(slots, args.topk_ids)
    layout.weights(send).index_put_(slots, args.topk_weights)
    recv = exchange_wire(args, layout, send, send_x)
    if layout.packed:
        recv_x, recv_act = wide(args.recv_x, layout.act(recv))
        recv_x.copy_(recv_act)
    args.recv_topk_ids.copy_(layout.ids(recv))
    args.recv_topk_weights.copy_(layout.weights(recv))


def _sum_in_rank_order(rows: torch.Tensor, out: torch.Tensor) -> None:
    """``out = sum_r rows[r]`` for ``rows [W, T, H]``, added in float32 in rank order and
    rounded once to out's dtype (the last add writes out). Two ranks: one add of the two
    rows, which PyTorch computes in float32 for bf16/fp16 (its ``opmath``) and rounds once."""
    world = rows.shape[0]
    if world == 1:
        out.copy_(rows[0])
        return
    if world == 2:
        torch.add(rows[0], rows[1], out=out)
        return
    acc = rows[0].to(torch.promote_types(rows.dtype, torch.float32))
    for r in range(1, world - 1):
        acc.add_(rows[r])
    torch.add(acc, rows[world - 1], out=out)


@_register("moe.combine", name="torch_moe_combine", priority=Priority.REFERENCE)
def torch_moe_combine(args: MoECombineArgs) -> None:
    """Reference combine: the rows back as the dispatch moved them, each token's summed in float32.

    The rows come back into the route's buffers (``ep_wire.returned_rows``: ``[W * C + 1, H]``,
    the last row zero for the slots not sent), then one gather of every token's W rows and
    the sum (one launch for W = 2, W for more)."""
    (back,) = wide(exchange_back(args))  # 8-byte elements where the rows allow
    _sum_in_rank_order(back[args.route.slots.t()].view(args.y.dtype), args.out)
