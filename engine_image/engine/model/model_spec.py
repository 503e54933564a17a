"""What a model spec may name, without torch: `tandem up` checks a spec before it
starts anything (tandem/preflight.py), and the loader raises the same words."""

from __future__ import annotations

from pathlib import Path

ACCEPTED_FORMS = (
    "a local Hugging Face model directory (config.json + *.safetensors), "
    "a path to a .gguf file, the alias 'smollm2', or 'random:<size>'"
)


def spec_problem(spec: str) -> str | None:
    """Why `spec` names no model of an accepted form (None: it does; what a folder or
    file holds is the loader's to check)."""
    if spec == "smollm2" or spec.startswith("random:"):
        return None
    path = Path(spec).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix.lower() == ".gguf"):
        return None
    why = "is a file but not a .gguf file" if path.is_file() else "is no such file or directory"
    return f"model {spec!r} {why}; expected {ACCEPTED_FORMS}"
