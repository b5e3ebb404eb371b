"""Run a function on W local ranks of a ``torch.distributed`` process group, with timeouts.

The expert-parallel tests (gloo on the CPU) and ``ci/device/ep_bench.py`` (NCCL on the GPUs,
or gloo with ``--cpu``) start their ranks here: ``run_ranks(fn, W)`` spawns W processes,
each joins one process group through a file store (no port to pick), calls
``fn(rank, world_size, *args)`` and sends back what it returns (picklable). Every collective
of the group times out after ``timeout_s`` (the process group's timeout), and the parent
waits at most ``deadline_s`` in all: processes still running then are killed and
``TimeoutError`` says which ranks had not reported. A rank that raises makes ``run_ranks``
raise ``RuntimeError`` with every failed rank's traceback.

``fn`` must be importable by name from a module (the processes are spawned, not forked:
forking a process that has run torch's thread pools can hang).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from typing import Any

__all__ = ["run_ranks"]


def _rank_main(
    rank: int,
    world_size: int,
    store_path: str,
    backend: str,
    timeout_s: float,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
) -> None:
    import torch
    import torch.distributed as dist

    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        try:
            results.put((rank, True, fn(rank, world_size, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


@contextlib.contextmanager
def _environ(env: Mapping[str, str]) -> Iterator[None]:
    """``env`` set while the processes start (spawned children copy the environment)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple[Any, ...] = (),
    backend: str = "gloo",
    timeout_s: float = 30.0,
    deadline_s: float = 120.0,
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """``[fn(0, W, *args), ..., fn(W - 1, W, *args)]``, each run in its own spawned process
    inside a ``backend`` process group of ``world_size`` ranks (see the module docstring)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="ranks-") as tmp:
        store = os.path.join(tmp, "store")
        with _environ(env or {}):
            procs = [
                ctx.Process(
                    target=_rank_main,
                    args=(rank, world_size, store, backend, timeout_s, fn, args, results),
                    daemon=True,
                )
                for rank in range(world_size)
            ]
            for p in procs:
                p.start()
        reported: dict[int, tuple[bool, Any]] = {}
        end = time.monotonic() + deadline_s
        try:
            while len(reported) < world_size:
                left = end - time.monotonic()
                if left <= 0:
                    break
                try:
                    rank, ok, value = results.get(timeout=min(left, 1.0))
                except queue.Empty:
                    if all(not p.is_alive() for p in procs) and results.empty():
                        break  # every process is gone; a crashed one never reports
                    continue
                reported[rank] = (ok, value)
        finally:
            for p in procs:
                p.join(timeout=max(0.0, min(5.0, end - time.monotonic())))
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5.0)
    missing = [r for r in range(world_size) if r not in reported]
    failed = {r: v for r, (ok, v) in sorted(reported.items()) if not ok}
    if failed:
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in failed.items())
        raise RuntimeError(f"ranks {sorted(failed)} of {world_size} raised:\n{text}")
    if missing:
        codes = {r: procs[r].exitcode for r in missing}
        raise TimeoutError(
            f"ranks {missing} of {world_size} did not report within {deadline_s} s (exit codes {codes}); killed"
        )
    return [reported[r][1] for r in range(world_size)]
