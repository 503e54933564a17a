"""Fixtures of the chart tests: the helm binary, and each ci/*-values.yaml rendered once."""

from __future__ import annotations

from typing import Any

import pytest
from support.helm import CI_VALUES, helm_path, render


@pytest.fixture(scope="session")
def helm() -> str:
    return helm_path()


@pytest.fixture(scope="session")
def renders(helm: str) -> dict[str, list[dict[str, Any]]]:
    """ci values file stem (e.g. "defaults-values") -> the manifests it renders."""
    return {path.stem: render(helm, values=[path]) for path in CI_VALUES}
