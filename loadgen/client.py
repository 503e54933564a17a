"""One streamed request to an OpenAI-compatible endpoint, timed on the client.

Timing starts just before the request is handed to httpx and covers what a
user of the endpoint would see: connecting (if the pooled connection is not
reused), the server's queueing and work, and reading the stream. TTFT is
taken at the first SSE chunk carrying text (Tandem's chat streams open with
a role-only chunk: not a token), the end at `data: [DONE]` or the end of
the body. The output length is the server's `usage.completion_tokens`
(requested with `stream_options.include_usage`), else the number of text
chunks, which undercounts when a chunk carries several tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from tandem.loadgen.record import RequestRecord

# Error messages kept in records and reports are cut here: a 413 may echo a lot.
MAX_MESSAGE = 300


@dataclass(frozen=True)
class Target:
    # Base URL up to and including /v1 (e.g. http://127.0.0.1:8000/v1).
    base_url: str
    # Model name sent in every request.
    model: str
    # "completions" (/v1/completions) or "chat" (/v1/chat/completions).
    api: str = "completions"
    # Send `ignore_eos: true` (Tandem and vLLM): outputs run to max_tokens.
    ignore_eos: bool = True
    # Sampling temperature; 0: greedy.
    temperature: float = 0.0
    # Seconds one request may take in all before it counts as a timeout.
    timeout_s: float = 600.0
    # Extra headers (Authorization).
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        path = "chat/completions" if self.api == "chat" else "completions"
        return f"{self.base_url.rstrip('/')}/{path}"

    def body(self, prompt: str | list[int], max_tokens: int, *, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model}
        if self.api == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        body |= {"max_tokens": max_tokens, "temperature": self.temperature, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        if self.ignore_eos:
            body["ignore_eos"] = True
        return body


async def send(
    client: httpx.AsyncClient,
    target: Target,
    record: RequestRecord,
    prompt: str | list[int],
    run_start: float,
) -> RequestRecord:
    """Send one streaming request and fill `record` with what happened (never raises)."""
    body = target.body(prompt, record.max_tokens, stream=True)
    started = time.perf_counter()
    record.start_s = started - run_start
    try:
        async with asyncio.timeout(target.timeout_s):
            async with client.stream("POST", target.url, json=body) as response:
                record.status = response.status_code
                if response.status_code != 200:
                    await response.aread()
                    record.error_kind = f"http_{response.status_code}"
                    record.error_message = _error_message(response.text)
                else:
                    await _read_stream(response, target, record, run_start)
    except TimeoutError:
        if record.e2e_s is None:  # else cut while reading the body's end past [DONE]: kept
            record.error_kind = "timeout"
            record.error_message = f"no complete answer within {target.timeout_s:g} s"
    except httpx.TimeoutException as exc:
        record.error_kind = "timeout"
        record.error_message = _short(described(exc))
    except (httpx.TransportError, OSError) as exc:
        record.error_kind = "connection"
        record.error_message = _short(described(exc))
    except httpx.HTTPError as exc:  # an undecodable body
        record.error_kind = "protocol"
        record.error_message = _short(described(exc))
    if record.e2e_s is None:  # else it ended at [DONE]
        record.e2e_s = time.perf_counter() - started
    return record


async def _read_stream(
    response: httpx.Response, target: Target, record: RequestRecord, run_start: float
) -> None:
    chunks = 0
    events = 0
    done = False
    lines = sse_lines(response)
    async for line in lines:
        now = time.perf_counter()
        if not line.startswith("data:"):
            continue  # blank separators, comments, `event:` lines
        events += 1
        payload = line[5:].strip()
        if payload == "[DONE]":
            record.e2e_s = now - run_start - record.start_s
            done = True
            break
        try:
            chunk = json.loads(payload)
        except json.JSONDecodeError:
            chunk = None
        if not isinstance(chunk, dict):
            record.error_kind = "protocol"
            record.error_message = _short(f"unreadable SSE data: {payload}")
            return
        if "error" in chunk:
            record.error_kind = "stream_error"
            record.error_message = _error_message(payload)
            return
        try:
            texts, finish, usage = _parts(chunk, target.api)
        except (TypeError, ValueError) as exc:  # a chunk of the wrong shape
            record.error_kind = "protocol"
            record.error_message = _short(f"{exc}: {payload}")
            return
        for _ in texts:
            if record.ttft_s is None:
                record.ttft_s = now - run_start - record.start_s
            record.chunk_times_s.append(now - run_start)
            chunks += 1
        if finish is not None:
            record.finish_reason = finish
        if usage is not None:
            record.prompt_tokens, record.output_tokens = usage
            record.usage_reported = True
    if record.finish_reason is None:
        record.error_kind = "protocol"
        record.error_message = "the stream ended without a finish_reason"
        if not events:  # a server that ignores stream: true, say
            kind = response.headers.get("content-type") or "no Content-Type"
            record.error_message = f"the server sent no event stream ({kind}, no data: line)"
    if not record.usage_reported:
        record.output_tokens = chunks
    if done:  # last: the answer is whole, whatever the body's end does
        await _drain(lines)


# How long the rest of a body may take after its [DONE] (its end, usually at once).
DRAIN_S = 1.0


async def _drain(lines: AsyncIterator[str]) -> None:
    """Read a complete answer's body to its end, so that its connection goes back to the
    pool (left at [DONE], each request timed a new connection's setup). A server that
    keeps the body open, or breaks it off, costs the connection, not the answer."""
    with contextlib.suppress(TimeoutError, httpx.HTTPError, OSError):
        async with asyncio.timeout(DRAIN_S):
            async for _ in lines:
                pass


# What a chat chunk's delta may carry as generated text: the answer, and a reasoning
# model's thoughts (its usage counts them too, so they time its tokens as well).
_DELTA_TEXTS = ("content", "reasoning_content", "reasoning")


def _parts(
    chunk: dict[str, Any], api: str
) -> tuple[list[str], str | None, tuple[int | None, int] | None]:
    """A chunk's texts (one per choice that carries some), finish reason and usage
    (prompt, completion tokens); TypeError for a chunk of another shape."""
    choices = chunk.get("choices") or []
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        raise TypeError("choices is not a list of objects")
    texts, finish = [], None
    for choice in choices:
        if api == "chat":
            delta = choice.get("delta") or {}
            if not isinstance(delta, dict):
                raise TypeError("delta is not an object")
            text = "".join(t for k in _DELTA_TEXTS if isinstance(t := delta.get(k), str))
        else:
            text = choice.get("text")
        if text:
            if not isinstance(text, str):
                raise TypeError("text is not a string")
            texts.append(text)
        if choice.get("finish_reason"):
            finish = str(choice["finish_reason"])
    usage = chunk.get("usage")
    if not usage:
        return texts, finish, None
    if not isinstance(usage, dict):
        raise TypeError("usage is not an object")
    completion, prompt = usage.get("completion_tokens"), usage.get("prompt_tokens")
    if completion is None:
        return texts, finish, None
    if not _count(completion) or (prompt is not None and not _count(prompt)):
        raise TypeError("usage's token counts are not counts")
    return texts, finish, (prompt, completion)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


async def sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """The body's lines as SSE splits them: at CR, LF or CRLF only (text may hold U+2028
    or U+0085, which str.splitlines, and so httpx's aiter_lines, splits at)."""
    pending, after_cr = b"", False
    async for data in response.aiter_bytes():
        if after_cr and data.startswith(b"\n"):
            data = data[1:]  # the LF of a CRLF split across two reads: no second line
        after_cr = data.endswith(b"\r")
        *lines, pending = _LINE_END.split(pending + data)
        for line in lines:
            yield line.decode("utf-8", errors="replace")
    if pending:
        yield pending.decode("utf-8", errors="replace")


_LINE_END = re.compile(rb"\r\n|\r|\n")


async def probe_prompt_tokens(
    client: httpx.AsyncClient, target: Target, prompt: str | list[int]
) -> int:
    """Prompt tokens the server counts for `prompt` (a one-token, non-streamed request)."""
    response = await client.post(target.url, json=target.body(prompt, 1, stream=False))
    if response.status_code != 200:
        raise ValueError(
            f"calibration request failed: HTTP {response.status_code}: "
            f"{_error_message(response.text)}"
        )
    try:
        prompt_tokens = response.json()["usage"]["prompt_tokens"]
    except (ValueError, KeyError, TypeError):  # not JSON, or not an OpenAI answer
        prompt_tokens = None
    if not isinstance(prompt_tokens, int):
        raise ValueError("the server sends no usage.prompt_tokens: cannot calibrate --prompt text")
    return prompt_tokens


def _error_message(text: str) -> str:
    """The OpenAI error body's message, else the raw text."""
    try:
        body = json.loads(text)
        message = body["error"]["message"]
        if isinstance(message, str):
            return _short(message)
    except (ValueError, KeyError, TypeError):
        pass
    return _short(text)


def described(exc: BaseException) -> str:
    """The error's type and its words, on one line. httpx's ReadError from a server that
    closed the connection (a 413 answered before a huge body was sent) has no words."""
    words = " ".join(str(exc).split()) or "the server closed the connection, or it was cut"
    return f"{type(exc).__name__}: {words}"


def _short(text: str) -> str:
    text = text.strip()
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 3] + "..."
