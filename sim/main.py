"""`tandem sim` command line (being built; see docs/simulator.md)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="llama-70b")


def main(args: argparse.Namespace) -> int:
    raise ValueError("tandem sim is not built yet")
