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
  graph. It moves ``W * C`` rows per rank whatever the routing (the reference moves only the
  routed ones). Opt-in until it has been run and timed on GPUs (``ci/device/ep_bench.py``).
  It lives in the core because it is PyTorch and ``torch.distributed`` only, like the
  reference: no compiled kernel, no library beyond torch.
- ``torch_moe_combine`` (reference): moves the computed rows back the way the dispatch moved
  them (whole blocks, or exactly the routed rows when the dispatch says how many) and sums
  each token's rows in rank order, in float32. It reads only host values the dispatch already
  holds, so it is graph-safe.

Each row's metadata (its token's ``topk_ids`` and ``topk_weights`` rows) travels in a second
all-to-all next to the activations, as one int32 ``[rows, 2k]`` tensor (the weights' bits).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from tokenspeed_kernel.ops.moe.args import MoECombineArgs, MoEDispatchArgs
from tokenspeed_kernel.registry import Priority, register_kernel

__all__ = ["torch_moe_combine", "torch_moe_dispatch", "torch_moe_dispatch_padded"]


def _distributed() -> str | None:
    return None if dist.is_available() else "torch.distributed is not available in this torch build"


# Every kernel here: PyTorch and torch.distributed, wherever the group runs.
_register = functools.partial(
    register_kernel, solution="torch", vendors=("cuda", "rocm", "cpu"), available=_distributed
)


def _route(args: MoEDispatchArgs) -> torch.Tensor:
    """Write ``args.slots`` (see ``ExchangeRoute``) and return ``sent``, bool ``[T, W]``: token t
    goes to rank r. A token's row in its block to r is its rank among the tokens sent to r."""
    world, capacity = args.world_size, args.capacity
    device = args.x.device
    dest = args.owner[args.topk_ids.long()]  # [T, k]: the rank holding each choice
    sent = torch.zeros(args.x.shape[0], world, dtype=torch.bool, device=device).scatter_(1, dest, True)
    row = sent.long().cumsum(0) - 1
    first = torch.arange(world, device=device) * capacity
    args.slots.copy_(torch.where(sent, first + row, world * capacity))
    return sent


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


def _block_rows(counts: list[int] | tuple[int, ...], capacity: int, device: torch.device) -> torch.Tensor:
    """int64: the first ``counts[r]`` rows of each block r of C rows, blocks in rank order."""
    return torch.cat([torch.arange(n, device=device) + r * capacity for r, n in enumerate(counts)])


@_register(
    "moe.dispatch",
    name="torch_moe_dispatch",
    priority=Priority.REFERENCE,
    graph_safe=False,  # reads the row counts on the host (.tolist()) to size the all-to-all-v
)
def torch_moe_dispatch(args: MoEDispatchArgs) -> None:
    """Reference dispatch: counts exchanged and read on the host, then an exact all-to-all-v."""
    sent = _route(args)
    device, capacity = args.x.device, args.capacity
    sent_counts = sent.sum(0)
    received_counts = torch.empty_like(sent_counts)
    dist.all_to_all_single(received_counts, sent_counts, group=args.group)
    sent_n, received_n = sent_counts.tolist(), received_counts.tolist()
    token = sent.t().nonzero()[:, 1]  # rank by rank, each in token order: the send order
    rows = _block_rows(received_n, capacity, device)
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
    """Fixed-size dispatch: whole blocks of C rows in one all_to_all_single, no host sync."""
    _route(args)
    num_tokens, hidden = args.x.shape
    rows = args.recv_x.shape[0]
    device = args.x.device
    # The token of each send row (T: padding); the extra last entry takes the unsent slots.
    token = torch.full((rows + 1,), num_tokens, dtype=torch.long, device=device)
    token.scatter_(0, args.slots.view(-1), torch.arange(num_tokens, device=device).repeat_interleave(args.world_size))
    token = token[:rows]
    if num_tokens:  # padding rows repeat the last token (finite values; their ids say padding)
        send_x = args.x[token.clamp(max=num_tokens - 1)]
    else:
        send_x = args.x.new_zeros(rows, hidden)
    dist.all_to_all_single(args.recv_x, send_x, group=args.group)
    send_meta = _metadata(args, token)
    meta = torch.empty_like(send_meta)
    dist.all_to_all_single(meta, send_meta, group=args.group)
    _unpack(args, meta)


@_register("moe.combine", name="torch_moe_combine", priority=Priority.REFERENCE)
def torch_moe_combine(args: MoECombineArgs) -> None:
    """Reference combine: the rows back as the dispatch moved them, each token's summed in float32."""
    route, y = args.route, args.y
    rows, hidden = y.shape
    back = y.new_empty(rows + 1, hidden)  # the extra last row: zeros, for the unsent slots
    back[rows].zero_()
    if route.counts is None:
        dist.all_to_all_single(back[:rows], y, group=args.group)
    else:
        sent_n, received_n = route.counts
        returned = y.new_empty(sum(sent_n), hidden)
        src = _block_rows(received_n, route.capacity, y.device)
        dist.all_to_all_single(returned, y[src], list(sent_n), list(received_n), group=args.group)
        back.index_copy_(0, _block_rows(sent_n, route.capacity, y.device), returned)
    compute = torch.promote_types(y.dtype, torch.float32)
    acc = back[route.slots[:, 0]].to(compute)
    for r in range(1, route.world_size):
        acc += back[route.slots[:, r]]
    args.out.copy_(acc)
