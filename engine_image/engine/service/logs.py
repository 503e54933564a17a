"""The engine's log format, set in each process (a data-parallel rank is a fresh
interpreter)."""

from __future__ import annotations

import logging


def log_to_stderr() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
