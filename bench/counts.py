"""The benches' count flags (--rounds, --steps, --repeats): whole numbers of at least one.

Zero ran nothing and printed inf or nan as results, or a traceback from statistics.
"""

from __future__ import annotations

import argparse


def count(text: str) -> int:
    """argparse type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
