"""ResponseDeduplicator: what a client should see of a request's response stream.

Each request has its own stream of ResponseEvents. An event's `offset` is the
number of output tokens before it, so when an engine dies and another resumes
the request, events that overlap what was already written are recognised and
dropped. The rule is pure (no Redis), here in tandem/ because both sides read
response streams with it: the engine's synchronous reader and the resuming
engine's history (engine/service/responses.py), and the gateway's asyncio
reader (gateway/reader.py).
"""

from __future__ import annotations

import dataclasses

from tandem.protocol import ResponseEvent


class ResponseDeduplicator:
    """Turns the events of a response stream into what a client should see.

    Feed events in stream order to `accept`: it returns the event to pass on
    (trimmed of tokens already passed on), or None for an event entirely seen,
    and nothing after the first final event. It also assembles the response.

    Tokens are exact. Text is exact when engines decode the same tokens to the
    same text (the same model and tokenizer): an overlapping event's text is
    matched against what was sent from its first token on.
    """

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.final: ResponseEvent | None = None
        self._parts: list[str] = []
        self._text_len = 0
        # Token offset -> length of the text sent up to it, for the offsets where
        # that is known: where an overlapping event's text starts.
        self._text_at: dict[int, int] = {0: 0}

    @property
    def next_offset(self) -> int:
        """Tokens passed on so far (the offset a resuming engine continues at)."""
        return len(self.token_ids)

    @property
    def text(self) -> str:
        return "".join(self._parts)

    @property
    def done(self) -> bool:
        return self.final is not None

    def accept(self, event: ResponseEvent) -> ResponseEvent | None:
        if self.final is not None:
            return None
        start, seen = event.offset, self.next_offset
        end = start + len(event.token_ids)
        if start < seen:
            # Written by an engine that was behind (it resumed from an older
            # history, or it is a stalled engine whose request was reclaimed).
            text = self._unsent_text(start, end, event.text)
            if not event.is_final and (not event.token_ids or end <= seen):
                return None
            logprobs = None if event.logprobs is None else event.logprobs[seen - start :]
            event = dataclasses.replace(
                event,
                offset=seen,
                token_ids=event.token_ids[seen - start :],
                text=text,
                logprobs=logprobs,
            )
        # start > seen would be a gap (tokens never written): pass the event on
        # anyway; the client loses those tokens but not the rest of the answer.
        self.token_ids.extend(event.token_ids)
        if event.text:
            self._parts.append(event.text)
            self._text_len += len(event.text)
        self._text_at[self.next_offset] = self._text_len
        if event.is_final:
            self.final = event
        return event

    def _unsent_text(self, start: int, end: int, text: str) -> str:
        """The part of an overlapping event's text not sent yet."""
        at = self._text_at.get(start)
        if at is None:
            return text  # cannot tell: a repeated fragment beats a missing one
        sent = self.text[at:]
        if text.startswith(sent):
            return text[len(sent) :]
        if sent.startswith(text):
            # All sent already; and now the text at `end` is known, for the next
            # event of the same engine, which starts there.
            if end <= self.next_offset:
                self._text_at.setdefault(end, at + len(text))
            return ""
        return text  # the engines decoded differently: keep it, as above
