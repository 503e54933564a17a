"""The Tandem engine: scheduler, paged KV cache and (with torch) the model runner.

`from tandem.engine import LLM, SamplingParams` is the offline API. The
scheduler modules import no torch, so LLM (which does) is imported lazily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tandem.engine.request import SamplingParams

if TYPE_CHECKING:
    from tandem.engine.engine import Engine
    from tandem.engine.llm import LLM

__all__ = ["LLM", "Engine", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from tandem.engine.llm import LLM

        return LLM
    if name == "Engine":
        from tandem.engine.engine import Engine

        return Engine
    raise AttributeError(f"module 'tandem.engine' has no attribute {name!r}")
