"""Draft proposers for speculative decoding: the protocol and the n-gram drafter.

A drafter proposes up to num_drafts tokens to follow a sequence; the next
decode step feeds them after the last token and the sampler keeps the prefix
the target model agrees with (see sampler.py). Drafts are only a guess: a bad
one costs compute, never correctness.

An MTP (multi-token prediction) head does not fit `Drafter.propose`, and is
not forced to: it drafts from the target model's last hidden states, so it
runs inside the model runner after the forward pass (mtp.py: `MtpHead`, and
the distributions of sampled drafts kept for the sampler). Its drafts reach
the scheduler the same way, through StepResult.draft_token_ids. The protocol
below is for drafters that need only the token ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Drafter(Protocol):
    def propose(self, request_id: str, token_ids: Sequence[int], num_drafts: int) -> list[int]:
        """Up to num_drafts tokens likely to follow token_ids (prompt then output).

        token_ids is read during the call only (any sequence that slices into lists).
        """
        ...

    def free(self, request_id: str) -> None:
        """Forget a finished or preempted request."""
        ...


class _Index:
    """One request's n-grams: each maps to the start of its latest occurrence."""

    __slots__ = ("latest", "match", "num_indexed")

    def __init__(self) -> None:
        # Keys are tuples of n tokens, min_ngram <= n <= max_ngram (lengths never collide).
        self.latest: dict[tuple[int, ...], int] = {}
        # Every n-gram inside token_ids[:num_indexed] is in `latest`.
        self.num_indexed = 0
        # (start, n) of the suffix's match when num_indexed tokens were seen, or None:
        # indexing the suffix overwrote it, and a repeated call needs it again.
        self.match: tuple[int, int] | None = None


# Up to this many new tokens are indexed one by one; beyond it, in bulk with zip.
_BULK = 16


class NgramDrafter:
    """Prompt-lookup drafting: continue the sequence as it went on last time.

    For n from max_ngram down to min_ngram, find the latest earlier occurrence
    of the sequence's last n tokens; the drafts are the tokens that followed
    it. When they run into the end of the sequence, the copy continues from
    its own start (an overlapping LZ77 copy), so a loop of period p is
    drafted in full rather than cut at p tokens.

    Each request keeps an index of its n-grams, extended by the tokens
    appended since the last call, so a step costs O(new tokens), not
    O(sequence); memory is about max_ngram - min_ngram + 1 dict entries per
    token. token_ids must only grow between calls for one request (a shorter
    sequence rebuilds the index); free() drops it.
    """

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(
                f"need 1 <= min_ngram <= max_ngram, got min_ngram {min_ngram}, "
                f"max_ngram {max_ngram}"
            )
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._indexes: dict[str, _Index] = {}

    def free(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)

    def propose(self, request_id: str, token_ids: Sequence[int], num_drafts: int) -> list[int]:
        if num_drafts < 0:
            raise ValueError(f"num_drafts must be >= 0, got {num_drafts}")
        length = len(token_ids)
        index = self._indexes.get(request_id)
        if index is None or index.num_indexed > length:  # shorter: another sequence now
            index = self._indexes[request_id] = _Index()
        if num_drafts == 0:
            return []
        if index.num_indexed < length:
            index.match = self._advance(index, token_ids)
        if index.match is None:
            return []
        start, n = index.match
        follow = token_ids[start + n : start + n + num_drafts]  # never copy the whole tail
        if len(follow) == num_drafts:
            return follow
        return (follow * -(-num_drafts // len(follow)))[:num_drafts]

    def _advance(self, index: _Index, tokens: Sequence[int]) -> tuple[int, int] | None:
        """Index all of tokens; return (start, n) of the suffix's latest earlier match."""
        length = len(tokens)
        first = index.num_indexed
        latest = index.latest
        lo, hi = self.min_ngram, self.max_ngram
        # n-grams ending before the last token: one by one, or in bulk after a prompt.
        if length - 1 - first <= _BULK:
            for stop in range(first + 1, length):
                for n in range(lo, min(hi, stop) + 1):
                    latest[tuple(tokens[stop - n : stop])] = stop - n
        else:
            for n in range(lo, hi + 1):
                # n-grams starting in [a, b]; later ones overwrite earlier: the latest wins.
                a, b = max(0, first + 1 - n), length - 1 - n
                if b >= a:
                    grams = zip(*(tokens[a + k : b + 1 + k] for k in range(n)), strict=True)
                    latest.update(zip(grams, range(a, b + 1), strict=True))
        # The suffix n-grams, longest first: look each up, then index it.
        top = min(hi, length)
        tail = tuple(tokens[length - top :])
        match = None
        for i in range(top - lo + 1):
            key = tail[i:] if i else tail
            if match is None:
                start = latest.get(key)
                if start is not None:
                    match = (start, top - i)
            latest[key] = length - top + i
        index.num_indexed = length
        return match
