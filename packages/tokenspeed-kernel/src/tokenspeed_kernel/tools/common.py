"""Argument checks and output shared by the tools (check, bench, profile, overhead) and the CLI.

Each check raises ``ValueError`` with one line naming the bad value and what would be
accepted; the CLI turns that into exit code 2 and one line on stderr. :func:`provenance` is
the block every JSON the tools write starts with: the versions, Python, and the commit of
the code that ran (:func:`source_commit`).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import math
import os
import platform as _host
import re
from pathlib import Path
from typing import Any

import torch

from tokenspeed_kernel import registry
from tokenspeed_kernel._git import checkout_commit

__all__ = [
    "COMMIT_ENV",
    "PROVENANCE_KEYS",
    "available_devices",
    "kernels_per_op",
    "named_kernels",
    "provenance",
    "resolve_device",
    "source_commit",
    "versions",
    "write_json",
]

# Names the commit of the code that runs, over everything source_commit reads (e.g. for a
# wheel built outside git): a commit as git names it, "-dirty" appended for a changed tree.
COMMIT_ENV = "TOKENSPEED_KERNEL_COMMIT"
# The keys provenance() returns, in its order.
PROVENANCE_KEYS = ("versions", "python", "commit", "dirty", "commit_from")
_SHA = re.compile(r"[0-9a-f]{40}")

# Device types the tools can run on (what torch.device accepts is wider: mps, xpu, meta, ...).
_TOOL_DEVICE_TYPES = ("cpu", "cuda")


def available_devices() -> list[str]:
    """The devices the tools can use here: ``cpu``, then ``cuda:0`` ... when torch sees a GPU
    (on a ROCm build of torch too: its GPUs are ``cuda`` devices to torch)."""
    gpus = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return ["cpu", *gpus]


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``device`` as a ``torch.device`` the tools can run on; ``None``: ``cuda`` when a GPU is
    available, else ``cpu``.

    Raises ``ValueError`` (one line: the device and the ones available here) for a string torch
    does not parse, a device type the tools do not run on, or a GPU this torch build or
    machine does not have.
    """
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    here = ", ".join(available_devices())
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"unknown device {str(device)!r}; available here: {here}") from None
    if dev.type not in _TOOL_DEVICE_TYPES:
        raise ValueError(f"device {str(device)!r}: the tools run on cpu or cuda only; available here: {here}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch build has no GPU support" if not _gpu_build() else "torch sees no GPU on this machine"
            raise ValueError(f"device {str(device)!r} is not available ({why}); available here: {here}")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {str(device)!r} is not available; available here: {here}")
    return dev


def _gpu_build() -> bool:
    return bool(getattr(torch.version, "cuda", None) or getattr(torch.version, "hip", None))


def named_kernels(op: str, names: list[str]) -> list[str]:
    """``names`` after checking each is a kernel registered for ``op``.

    Raises ``ValueError`` (one line) for a name that is not registered, or registered for
    another operator, listing ``op``'s kernels.
    """
    mine = [spec.name for spec in registry.kernels(op)]
    for name in names:
        if name in mine:
            continue
        other = registry.kernel_op(name)
        where = (
            f"kernel {name!r} is registered for {other}, not {op}"
            if other
            else f"no kernel named {name!r} is registered"
        )
        raise ValueError(f"{where}; {op} kernels: {', '.join(mine) or 'none'}")
    return names


def kernels_per_op(ops: list[str], names: list[str]) -> dict[str, list[str]]:
    """Per operator of ``ops``, the kernels of ``names`` registered for it. With one operator
    every name must be one of its kernels (:func:`named_kernels`); with several, a name runs
    on its own operator and the others are left without it.

    Raises ``ValueError`` (one line, listing the valid names) for a name registered for none
    of ``ops``.
    """
    if len(ops) == 1:
        return {ops[0]: named_kernels(ops[0], names)}
    mine = {op: [spec.name for spec in registry.kernels(op)] for op in ops}
    for name in names:
        if not any(name in kernels for kernels in mine.values()):
            listed = "; ".join(f"{op}: {', '.join(kernels) or 'none'}" for op, kernels in mine.items())
            raise ValueError(f"no kernel named {name!r} is registered for {', '.join(ops)}; kernels: {listed}")
    return {op: [name for name in names if name in mine[op]] for op in ops}


def _finite(value: Any) -> Any:
    """NaN/inf floats as None (strict JSON has no NaN), recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def write_json(path: str, data: Any) -> None:
    """Write ``data`` to ``path`` as indented JSON (non-finite floats become ``null``)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_finite(data), f, indent=2)
        f.write("\n")


_REQ = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*")  # the distribution name at the start of a requirement


def versions() -> dict[str, str]:
    """torch, every installed distribution of ours (``tokenspeed-kernel*``), and each installed
    library those require or offer as an extra (e.g. the compiler a backend wheel builds with)."""
    found: dict[str, str] = {"torch": torch.__version__}
    ours: dict[str, importlib.metadata.Distribution] = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name.startswith("tokenspeed-kernel") and name not in ours:
            ours[name] = dist
    wanted = sorted({m.group(0).lower() for d in ours.values() for r in d.requires or () if (m := _REQ.match(r))})
    for name in sorted(ours):
        found[name] = ours[name].version
    for name in wanted:
        if name in found or name.startswith("tokenspeed-kernel"):
            continue
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def source_commit(package_dir: Path | None = None, build_info: str = "tokenspeed_kernel._build_info") -> dict[str, Any]:
    """The commit of the tokenspeed-kernel code that runs: ``{"commit", "dirty", "from"}``.

    In order: ``$TOKENSPEED_KERNEL_COMMIT`` (``from="env"``; a ``-dirty`` suffix sets
    ``dirty``); the git checkout the package's own source is tracked in, i.e. an editable
    install (``"git"``); the module a wheel build generated (``build_info``, written by
    ``packages/tokenspeed-kernel/hatch_build.py``: ``"wheel"``). Never the current
    directory: on a GPU machine that is a copy of some working tree, while the code that
    runs is the installed wheel. ``commit`` and ``dirty`` are None when nothing says
    (``from=None``: e.g. a wheel built outside git). ``package_dir`` (default: this
    package's directory) and ``build_info`` are for tests.
    """
    given = os.environ.get(COMMIT_ENV, "").strip()
    if given:
        commit, dirty = given.removesuffix("-dirty"), given.endswith("-dirty")
        return {"commit": commit, "dirty": dirty, "from": "env"}
    # tracked: a wheel installed into a virtual environment that happens to sit inside some
    # checkout must not report that checkout's commit
    found = checkout_commit(package_dir or Path(__file__).resolve().parents[1], tracked="__init__.py")
    if found is not None:
        return {"commit": found[0], "dirty": found[1], "from": "git"}
    try:
        info = importlib.import_module(build_info)
    except ImportError:
        return {"commit": None, "dirty": None, "from": None}
    built = getattr(info, "COMMIT", None)
    if not isinstance(built, str) or not _SHA.fullmatch(built):
        return {"commit": None, "dirty": None, "from": None}
    return {"commit": built, "dirty": getattr(info, "DIRTY", None), "from": "wheel"}


def provenance() -> dict[str, Any]:
    """What every JSON the tools write carries: ``versions`` (:func:`versions`), ``python``
    and ``commit``/``dirty``/``commit_from`` (:func:`source_commit`)."""
    found = source_commit()
    values = (versions(), _host.python_version(), found["commit"], found["dirty"], found["from"])
    return dict(zip(PROVENANCE_KEYS, values))
