"""`tandem bench` command line (being built; see docs/benchmarks.md)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1")


def main(args: argparse.Namespace) -> int:
    raise ValueError("tandem bench is not built yet")
