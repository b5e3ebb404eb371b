"""Wheel build hook: record the git commit the wheel was built from.

A wheel carries ``tokenspeed_kernel/_build_info.py`` (``COMMIT``: 40 hex digits or None,
``DIRTY``: True when the work tree had changes, None without git), generated in a temporary
directory and force-included, so nothing is written into the source tree. The tools'
JSON reads it (``tokenspeed_kernel.tools.common.source_commit``): on a machine that got a
copy of the working tree and our wheels, ``git rev-parse`` in the current directory names
whatever commit that copy was, not the code that runs. An editable install gets no file:
it reads git at run time from its own source directory.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

_TARGET = "tokenspeed_kernel/_build_info.py"


def _git(root: str, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def build_info(root: str) -> tuple[str | None, bool | None]:
    """(the commit checked out at ``root``, whether its work tree has changes); (None, None)
    outside a git checkout or without git."""
    commit = (_git(root, "rev-parse", "HEAD") or "").strip()
    if not re.fullmatch(r"[0-9a-f]{40}", commit):
        return None, None
    status = _git(root, "status", "--porcelain", "--untracked-files=no")
    return commit, None if status is None else bool(status.strip())


class CustomBuildHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if version == "editable":
            return
        commit, dirty = build_info(self.root)
        self._tmp = tempfile.mkdtemp(prefix="tokenspeed-build-info-")
        path = os.path.join(self._tmp, "_build_info.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(
                f'"""Generated at wheel build time (hatch_build.py); not in git."""\n\nCOMMIT = {commit!r}\nDIRTY = {dirty!r}\n'
            )
        build_data["force_include"][path] = _TARGET

    def finalize(self, version: str, build_data: dict[str, Any], artifact_path: str) -> None:
        tmp = getattr(self, "_tmp", None)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
