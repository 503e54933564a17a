"""How `tandem up` knows it is up: every child answers its readiness URL, then the
gateway lists the model (an engine's heartbeat reached the registry).

Both waits end early on a stop request (Ctrl-C while starting) and fail with a
StartError that names what was not ready and where its log is.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tandem.child import Child, local_get
from tandem.preflight import StartError


@dataclass(frozen=True)
class ReadyWait:
    timeout_s: float  # --ready-timeout, for the errors' words
    deadline: float  # time.monotonic() by which all must be ready
    stopping: threading.Event  # set by a stop request: the wait raises KeyboardInterrupt
    log_dir: Path  # named in the errors

    def children(self, children: list[Child], say: Callable[[str], object]) -> None:
        """Until every child answers its readiness URL."""
        pending = list(children)
        while pending:
            self._check_stop()
            for child in list(pending):
                check_alive(child)
                if child.newly_ready():
                    say(f"{child.name:<10} ready")
                    pending.remove(child)
            if time.monotonic() > self.deadline:
                names = ", ".join(c.name for c in pending)
                raise StartError(
                    f"not ready after {self.timeout_s:g} s (--ready-timeout): {names} "
                    f"(their logs are in {self.log_dir})"
                )
            time.sleep(0.25)

    def model(self, url: str, api_key: str, name: str, gateway: Child) -> None:
        """Until the gateway at `url` lists model `name` in /v1/models."""
        request = urllib.request.Request(
            f"{url}/v1/models", headers={"Authorization": f"Bearer {api_key}"}
        )
        while time.monotonic() < self.deadline:
            self._check_stop()  # not --ready-timeout later
            # Its port answering is not proof: a second tandem up on the same port saw
            # the first one's gateway ready while its own had exited.
            check_alive(gateway)
            body = local_get(request, timeout=2)
            if body is not None and name in listed(body):
                return
            time.sleep(0.25)
        raise StartError(
            f"the gateway never listed model {name!r}: no engine registered it "
            f"in {self.timeout_s:g} s (--ready-timeout; the logs are in {self.log_dir})"
        )

    def _check_stop(self) -> None:
        if self.stopping.is_set():
            raise KeyboardInterrupt


def check_alive(child: Child) -> None:
    if not child.alive:
        raise StartError(
            f"{child.name} exited while starting ({child.exit_reason()}; "
            f"details in {child.log_path})"
        )


def listed(body: bytes) -> set[str]:
    """The model ids of a /v1/models answer (a substring of its JSON matched "list",
    and never a name that JSON escapes)."""
    try:
        return {m.get("id") for m in json.loads(body).get("data", []) if isinstance(m, dict)}
    except (ValueError, AttributeError):
        return set()
