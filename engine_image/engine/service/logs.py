"""The engine's log format, set in each process (a data-parallel rank is a fresh
interpreter)."""

from __future__ import annotations

import logging


def log_to_stderr(rank: int | None = None) -> None:
    """Lines with their level (an alert on WARNING and above can tell them), and a
    data-parallel rank's number (its lines read as another rank's otherwise)."""
    where = "" if rank is None else f"rank {rank} "
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s {where}%(name)s %(message)s",
        force=True,  # a rank's format over its parent's, where one was set
    )
