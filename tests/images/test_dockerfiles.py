"""The three images, checked without Docker (there is none here; `make images` builds them).

Each Dockerfile: a pinned base, a non-root user that matches what the chart and
the operator run it as, an entry point that is a subcommand of the `tandem`
CLI the tests run, and a build context that really builds: its COPY lines are
replayed into a folder and pip builds the project from it.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml

from tandem.cli import build_parser
from tandem.operator.settings import DEFAULT_ENGINE_RUN_AS_USER as ENGINE_UID

ROOT = Path(__file__).resolve().parents[2]
VALUES = yaml.safe_load((ROOT / "charts" / "tandem" / "values.yaml").read_text())
# Dockerfile -> (the `tandem` subcommand it runs, the user the chart or operator runs it as).
IMAGES = {
    "engine_image/Dockerfile": ("engine", ENGINE_UID),
    "gateway/Dockerfile": ("gateway", VALUES["gateway"]["runAsUser"]),
    "operator/Dockerfile": ("operator", VALUES["operator"]["runAsUser"]),
}


def _instructions(path: str) -> list[tuple[str, str]]:
    text = (ROOT / path).read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines()]
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "")
        for line in lines
        if line and not line.startswith("#")
    ]


@pytest.mark.parametrize("path", IMAGES)
def test_base_images_are_pinned(path):
    args = {
        arg.split("=", 1)[0]: arg.split("=", 1)[1]
        for op, arg in _instructions(path)
        if op == "ARG" and "=" in arg
    }
    for op, arg in _instructions(path):
        if op != "FROM":
            continue
        image = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), arg.split()[0])
        if image.startswith("base-"):
            continue  # a stage of the same file
        tag = image.partition(":")[2]
        assert tag and tag != "latest" and re.search(r"\d", tag), f"{path}: {image} is not pinned"


@pytest.mark.parametrize("path", IMAGES)
def test_runs_the_tandem_cli_as_the_expected_user(path):
    command, uid = IMAGES[path]
    instructions = _instructions(path)
    users = [arg for op, arg in instructions if op == "USER"]
    assert users and users[-1] == str(uid), f"{path}: runs as {users[-1:]} not {uid}"
    (entrypoint,) = [json.loads(arg) for op, arg in instructions if op == "ENTRYPOINT"]
    assert entrypoint == ["tandem", command]
    build_parser().parse_args([command])  # a subcommand of the CLI the tests run


def test_the_operator_image_installs_no_model_runtime():
    runs = " ".join(arg for op, arg in _instructions("operator/Dockerfile") if op == "RUN")
    assert '".[operator]"' in runs
    assert "runtime" not in runs and "torch" not in runs
    probe = (
        "import sys, tandem.cli, tandem.operator.main, tandem.operator.rbac; "
        "assert 'torch' not in sys.modules and 'numpy' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", probe], check=True, timeout=60)


@pytest.mark.slow
@pytest.mark.parametrize("path", IMAGES)
def test_the_build_context_builds_the_project(path, tmp_path):
    """Replay the COPY lines into a folder, then build the wheel as `pip install .` would."""
    context = tmp_path / "src"
    context.mkdir()
    for op, arg in _instructions(path):
        if op != "COPY" or arg.startswith("--from"):
            continue
        *sources, target = arg.split()
        for source in sources:
            destination = context / target / (Path(source).name if target.endswith("/") else "")
            if target in ("./", "."):
                destination = context / Path(source).name
            if (ROOT / source).is_dir():
                shutil.copytree(ROOT / source, destination, ignore=_ignored)
            else:
                destination.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(ROOT / source, destination)
    package_dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ]
    missing = [d for d in package_dirs.values() if not (context / d).is_dir()]
    assert missing == [], f"{path}: setuptools needs {missing} (add COPY lines)"
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    build = subprocess.run(
        [*pip, "-w", str(tmp_path / "dist"), str(context)],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert build.returncode == 0, build.stderr[-2000:]
    # The C++ kernels compile at run time from the installed package: every file they
    # build from (sources and headers) must be package data.
    csrc = context / "engine_image/engine/model/csrc"
    if csrc.is_dir():
        (wheel,) = (tmp_path / "dist").glob("*.whl")
        shipped = set(zipfile.ZipFile(wheel).namelist())
        needed = {f"tandem/engine/model/csrc/{f.name}" for f in csrc.iterdir()}
        assert needed <= shipped, f"{path}: the wheel lacks {sorted(needed - shipped)}"


def _ignored(_: str, names: list[str]) -> list[str]:
    return [n for n in names if n in ("__pycache__", ".pytest_cache")]
