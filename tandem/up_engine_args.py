"""`tandem up --engine-args`: more `tandem engine` flags for every engine, checked at once.

Checked as `tandem engine` would check them (its own parser and rules), before
anything starts: a typo named in a second, not as an engine that exits while
loading. The flags `tandem up` sets itself are refused, each with what sets it.
"""

from __future__ import annotations

import argparse
import shlex
from typing import NoReturn

from tandem.engine.service.arguments import add_arguments, check_arguments

# Flags `tandem up` gives every engine: where to listen, what to serve, who it is.
SET_BY_UP = {
    "--model": "--model",
    "--served-model-name": "--served-model-name",
    "--role": "--mode",
    "--redis-url": "--redis-url",
    "--host": "tandem up (engines listen on 127.0.0.1)",
    "--advertise-host": "tandem up (engines listen on 127.0.0.1)",
    "--port": "tandem up (a free port each)",
    "--kv-port": "tandem up (a free port each)",
    "--engine-id": "tandem up (one id per engine)",
    "--key-prefix": "tandem up (the gateway's keys)",
    "--data-parallel-size": "tandem up (one rank per engine)",
    "--drain-timeout": "tandem up (its stop waits for the engines' drain)",
}


class _Refusing(argparse.ArgumentParser):
    """The engine's parser, raising ValueError where argparse would print and exit."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(f"--engine-args: {message}")


def checked_engine_args(text: str) -> tuple[str, ...]:
    """The flags in `text` (shell words), or ValueError naming the one refused."""
    try:
        words = tuple(shlex.split(text))
    except ValueError as exc:  # an unclosed quote
        raise ValueError(f"--engine-args {text!r}: {exc}") from None
    for word in words:
        flag = word.split("=", 1)[0]
        if flag in SET_BY_UP:
            raise ValueError(f"--engine-args cannot set {flag}: set by {SET_BY_UP[flag]}")
        if flag in ("-h", "--help"):
            raise ValueError("--engine-args: `tandem engine --help` lists the engine's flags")
    parser = _Refusing(prog="tandem engine", allow_abbrev=False, add_help=False)
    add_arguments(parser)
    flags = parser.parse_args(words)  # its refusals name --engine-args already
    try:
        check_arguments(flags)
    except ValueError as exc:
        raise ValueError(f"--engine-args: {exc}") from None
    return words
