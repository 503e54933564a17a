"""Fixtures shared by the engine tests."""

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct from its GGUF, loaded once for the whole run (~5-10 s)."""
    from tandem.engine.model.loader import load_model

    return load_model("smollm2", dtype="float32", device="cpu")


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """torch's (and the kernels' OpenMP) thread count for one test, restored after. The
    suite runs single-threaded (tests/conftest.py); the engine runs on every core. A test
    that needs one count asks for it: parametrize("threads", [2], indirect=True)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(previous)
