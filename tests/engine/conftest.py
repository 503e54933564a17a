"""Fixtures shared by the engine tests."""

import pytest


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct from its GGUF, loaded once for the whole run (~5-10 s)."""
    from tandem.engine.model.loader import load_model

    return load_model("smollm2", dtype="float32", device="cpu")
