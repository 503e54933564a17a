"""UpConfig: what `tandem up` runs, checked once (tandem/up.py runs it); the
ModelDeployment file `tandem up -f` reads."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tandem.protocol import check_served_name


@dataclass(frozen=True)
class UpConfig:
    model: str = "smollm2"
    # Name clients ask for; default: the model spec.
    served_model_name: str | None = None
    mode: str = "normal"  # or "disaggregated"
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # None: generate one
    redis_url: str | None = None  # None: start an embedded Redis
    # Extra `tandem engine` flags for every engine (e.g. ["--max-model-len", "2048"]).
    engine_args: tuple[str, ...] = ()
    # Extra `tandem gateway` flags (e.g. ["--default-max-tokens", "4096"]).
    gateway_args: tuple[str, ...] = ()
    log_dir: Path | None = None
    # Seconds the engines may take to load and serve (--ready-timeout).
    ready_timeout: float = 300.0
    # A ModelDeployment document (`tandem up -f`): its roles, replicas and
    # autoscaling replace model/mode, and the autoscaler runs every `scale_every`.
    manifest: dict | None = None
    scale_every: float = 5.0

    def __post_init__(self) -> None:
        if self.mode not in ("normal", "disaggregated"):
            raise ValueError(f"mode must be normal or disaggregated, got {self.mode!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.served_model_name is not None:
            check_served_name(self.served_model_name)  # '' would serve under the model's
        if not self.ready_timeout > 0:
            raise ValueError(f"--ready-timeout must be > 0 seconds, got {self.ready_timeout}")
        if self.api_key is not None and (
            not self.api_key
            or not self.api_key.isascii()
            or any(c == "," or not c.isprintable() or c.isspace() for c in self.api_key)
        ):
            # The gateway reads its keys as a comma-separated list; a client sends one
            # token after "Bearer ", in a header (ASCII).
            raise ValueError(
                "--api-key must be one key of printable ASCII without commas or spaces, "
                f"got {self.api_key!r}"
            )

    @property
    def name(self) -> str:
        if self.manifest is not None:
            spec = self.manifest.get("spec") or {}
            metadata = self.manifest.get("metadata") or {}
            return (spec.get("model") or {}).get("servedModelName") or metadata.get("name", "")
        return self.served_model_name or self.model


def read_manifest(path: Path) -> dict:
    """The ModelDeployment in `path`, checked as `tandem up` will run it (ValueError if not)."""
    import yaml

    from tandem import strict_yaml
    from tandem.operator.local_actuator import load_manifest

    try:
        documents = strict_yaml.load_all(path.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read -f {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"-f {path} is not UTF-8 text: {exc.reason} at byte {exc.start}") from None
    except yaml.YAMLError as exc:  # one line, not yaml's excerpt with a caret
        raise ValueError(f"-f {path} is not valid YAML: {strict_yaml.problem(exc)}") from None
    if len(documents) > 1:  # kubectl's files often hold several; -f runs one
        kinds = ", ".join(str(d.get("kind")) if isinstance(d, dict) else "?" for d in documents)
        raise ValueError(
            f"-f {path} holds {len(documents)} documents ({kinds}): tandem up runs one "
            "ModelDeployment; put it in a file of its own"
        )
    document = documents[0] if documents else None
    if not isinstance(document, dict):
        raise ValueError(
            f"-f {path} holds no ModelDeployment (a mapping with its kind, metadata, spec)"
        )
    try:
        load_manifest(document)
    except ValueError as exc:
        raise ValueError(f"-f {path}: {exc}") from None
    return document
