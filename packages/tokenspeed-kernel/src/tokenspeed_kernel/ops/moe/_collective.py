"""The collective verdict of the expert-parallel calls: a bad argument on one rank makes every
rank raise, and none is left waiting in a collective.

A rank whose own checks fail must not simply raise: the other ranks would enter the exchange's
collectives and wait for it until the group's timeout. So a validated call (``moe_dispatch``,
``moe_combine``, ``moe_dispatch_plan``, and a plan's steps under ``TOKENSPEED_KERNEL_DEBUG=1``)
starts with one small ``all_gather``: each rank contributes its facts (a few integers: sizes,
dtype, step) and its own error if it has one (kind and message). Every rank then holds the same
table and decides the same way: when any rank failed, every rank raises (the failing rank its
own error; the others an error of the same kind naming that rank and quoting its message); then
the facts must agree across ranks (``_validate.check_agreement``), and a dispatch's expert maps
must cover the experts once (:func:`gather_owners`, ``_validate.check_expert_owners``), which
every rank also decides on the same gathered values. Reading the table synchronizes with the
host: a plan's steps skip it unless ``TOKENSPEED_KERNEL_DEBUG=1``.

Only a bad ``group`` raises on its rank alone (there is nothing to gather on).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from tokenspeed_kernel.ops.moe._validate import check_expert_owners, group_has_device

__all__ = ["agree", "comm_device", "gather_owners", "raise_copy"]

# An error's kind, sent as its index + 1 (0: no error); anything else travels as RuntimeError.
_KINDS: tuple[type[Exception], ...] = (TypeError, ValueError, RuntimeError)
_MESSAGE_WORDS = 96  # 768 bytes of UTF-8 per message (longer ones are cut)


def comm_device(group: dist.ProcessGroup, *candidates: object) -> torch.device:
    """The device of this rank's collectives: the first candidate tensor's device the group has
    a backend for, else the CPU if it has one, else the current CUDA device."""
    for t in candidates:
        if isinstance(t, torch.Tensor) and group_has_device(group, t.device):
            return t.device
    if group_has_device(group, torch.device("cpu")):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def raise_copy(error: Exception) -> None:
    """Raise a fresh exception like ``error`` (a plan may keep one and raise it on every call)."""
    raise type(error)(*error.args) from None


def _encode(facts: Sequence[int], error: Exception | None) -> torch.Tensor:
    """int64 ``[2 + len(facts) + words]``: kind, facts, message length in bytes, message."""
    kind = 0 if error is None else next((i + 1 for i, k in enumerate(_KINDS) if isinstance(error, k)), len(_KINDS))
    message = b"" if error is None else str(error).encode()[: _MESSAGE_WORDS * 8]
    row = torch.zeros(2 + len(facts) + _MESSAGE_WORDS, dtype=torch.int64)
    row[0] = kind
    row[1 : 1 + len(facts)] = torch.tensor(list(facts), dtype=torch.int64)
    row[1 + len(facts)] = len(message)
    if message:
        text = row[2 + len(facts) :].view(torch.uint8)
        text[: len(message)] = torch.frombuffer(bytearray(message), dtype=torch.uint8)
    return row


def agree(
    group: dist.ProcessGroup,
    device: torch.device,
    facts: Sequence[int],
    error: Exception | None,
    what: str,
) -> list[tuple[int, ...]]:
    """All-gather every rank's ``facts`` (the same number of ints on every rank) and error, and
    raise on every rank if any rank has one (see the module docstring); every rank's facts
    otherwise, in rank order. One collective on ``device`` and one host synchronization."""
    row = _encode(facts, error).to(device)
    gathered = [torch.empty_like(row) for _ in range(group.size())]
    dist.all_gather(gathered, row, group=group)
    table = torch.stack(gathered).cpu()
    n = len(facts)
    failed = [r for r in range(table.shape[0]) if int(table[r, 0])]
    if failed:
        if error is not None:
            raise_copy(error)
        first = failed[0]
        length = int(table[first, 1 + n])
        message = bytes(table[first, 2 + n :].view(torch.uint8)[:length].tolist()).decode(errors="replace")
        ranks = f"rank {first}" if len(failed) == 1 else f"ranks {failed} (rank {first}'s error)"
        kind = _KINDS[min(int(table[first, 0]), len(_KINDS)) - 1]
        raise kind(f"{what} failed on {ranks} of the group's {table.shape[0]}: {message}")
    return [tuple(r[1 : 1 + n].tolist()) for r in table]


def gather_owners(group: dist.ProcessGroup, expert_map: torch.Tensor, device: torch.device) -> torch.Tensor:
    """All-gather every rank's ``expert_map`` (the same length E on every rank: agreed before)
    and return the rank holding each global expert, int64 ``[E]`` on ``expert_map``'s device;
    every rank raises the same ``ValueError`` when the maps do not give each expert to exactly
    one rank (``_validate.check_expert_owners``). One collective, one host synchronization."""
    mine = expert_map.to(device)
    gathered = [torch.empty_like(mine) for _ in range(group.size())]
    dist.all_gather(gathered, mine, group=group)
    owners = check_expert_owners(torch.stack(gathered).tolist())
    return torch.tensor(owners, dtype=torch.int64, device=expert_map.device)
