"""NgramDrafter: prompt-lookup proposals, incremental indexing, naive equivalence."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.engine.drafter import Drafter, NgramDrafter


def naive_propose(tokens: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Rescan everything: latest earlier match of the longest suffix, LZ77-style copy."""
    length = len(tokens)
    for n in range(max_ngram, min_ngram - 1, -1):
        if n > length - 1:
            continue
        suffix = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                out = list(tokens)
                for t in range(k):
                    out.append(out[start + n + t])
                return out[length:]
    return []


@pytest.mark.parametrize(
    ("tokens", "k", "expected"),
    [
        ([1, 2, 3, 4, 1, 2, 3], 4, [4, 1, 2, 3]),
        ([1, 2, 3, 4, 1, 2, 3], 2, [4, 1]),
        # The longest suffix wins over a more recent shorter one.
        ([5, 1, 2, 9, 7, 2, 8, 1, 2], 3, [9, 7, 2]),
        # Among equal lengths, the latest occurrence wins.
        ([1, 2, 5, 1, 2, 6, 1, 2], 2, [6, 1]),
        # Running into the end of the sequence, the copy repeats itself.
        ([7, 8, 9, 7, 8, 9], 5, [7, 8, 9, 7, 8]),
        ([3, 3, 3], 4, [3, 3, 3, 3]),
        ([1, 2, 3, 4], 3, []),
        ([1], 3, []),
        ([], 3, []),
        ([1, 2, 1], 0, []),
    ],
)
def test_crafted_proposals(tokens, k, expected):
    assert NgramDrafter().propose("r", tokens, k) == expected
    assert naive_propose(tokens, k, 4, 1) == expected


def test_ngram_bounds():
    # max_ngram 2: the 3-gram [1, 2, 3] is not looked for, the latest [2, 3] is.
    tokens = [1, 2, 3, 9, 0, 2, 3, 8, 1, 2, 3]
    assert NgramDrafter(max_ngram=3).propose("r", tokens, 1) == [9]
    assert NgramDrafter(max_ngram=2).propose("r", tokens, 1) == [8]
    assert NgramDrafter(min_ngram=2).propose("r", [1, 2, 3, 1], 2) == []
    assert NgramDrafter(min_ngram=1).propose("r", [1, 2, 3, 1], 2) == [2, 3]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="min_ngram"):
        NgramDrafter(max_ngram=2, min_ngram=3)
    with pytest.raises(ValueError, match="min_ngram"):
        NgramDrafter(min_ngram=0)
    with pytest.raises(ValueError, match="num_drafts"):
        NgramDrafter().propose("r", [1, 2], -1)


def test_free_forgets_a_request_and_an_unknown_one_is_fine():
    drafter: Drafter = NgramDrafter()
    drafter.free("unknown")
    tokens = [10, 11, 12, 13, 14, 10, 11]
    assert drafter.propose("r", tokens, 3) == [12, 13, 14]
    drafter.free("r")  # finished: the id may come back (a retry), with other tokens
    other = [20, 21, 22, 23, 24, 25, 26, 20, 21]  # longer: no shrink to notice
    assert drafter.propose("r", other, 2) == [22, 23]


def test_proposals_follow_incremental_appends():
    drafter = NgramDrafter()
    tokens = [10, 11, 12, 13, 14, 10, 11]
    assert drafter.propose("r", tokens, 3) == [12, 13, 14]
    # The model accepted two drafts and sampled its own token.
    tokens += [12, 13, 99]
    assert drafter.propose("r", tokens, 3) == []
    tokens += [10, 11, 12]
    # [10, 11, 12] last seen at 5 (then 13); the copy runs into the end and repeats.
    assert drafter.propose("r", tokens, 3) == [13, 99, 10]
    # A repeated call without new tokens gives the same answer.
    assert drafter.propose("r", tokens, 3) == [13, 99, 10]
    assert drafter.propose("r", tokens, 5) == naive_propose(tokens, 5, 4, 1)


def test_requests_are_independent_and_free_forgets():
    drafter = NgramDrafter()
    a = [1, 2, 3, 1, 2]
    b = [1, 2, 4, 1, 2]
    assert drafter.propose("a", a, 1) == [3]
    assert drafter.propose("b", b, 1) == [4]
    drafter.free("a")
    assert drafter.propose("a", b, 1) == [4]
    # A shorter sequence under the same id rebuilds its index.
    assert drafter.propose("b", [5, 6, 5], 1) == [6]

    # Even when seen by a call that wants no drafts.
    assert drafter.propose("c", [1, 2, 3, 9, 8, 1, 2, 3], 2) == [9, 8]
    assert drafter.propose("c", [1], 0) == []
    assert drafter.propose("c", [7, 7, 7, 7, 7, 7, 7, 6], 2) == []


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), max_size=80),
    chunks=st.lists(st.integers(1, 30), min_size=1, max_size=40),
    max_ngram=st.integers(1, 5),
    span=st.integers(0, 4),
    k=st.integers(1, 7),
)
def test_equals_naive_reference_as_tokens_arrive(tokens, chunks, max_ngram, span, k):
    min_ngram = max(1, max_ngram - span)
    drafter = NgramDrafter(max_ngram=max_ngram, min_ngram=min_ngram)
    seen: list[int] = []
    position = 0
    for size in chunks:  # chunk sizes above 16 go through the bulk indexing path
        seen.extend(tokens[position : position + size])
        position += size
        expected = naive_propose(seen, k, max_ngram, min_ngram)
        assert drafter.propose("r", seen, k) == expected
        if position >= len(tokens):
            break


def test_long_sequences_stay_exact():
    # Enough tokens for the bulk path, a large alphabet for long-range matches.
    tokens = [(i * 7919) % 97 for i in range(3000)]
    drafter = NgramDrafter()
    for end in range(2000, 3000, 37):
        assert drafter.propose("r", tokens[:end], 4) == naive_propose(tokens[:end], 4, 4, 1)
