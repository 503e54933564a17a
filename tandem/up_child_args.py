"""`tandem up --engine-args` and `--gateway-args`: more flags for every engine, or for
the gateway, checked at once.

Checked as `tandem engine` (or `tandem gateway`) would check them, its own parser and
rules, before anything starts: a typo named in a second, not as a child that exits
while starting. The flags `tandem up` sets itself are refused, each with what sets it.
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Callable, Mapping
from typing import NoReturn

# Flags `tandem up` gives every engine: where to listen, what to serve, who it is.
SET_FOR_ENGINES = {
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
# And the gateway: where it listens, its Redis and keys, its stop.
SET_FOR_GATEWAY = {
    "--host": "--host",
    "--port": "--port",
    "--redis-url": "--redis-url",
    "--key-prefix": "tandem up (the engines' keys)",
    "--api-keys-file": "--api-key",
    "--no-auth": "--api-key",
    "--shutdown-timeout": "tandem up (its stop waits for the engines' answers)",
}


def checked_engine_args(text: str) -> tuple[str, ...]:
    """The flags in `text` (shell words), or ValueError naming the one refused."""
    from tandem.engine.service.arguments import add_arguments, check_arguments

    return _checked(text, "--engine-args", "tandem engine", add_arguments, check_arguments,
                    SET_FOR_ENGINES)  # fmt: skip


def checked_gateway_args(text: str) -> tuple[str, ...]:
    """The flags in `text` (shell words), or ValueError naming the one refused."""
    from tandem.gateway.main import add_arguments
    from tandem.gateway.settings import GatewaySettings

    def add_own_arguments(parser: argparse.ArgumentParser) -> None:
        add_arguments(parser)
        # Set by tandem up (--redis-url): not the environment's, checked on its own.
        parser.set_defaults(redis_url=GatewaySettings().redis_url)

    return _checked(text, "--gateway-args", "tandem gateway", add_own_arguments,
                    GatewaySettings.from_args, SET_FOR_GATEWAY)  # fmt: skip


def _checked(
    text: str,
    option: str,
    prog: str,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    check: Callable[[argparse.Namespace], object],
    set_by_up: Mapping[str, str],
) -> tuple[str, ...]:
    try:
        words = tuple(shlex.split(text))
    except ValueError as exc:  # an unclosed quote
        raise ValueError(f"{option} {text!r}: {exc}") from None
    for word in words:
        flag = word.split("=", 1)[0]
        if flag in set_by_up:
            raise ValueError(f"{option} cannot set {flag}: set by {set_by_up[flag]}")
        if flag in ("-h", "--help"):
            raise ValueError(f"{option}: `{prog} --help` lists its flags")
    parser = _Refusing(option, prog=prog, allow_abbrev=False, add_help=False)
    add_arguments(parser)
    flags = parser.parse_args(words)  # its refusals name the option already
    try:
        check(flags)
    except ValueError as exc:
        raise ValueError(f"{option}: {exc}") from None
    return words


class _Refusing(argparse.ArgumentParser):
    """A child's parser, raising ValueError where argparse would print and exit."""

    def __init__(self, option: str, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self._option = option

    def error(self, message: str) -> NoReturn:
        raise ValueError(f"{self._option}: {message}")
