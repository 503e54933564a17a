"""StopMatcher against the plain definition: the first stop string the text completes,
and the longest tail of the text that begins one, whatever pieces the text came in."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.engine.stop_matcher import StopMatcher

TEXT = st.text(alphabet="ab€", max_size=40)  # few letters: overlaps and repeats abound
STOPS = st.lists(st.text(alphabet="ab€", min_size=1, max_size=6), min_size=1, max_size=4)


def _first_stop(text: str, stops: list[str]) -> int | None:
    """The start of the stop that completes first (the longest of those ending there)."""
    hits = [(i + len(s), i) for s in stops if (i := text.find(s)) != -1]
    return min(hits)[1] if hits else None


def _held(text: str, stops: list[str]) -> int:
    tails = [k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])]
    return max(tails, default=0)


@settings(max_examples=400, deadline=None)
@given(TEXT, STOPS, st.lists(st.integers(1, 5), max_size=40))
def test_it_finds_what_a_search_of_the_whole_text_finds(text, stops, cuts):
    matcher, fed, pieces = StopMatcher(stops), "", []
    rest = text
    for cut in cuts:
        pieces.append(rest[:cut])
        rest = rest[cut:]
    pieces.append(rest)
    for piece in pieces:
        start = matcher.feed(piece)
        fed += piece
        if start is not None:
            # Found as the piece completed it: the text up to here holds it, first.
            end = start + len(next(s for s in stops if fed.startswith(s, start)))
            assert start == _first_stop(fed[:end], stops)
            return
        assert _first_stop(fed, stops) is None
        assert matcher.held() == _held(fed, stops)


def test_a_long_stop_string_is_held_back_and_found_across_thousands_of_pieces():
    # (It was found by testing every tail against every stop at each token: ~1.3 ms a
    # token for a 20,000-character stop, on the thread that steps every request.)
    matcher = StopMatcher(["x" * 20_000 + "y", "q" * 19_999])
    for _ in range(3_000):
        assert matcher.feed("x" * 4) is None
    assert matcher.held() == 12_000
    assert matcher.feed("x" * 8_000 + "y") == 0
