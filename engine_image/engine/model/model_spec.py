"""What a model spec may name, without torch: `tandem up` checks a spec before it
starts anything (tandem/preflight.py), and the loader raises the same words."""

from __future__ import annotations

import json
from pathlib import Path

from tandem.engine.model.model_config import RANDOM_POSITIONS, RANDOM_SHAPES, SMOLLM2_135M

INDEX_FILE = "model.safetensors.index.json"  # a sharded checkpoint's map of its files
ACCEPTED_FORMS = (
    "a local Hugging Face model directory (config.json + *.safetensors), "
    "a path to a .gguf file, the alias 'smollm2', or 'random:<size>'"
)


def spec_problem(spec: str) -> str | None:
    """Why `spec` names no model of an accepted form (None: it does; what a folder or
    file holds is the loader's to check)."""
    if spec.startswith("random:"):
        size = spec.removeprefix("random:")
        if size in RANDOM_SHAPES:
            return None
        return f"model {spec!r}: unknown size {size!r}; known sizes: {', '.join(RANDOM_SHAPES)}"
    if spec == "smollm2":
        return None
    path = Path(spec).expanduser()
    if path.is_dir():
        return _folder_problem(spec, path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return None
    why = "is a file but not a .gguf file" if path.is_file() else "is no such file or directory"
    return f"model {spec!r} {why}; expected {ACCEPTED_FORMS}"


def _folder_problem(spec: str, path: Path) -> str | None:
    """Why a folder is no Hugging Face model directory, in the loader's words (hf_dir.py),
    by its config.json: the first thing the loader reads."""
    if (path / "config.json").is_file():
        return None
    ggufs = sorted(path.glob("*.gguf"))
    if ggufs:
        return f"model {spec!r} holds GGUF files, not a Hugging Face model; pass {ggufs[0]}"
    return f"model {spec!r}: no config.json; not a Hugging Face model directory"


def weights_problem(spec: str) -> str | None:
    """Why a model folder holds no weights the loader reads, as far as its file names
    tell (None: it may; other specs are not folders). The loader says so only after its
    config checks; `tandem up` asks before it starts anything."""
    path = Path(spec).expanduser()
    if not path.is_dir() or any(path.glob("*.safetensors")) or (path / INDEX_FILE).is_file():
        return None
    if any(path.glob("*.bin")) or any(path.glob("*.pt")):
        pickled = "only pickled weights (*.bin/*.pt); convert them to safetensors first"
        return f"model {spec!r}: {pickled}"
    return f"model {spec!r}: no *.safetensors weight files"


def declared_positions(spec: str) -> int | None:
    """The positions the model was trained for, where that is cheap to read without
    loading it (a preset, a config.json that says); None where it is not (a GGUF file:
    its engine checks)."""
    if spec == "smollm2":
        return SMOLLM2_135M.max_position_embeddings
    if spec.startswith("random:"):
        return RANDOM_POSITIONS
    path = Path(spec).expanduser() / "config.json"
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None
