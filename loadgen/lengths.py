"""Token-length specs for `tandem bench`: the ones `tandem sim` reads (tandem/lengths.py)."""

from tandem.lengths import KINDS, MAX_LENGTH, LengthDist, parse_length

__all__ = ["KINDS", "MAX_LENGTH", "LengthDist", "parse_length"]
