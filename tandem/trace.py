"""Request traces (JSONL, one request per line): what `tandem bench` and `tandem sim` replay.

    {"arrival_s": 0.0, "input_tokens": 512, "output_tokens": 128}

`arrival_s` is seconds from the start of the run (>= 0, the first within a
week; lines in any order: they are sorted); the token counts are integers >= 1.
Blank lines and lines starting with `#` are skipped; other keys are allowed and
ignored (a trace exported from elsewhere may carry ids or timestamps). A bad
line is a TraceError naming the file, the line number and what is wrong.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tandem.lengths import MAX_LENGTH

# The latest first arrival a trace may have: a quiet week, no more.
MAX_FIRST_ARRIVAL_S = 7 * 86400


class TraceError(ValueError):
    """A trace that cannot be read; the message names the line."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    # Seconds after the run's start at which the request is sent.
    arrival_s: float
    # Prompt length in tokens.
    input_tokens: int
    # Output length in tokens (max_tokens; a simulated request never stops early).
    output_tokens: int

    def __post_init__(self) -> None:
        if not math.isfinite(self.arrival_s) or self.arrival_s < 0:
            raise ValueError(f"arrival_s must be finite and >= 0, got {self.arrival_s!r}")
        for name in ("input_tokens", "output_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def parse_trace(lines: Iterable[str], source: str = "<trace>") -> list[TraceRequest]:
    """The requests of a trace, sorted by arrival."""
    requests = []
    for number, line in enumerate(lines, start=1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        requests.append(_parse_line(text, f"{source} line {number}"))
    if not requests:
        raise TraceError(f"{source}: no requests in the trace")
    requests.sort(key=lambda r: r.arrival_s)
    first = requests[0].arrival_s
    if first > MAX_FIRST_ARRIVAL_S:
        # A Unix timestamp, surely: the bench slept until then, and the simulator ran its
        # autoscaler through decades of nothing.
        raise TraceError(
            f"{source}: its first request arrives {first:,.0f} s ({first / 86400:,.0f} days) "
            "after the start: arrival_s counts seconds from the trace's start (these look "
            "like timestamps); subtract the first arrival from every line"
        )
    return requests


def read_trace(path: str | Path) -> list[TraceRequest]:
    try:
        with open(path, "rb") as handle:
            return parse_trace(_decoded(handle, str(path)), str(path))
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror or exc}") from None


def write_trace(path: str | Path, requests: Iterable[TraceRequest]) -> None:
    """Write `requests` as a trace, creating the missing folders of `path`."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        for r in requests:
            fields = {
                "arrival_s": r.arrival_s,
                "input_tokens": r.input_tokens,
                "output_tokens": r.output_tokens,
            }
            handle.write(json.dumps(fields) + "\n")


def _decoded(lines: Iterable[bytes], source: str) -> Iterator[str]:
    """The lines as text, decoded one by one so that bad bytes are named by their line."""
    for number, raw in enumerate(lines, start=1):
        try:
            # utf-8-sig on the first line: editors on Windows start files with a BOM.
            yield raw.decode("utf-8-sig" if number == 1 else "utf-8")
        except UnicodeDecodeError as exc:
            byte = raw[exc.start : exc.start + 1].hex()
            raise TraceError(f"{source} line {number}: not UTF-8 text (byte 0x{byte})") from None


def _parse_line(text: str, where: str) -> TraceRequest:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in ("arrival_s", "input_tokens", "output_tokens") if k not in obj]
    if missing:
        raise TraceError(f"{where}: missing {', '.join(missing)}")
    arrival = obj["arrival_s"]
    if isinstance(arrival, bool) or not isinstance(arrival, int | float):
        raise TraceError(f"{where}: arrival_s must be a number, got {arrival!r}")
    if not math.isfinite(arrival) or arrival < 0:
        raise TraceError(f"{where}: arrival_s must be finite and >= 0, got {arrival!r}")
    counts = []
    for key in ("input_tokens", "output_tokens"):
        value = obj[key]
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_LENGTH:
            # Past it, found mid-run: a prompt of that many ids was built (an OverflowError).
            raise TraceError(
                f"{where}: {key} must be an integer in 1..{MAX_LENGTH:,}, got {value!r}"
            )
        counts.append(value)
    return TraceRequest(float(arrival), counts[0], counts[1])
