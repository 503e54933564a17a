"""The operator runs as whatever user its pod is given.

OpenShift's restricted policy runs a pod as a user id from the namespace's range, one
the image's password database does not list (the chart's `operator.runAsUser`
allows any). kopf's default replica name asks that database for the user's name, so
the operator ended at start. Run here as such a user through a user namespace.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.polling import eventually

UNLISTED_UID = 1000650000

KUBECONFIG = """\
apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "http://127.0.0.1:1"}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
users: [{name: u, user: {token: t}}]
"""


def _as_unlisted_user() -> list[str]:
    """The command prefix that runs a process as UNLISTED_UID, or a skip saying why not."""
    unshare = shutil.which("unshare")
    prefix = [unshare or "unshare", "--user", f"--map-user={UNLISTED_UID}"]
    if unshare is None or subprocess.run([*prefix, "true"], capture_output=True).returncode:
        pytest.skip("this machine cannot make user namespaces (unshare --user)")
    return prefix


def test_the_operator_starts_as_a_user_the_image_does_not_list(tmp_path: Path):
    config = tmp_path / "kubeconfig"
    config.write_text(KUBECONFIG)
    config.chmod(0o644)
    log = tmp_path / "operator.log"
    # No USER or LOGNAME, as in a pod: only the password database could name the user.
    env = {"PATH": os.environ["PATH"], "KUBECONFIG": str(config), "HOME": str(tmp_path)}
    command = [sys.executable, "-m", "tandem.cli", "operator", "--namespace", "default"]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*_as_unlisted_user(), *command], stdout=out, stderr=subprocess.STDOUT, env=env
        )
    try:
        # Past its own name: it goes on to the API server (unreachable here, retried).
        def started() -> bool:
            return "Initial authentication has finished" in log.read_text()

        assert eventually(lambda: started() or proc.poll() is not None, 60)
        assert started() and proc.poll() is None, log.read_text()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
