"""A `tandem up` stack (Redis, gateway, engines as processes) running for one test."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from tandem.up import Stack, UpConfig


@contextmanager
def running_stack(config: UpConfig) -> Iterator[Stack]:
    """Started and supervised (dead children restarted, the autoscaler run) until the end."""
    stack = Stack(config)
    stack.start(say=lambda line: None)
    supervisor = threading.Thread(target=stack.supervise, kwargs={"say": lambda line: None})
    supervisor.start()
    try:
        yield stack
    finally:
        stack.request_stop()
        supervisor.join(timeout=30)
        stack.stop()
