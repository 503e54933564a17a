"""A one-line live progress display on stderr: a carriage return and the line again.

Off when the stream is not a terminal (logs and pipes get no control
characters) or with --quiet. Redrawn at most every `min_interval_s`: a
terminal write per token would cost more than the request it reports.
"""

from __future__ import annotations

import time
from typing import TextIO


def progress_enabled(stream: TextIO, quiet: bool) -> bool:
    isatty = getattr(stream, "isatty", None)
    return not quiet and isatty is not None and isatty()


def progress_line(
    done: int,
    total: int | None,
    ok: int,
    in_flight: int,
    elapsed_s: float,
    duration_s: float | None,
) -> str:
    """The text of the line, e.g. `[#####     ] 10/20 ok 10 err 0 in flight 3 2.1 req/s 4.8s`."""
    if total:
        fraction = done / total
        goal = f"{done}/{total}"
    elif duration_s:
        fraction = elapsed_s / duration_s
        goal = f"{done} done"
    else:
        fraction, goal = 0.0, f"{done} done"
    filled = round(20 * min(1.0, fraction))
    rate = done / elapsed_s if elapsed_s > 0 else 0.0
    return (
        f"[{'#' * filled}{' ' * (20 - filled)}] {goal}  ok {ok}  err {done - ok}  "
        f"in flight {in_flight}  {rate:.1f} req/s  {elapsed_s:.1f}s"
    )


class Progress:
    def __init__(self, stream: TextIO, enabled: bool, min_interval_s: float = 0.1) -> None:
        self.stream = stream
        self.enabled = enabled
        self.min_interval_s = min_interval_s
        self._last = -float("inf")
        self._width = 0

    def update(self, line: str, *, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < self.min_interval_s:
            return
        self._last = now
        # Pad with spaces so a shorter line fully covers the previous one.
        self.stream.write("\r" + line.ljust(self._width))
        self.stream.flush()
        self._width = len(line)

    def close(self) -> None:
        if self.enabled and self._width:
            self.stream.write("\n")
            self.stream.flush()
