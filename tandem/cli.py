"""The `tandem` command."""

from __future__ import annotations

import argparse
import sys


def _walkthrough(_: argparse.Namespace) -> int:
    from tandem.engine import walkthrough

    walkthrough.run()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    walk = sub.add_parser("walkthrough", help="narrate the step scheduler's rules")
    walk.set_defaults(func=_walkthrough)
    demo = sub.add_parser("demo", help="the product's main job on this machine")
    demo.set_defaults(func=_walkthrough)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
