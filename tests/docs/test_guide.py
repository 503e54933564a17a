"""docs/guide.md's commands work: each fenced block runs here, or says why it cannot.

Every block follows a `<!-- check: KIND -->` comment:
- `helm`: runs in bash at the repository root, with .tools/bin on PATH;
- `server`: the `tandem up` command; started here (plus `--port` of a free port)
  for the `gateway` blocks;
- `gateway`: curl (bash) and the OpenAI SDK (python) against that server, as
  written, with `localhost:8000` pointed at its port and TANDEM_API_KEY set to
  the `--api-key` of the server block;
- `local`: runs in bash as is;
- `cluster`: needs a Kubernetes cluster, so it is not run: its shell syntax is
  checked and the repository paths it names must exist;
- `output`: sample output, nothing to run.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.helm import NAMESPACE, RELEASE, helm_path, named, render

from tandem.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "guide.md"
KINDS = {"helm", "server", "gateway", "local", "cluster", "output"}
_MARKED = re.compile(r"<!-- check: (\w+) -->\n```(\w*)\n(.*?)\n```", re.S)


@dataclass(frozen=True)
class Block:
    kind: str
    language: str
    code: str

    @property
    def id(self) -> str:
        return f"{self.kind}:{self.code.splitlines()[0][:40]}"


def blocks(kind: str | None = None) -> list[Block]:
    found = [Block(*match) for match in _MARKED.findall(GUIDE.read_text())]
    return [b for b in found if kind is None or b.kind == kind]


def test_every_block_is_marked():
    fences = GUIDE.read_text().count("\n```") // 2
    assert len(blocks()) == fences, "a fenced block without a <!-- check: KIND --> comment"
    assert {b.kind for b in blocks()} <= KINDS


def _bash(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", code],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize("block", blocks("cluster"), ids=lambda b: b.id)
def test_cluster_blocks_are_well_formed(block):
    # Checked here; run against a cluster only by a person following the guide.
    syntax = subprocess.run(["bash", "-n", "-c", block.code], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    for token in shlex.split(block.code.replace("\\\n", " "), comments=True):
        if re.match(r"^(charts|crds|examples)/", token):
            assert (ROOT / token).exists(), f"{token} does not exist"


def test_cluster_blocks_name_what_the_chart_makes():
    """The guide's release (tandem in tandem-system) makes the Service and Secret it uses."""
    code = "\n".join(b.code for b in blocks("cluster"))
    assert f"helm install {RELEASE} charts/tandem --namespace {NAMESPACE}" in code
    manifests = render(helm_path())
    service = named(manifests, "Service", "tandem-gateway")
    assert f"svc/tandem-gateway 8000:{service['spec']['ports'][0]['port']}" in code
    secret = named(manifests, "Secret", "tandem-gateway-bootstrap-key")
    assert "secret --namespace tandem-system tandem-gateway-bootstrap-key" in code
    assert "{.data.api-key}" in code and "api-key" in secret["data"]


def test_the_sample_of_kubectl_get_md_has_the_crds_columns():
    """The guide's `kubectl get md` sample: NAME, the CRD's default columns, and the
    status values this operator writes."""
    from tandem.operator.crd import printer_columns
    from tandem.operator.status import Phase

    [sample] = [b.code for b in blocks("output") if b.code.startswith("NAME ")]
    header, *rows = [line.split() for line in sample.splitlines()]
    shown = [c["name"].upper() for c in printer_columns() if not c.get("priority")]
    assert header == ["NAME", *shown]
    phases = {p.value for p in Phase}
    assert rows and all(row[header.index("PHASE")] in phases for row in rows)


@pytest.mark.parametrize("block", blocks("helm"), ids=lambda b: b.id)
def test_helm_blocks_run(block):
    helm = Path(helm_path())
    done = _bash(block.code, {"PATH": f"{helm.parent}:{os.environ['PATH']}"})
    assert done.returncode == 0, done.stderr
    assert "Deployment" in done.stdout


@pytest.mark.parametrize("block", blocks("local"), ids=lambda b: b.id)
def test_local_blocks_run(block):
    done = _bash(block.code)
    assert done.returncode == 0, done.stderr


@dataclass(frozen=True)
class Server:
    port: int
    api_key: str


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The guide's own `tandem up` command, on a free port."""
    (block,) = blocks("server")
    argv = shlex.split(block.code)
    assert argv[0].endswith("tandem") and argv[1] == "up"
    api_key = argv[argv.index("--api-key") + 1]
    port = free_port()
    log = tmp_path_factory.mktemp("tandem-up")
    argv = [str(Path(sys.executable).with_name("tandem")), *argv[1:]]
    argv += ["--port", str(port), "--log-dir", str(log)]
    process = subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        _wait_until_up(process)
        yield Server(port, api_key)
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_until_up(process: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 180
    assert process.stdout is not None
    seen = []
    for line in process.stdout:
        seen.append(line)
        if line.startswith("Tandem is up"):
            return
        if time.monotonic() > deadline:
            break
    raise AssertionError("tandem up did not come up:\n" + "".join(seen[-30:]))


def _pointed_at(code: str, server: Server) -> str:
    return code.replace("localhost:8000", f"127.0.0.1:{server.port}")


@pytest.mark.slow
@pytest.mark.parametrize("block", blocks("gateway"), ids=lambda b: b.id)
def test_gateway_blocks_answer(block, server):
    env = {"TANDEM_API_KEY": server.api_key}
    code = _pointed_at(block.code, server)
    if block.language == "python":
        done = subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
    else:
        if shutil.which("curl") is None:
            pytest.skip("no curl on this machine")
        done = _bash(code, env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip(), "no answer"
    assert '"error"' not in done.stdout, done.stdout
    if "stream" in code and block.language != "python":
        assert "data: [DONE]" in done.stdout
