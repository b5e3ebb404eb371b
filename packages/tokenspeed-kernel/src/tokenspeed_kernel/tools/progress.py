"""A tiny progress bar on stderr for long tool runs (shown only on a terminal; with
``lines=True``, a plain line per item elsewhere, e.g. in a device call's log)."""

from __future__ import annotations

import sys
from typing import TextIO


class Progress:
    """``step(label)`` before each of ``total`` items, ``done()`` at the end."""

    def __init__(self, total: int, stream: TextIO = sys.stderr, width: int = 24, lines: bool = False):
        self.total, self.stream, self.width, self.count = total, stream, width, 0
        self.enabled = total > 1 and hasattr(stream, "isatty") and stream.isatty()
        self.lines = lines and not self.enabled

    def step(self, label: str) -> None:
        self.count += 1
        if self.enabled:
            filled = self.width * (self.count - 1) // self.total
            bar = "#" * filled + "." * (self.width - filled)
            self.stream.write(f"\r[{bar}] {self.count}/{self.total} {label[:60]:<60}")
            self.stream.flush()
        elif self.lines:
            self.stream.write(f"[{self.count}/{self.total}] {label}\n")
            self.stream.flush()

    def note(self, text: str) -> None:
        """How the current item ended, as a line of its own (``lines`` mode only)."""
        if self.lines:
            self.stream.write(f"    {text}\n")
            self.stream.flush()

    def done(self) -> None:
        if self.enabled:
            self.stream.write("\r" + " " * (self.width + 80) + "\r")
            self.stream.flush()
