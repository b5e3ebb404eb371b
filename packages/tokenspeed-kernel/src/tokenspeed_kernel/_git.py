"""The git commit of a source directory, for the tools' JSON (``tools.common.source_commit``)
and the wheel build hook (``packages/tokenspeed-kernel/hatch_build.py``, which loads this
file by its path: standard library only, nothing of the package imported)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

_SHA = re.compile(r"[0-9a-f]{40}")


def _git(where: Path, *args: str) -> str | None:
    """``git *args`` run in ``where``: its stdout, or None when git is missing or fails."""
    try:
        done = subprocess.run(["git", *args], cwd=where, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def checkout_commit(where: str | Path, tracked: str | None = None) -> tuple[str, bool | None] | None:
    """(HEAD, whether tracked files have changes; None when git cannot say) of the git
    checkout ``where`` lies in; None outside a checkout, without git, or when ``tracked`` (a
    file in ``where``) is not tracked there."""
    where = Path(where)
    if tracked is not None and _git(where, "ls-files", "--error-unmatch", tracked) is None:
        return None
    commit = (_git(where, "rev-parse", "HEAD") or "").strip()
    if not _SHA.fullmatch(commit):
        return None
    status = _git(where, "status", "--porcelain", "--untracked-files=no")
    return commit, None if status is None else bool(status.strip())
