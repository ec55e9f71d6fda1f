"""A one-line text progress bar for the example scripts (stderr; no dependency).

    bar = ProgressBar(total=6)
    bar.show(0, "step 1/3 (compiling)")
    bar.show(1, "step 1/3: loss +0.1")
    bar.log("a line for stdout")   # clears the bar, prints the line, redraws the bar
    bar.close()
"""

from __future__ import annotations

import sys


class ProgressBar:
    def __init__(self, total: int, width: int = 24, stream=None):
        self.total = max(total, 1)
        self.width = width
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self.text = ""
        self.shown = False

    def _line(self) -> str:
        filled = int(self.width * min(self.done, self.total) / self.total)
        return f"[{'#' * filled}{'-' * (self.width - filled)}] {self.done}/{self.total} {self.text}"

    def show(self, done: int, text: str = "") -> None:
        self.done, self.text = done, text
        self.stream.write("\r" + self._line()[:100].ljust(100))
        self.stream.flush()
        self.shown = True

    def clear(self) -> None:
        if self.shown:
            self.stream.write("\r" + " " * 100 + "\r")
            self.stream.flush()
            self.shown = False

    def log(self, line: str) -> None:
        self.clear()
        print(line, flush=True)
        self.show(self.done, self.text)

    def close(self) -> None:
        if self.shown:
            self.stream.write("\n")
            self.stream.flush()
            self.shown = False
