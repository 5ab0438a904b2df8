"""Progress of the long commands (install-llama-server, demo-model, demo-drafter, pull).

One look for all of them: tqdm, the library huggingface_hub already draws
its download bars with. On a terminal a bar redraws itself in place; in a
pipe, a CI log or a service's journal carriage returns would pile up into
one unreadable line, so there `LineBar` writes plain, newline-terminated
lines instead: when a stage starts, at each tenth of it, every EVERY_S
seconds while it advances (a line is written when the stage moves: one
long silent step is one long wait, as on a terminal), and when it ends.

Progress goes to stderr; a command's own output (a path, JSON) stays alone
on stdout.
"""

from __future__ import annotations

import sys
import time
from typing import IO

from tqdm import tqdm

EVERY_S = 10.0  # without a terminal: a line this often while a stage advances


def interactive(stream: IO | None = None) -> bool:
    """Whether `stream` (default: stderr) is a terminal that can redraw a bar."""
    stream = stream or sys.stderr
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


class LineBar(tqdm):
    """tqdm's interface, drawn as plain lines (no \\r, no escapes) for logs.

    A line says the stage, n of total (and the percentage and time left
    when the total is known), the elapsed time, the rate and the postfix.
    A subclass of tqdm so huggingface_hub takes it as `tqdm_class`.
    """

    def __init__(self, *args, **kwargs):
        self._said_at = -float("inf")
        self._said_tenth = -1
        self._said_n: float | None = None
        # leave=False: tqdm's close then calls display(msg="") once, our last line.
        # mininterval=0, miniters=1: tqdm asks display() at every update, and
        # display() decides (a tenth passed, EVERY_S passed): no tenth is skipped.
        kwargs.update(leave=False, position=0, dynamic_ncols=False, disable=False,
                      mininterval=0, miniters=1)  # fmt: skip
        super().__init__(*args, **kwargs)

    @staticmethod
    def status_printer(file):
        return lambda _s: None  # tqdm's own printer redraws with \r

    def clear(self, nolock=False):
        pass  # tqdm.write() clears bars with \r; a line once written stays

    def display(self, msg=None, pos=None):
        closing = msg == ""
        now = time.monotonic()
        total = self.total or 0
        tenth = min(10, int(10 * self.n / total)) if total else -1
        due = closing or tenth > self._said_tenth or now - self._said_at >= EVERY_S
        if due and not (closing and self._said_n == self.n):  # the end, if not already said
            self._said_at, self._said_tenth, self._said_n = now, tenth, self.n
            self.fp.write(self.line() + "\n")
            getattr(self.fp, "flush", lambda: None)()
        return False  # nothing to erase: tqdm writes no \r after a line

    def line(self) -> str:
        d = self.format_dict
        known = bool(d["total"]) and d["n"] <= d["total"]
        unit = ("" if d["unit_scale"] else " ") + d["unit"]  # 1.50MB, 25 steps
        fmt = ("{desc}{percentage:.0f}% ({n_fmt}/{total_fmt}" + unit + ") {elapsed} elapsed, "
               "{remaining} left, {rate_fmt}{postfix}" if known
               else "{desc}{n_fmt}" + unit + " {elapsed} elapsed, {rate_fmt}{postfix}")  # fmt: skip
        desc = d["prefix"] or ""
        return self.format_meter(**{**d, "total": d["total"] if known else None, "ncols": None,
                                    "bar_format": fmt, "prefix": f"{desc}: " if desc else ""})  # fmt: skip


def bar(desc: str, total: float | None = None, *, unit: str = "it", unit_scale: bool = False,
        initial: float = 0, stream: IO | None = None) -> tqdm:  # fmt: skip
    """A progress bar for one stage: a live tqdm bar on a terminal, plain lines elsewhere.
    Use it as a context manager (or close it): the end of the stage is its last line."""
    stream = stream or sys.stderr
    cls = tqdm if interactive(stream) else LineBar
    return cls(desc=desc, total=total, unit=unit, unit_scale=unit_scale, initial=initial,
               file=stream, dynamic_ncols=True, disable=False)  # fmt: skip


def say(message: str, stream: IO | None = None) -> None:
    """One line of progress text, printed above any live bar rather than through it."""
    tqdm.write(message, file=stream or sys.stderr)
    getattr(stream or sys.stderr, "flush", lambda: None)()
