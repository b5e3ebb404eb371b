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

import importlib.util
import os
import shutil
import tempfile
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

_TARGET = "tokenspeed_kernel/_build_info.py"


def _checkout_commit(root: str) -> tuple[str, bool | None] | None:
    """``tokenspeed_kernel._git.checkout_commit(root)``, that module loaded by its path: the
    build environment need not import the package (or torch)."""
    path = os.path.join(root, "src", "tokenspeed_kernel", "_git.py")
    spec = importlib.util.spec_from_file_location("_tokenspeed_kernel_git", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.checkout_commit(root)


class CustomBuildHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if version == "editable":
            return
        commit, dirty = _checkout_commit(self.root) or (None, None)
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
