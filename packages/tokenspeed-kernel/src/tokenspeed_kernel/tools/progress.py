"""Progress of long tool runs on stderr: a bar redrawn in place on a terminal, one line per
item when stderr is a file or a pipe (a log then shows how far a run got)."""

from __future__ import annotations

import sys
from typing import TextIO


class Progress:
    """``step(label)`` before each of ``total`` items, ``note(text)`` for how an item ended
    (a line of its own, off a terminal only), ``done()`` at the end. Silent for a single item."""

    def __init__(self, total: int, stream: TextIO = sys.stderr, width: int = 24):
        self.total, self.stream, self.width, self.count = total, stream, width, 0
        self.enabled = total > 1
        self.terminal = hasattr(stream, "isatty") and stream.isatty()

    def step(self, label: str) -> None:
        self.count += 1
        if not self.enabled:
            return
        if self.terminal:
            filled = self.width * (self.count - 1) // self.total
            bar = "#" * filled + "." * (self.width - filled)
            self.stream.write(f"\r[{bar}] {self.count}/{self.total} {label[:60]:<60}")
        else:
            self.stream.write(f"[{self.count}/{self.total}] {label}\n")
        self.stream.flush()

    def note(self, text: str) -> None:
        if self.enabled and not self.terminal:
            self.stream.write(f"    {text}\n")
            self.stream.flush()

    def done(self) -> None:
        if self.enabled and self.terminal:
            self.stream.write("\r" + " " * (self.width + 80) + "\r")
            self.stream.flush()
