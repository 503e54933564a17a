"""`tandem demo`: the product's main job, end to end, on this machine.

Starts `tandem up` (embedded Redis, a gateway, an engine with SmolLM2), asks
one question through the OpenAI-compatible HTTP API with streaming, prints
the answer as it arrives, and shuts everything down.
"""

from __future__ import annotations

import json
import signal
import sys
import time

import httpx

from tandem.redis_server import free_port
from tandem.up import Stack, UpConfig


class AnswerError(RuntimeError):
    """The gateway refused the question, or the answer broke off; str() is its word."""


def stream_chat(url: str, api_key: str, model: str, question: str, max_tokens: int):
    """Yield the answer's text pieces from /v1/chat/completions with stream=true;
    AnswerError if the gateway refuses or the stream ends in an error event."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {api_key}"}
    # This machine's own gateway: no proxy from the environment applies (tandem up's own
    # probes ask it directly too).
    with httpx.stream(
        "POST",
        f"{url}/v1/chat/completions",
        json=body,
        headers=headers,
        timeout=300,
        trust_env=False,
    ) as resp:
        if resp.status_code != 200:
            resp.read()
            raise AnswerError(f"the gateway answered {resp.status_code}: {_said(resp.text)}")
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                return
            event = json.loads(data)
            if "error" in event:  # after the status line: the only way left to say it
                raise AnswerError(f"the answer broke off: {_said(data)}")
            for choice in event.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    yield piece


def _said(body: str) -> str:
    """An OpenAI error body's message (else the body as it came)."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body


def run(model: str, question: str, mode: str = "normal", max_tokens: int = 64) -> int:
    config = UpConfig(model=model, mode=mode, port=free_port())
    started = time.perf_counter()

    def say(line: str) -> None:
        print(f"  [{time.perf_counter() - started:5.1f}s] {line}", file=sys.stderr)

    stack = Stack(config)

    def terminated(*_: object) -> None:
        # As Ctrl-C (`timeout`, a cancelled CI job): died at once, it left the run folder,
        # every prompt and answer in its Redis file, behind in /tmp.
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminated)
    try:
        stack.start(say=say)
        print(f"> {question}")
        asked = time.perf_counter()
        try:
            for piece in stream_chat(stack.url, stack.api_key, config.name, question, max_tokens):
                print(piece, end="", flush=True)
        except AnswerError as exc:
            print()
            print(f"tandem: error: {exc}", file=sys.stderr)
            return 1
        print()
        say(f"answered in {time.perf_counter() - asked:.2f}s through {stack.url}/v1")
    finally:
        # A Ctrl-C now hurries the stop, as `tandem up`'s second one does: breaking out
        # of it killed the children undrained and left the run folder, every prompt
        # and answer in its Redis file, behind in /tmp.
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: stack.request_stop())
        stack.stop()
    return 0
