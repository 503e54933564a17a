"""Prompts of a requested token count, for a server whose tokenizer the client does not know.

Two ways, chosen with --prompt:
- `ids` (default, /v1/completions only): the prompt is a list of token ids,
  drawn at random from a range every vocabulary has (default 10..499). Exact:
  the server counts the tokens it was sent. Tandem and vLLM accept this; the
  random ids also keep prompts from sharing prefixes (no prefix-cache hits
  that would flatter the figures).
- `text`: words drawn from a small list, the number of words calibrated
  against the server before the run (two probes; `usage.prompt_tokens`
  gives tokens = intercept + per_word x words, the intercept absorbing any
  chat template). Approximate: tokenizers merge some word pairs.
Every request gets its own generator seeded by (seed, index), so a prompt
does not depend on the order requests happened to be sent in.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# Common English words: each one token in most BPE vocabularies (with the leading space).
WORDS = (
    "time",
    "year",
    "people",
    "way",
    "day",
    "man",
    "thing",
    "woman",
    "life",
    "child",
    "world",
    "school",
    "state",
    "family",
    "student",
    "group",
    "country",
    "problem",
    "hand",
    "part",
    "place",
    "case",
    "week",
    "company",
    "system",
    "program",
    "question",
    "work",
    "government",
    "number",
    "night",
    "point",
    "home",
    "water",
    "room",
    "mother",
    "area",
    "money",
    "story",
    "fact",
    "month",
    "lot",
    "right",
    "study",
    "book",
    "eye",
    "job",
    "word",
    "business",
    "issue",
    "side",
    "kind",
    "head",
)


def request_rng(seed: int, index: int) -> random.Random:
    return random.Random(f"prompt:{seed}:{index}")


def token_ids(count: int, rng: random.Random, low: int, high: int) -> list[int]:
    """`count` ids uniform in [low, high]."""
    # One call, not one randint per id: drawn on the event loop that times the answers,
    # 8,192 ids took 15 ms, and long prompts at tens of requests/s inflated TTFT.
    return rng.choices(range(low, high + 1), k=count)


def words(count: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


@dataclass(frozen=True)
class Calibration:
    """prompt tokens = intercept + per_word x words, as the server counted."""

    # Tokens the server adds whatever the text (BOS, chat template).
    intercept: float
    # Tokens per word of WORDS.
    per_word: float

    def words_for(self, tokens: int) -> int:
        return max(1, round((tokens - self.intercept) / self.per_word))


def fit_calibration(probes: list[tuple[int, int]]) -> Calibration:
    """From (words, prompt tokens) at two or more word counts: the least-squares line."""
    if len({w for w, _ in probes}) < 2:
        raise ValueError("calibration needs probes at two different word counts")
    n = len(probes)
    mean_w = sum(w for w, _ in probes) / n
    mean_t = sum(t for _, t in probes) / n
    cov = sum((w - mean_w) * (t - mean_t) for w, t in probes)
    var = sum((w - mean_w) ** 2 for w, _ in probes)
    per_word = cov / var
    if per_word <= 0:
        raise ValueError(f"calibration failed: the server counted {probes} (tokens per word <= 0)")
    return Calibration(mean_t - per_word * mean_w, per_word)
