"""Where a ModelDeployment's weights come from: a path, a PersistentVolumeClaim or the Hub.

Parts of the spec (spec.py's ModelDeploymentSpec.model); manifests_pods.py
mounts or downloads what they name.
"""

from __future__ import annotations

from pydantic import Field

from tandem.operator.spec_base import CelRule, SecretName, SpecModel, count_set


class PvcSource(SpecModel):
    """Weights on a PersistentVolumeClaim, mounted at /models in the engine pods."""

    cel_rules = (
        CelRule(
            rule="!has(self.subPath) || "
            "(!self.subPath.startsWith('/') && !self.subPath.matches('(^|/)[.][.](/|$)'))",
            message="pvc.subPath must be a relative path inside the claim, without '..'",
            holds=lambda p: (
                p.sub_path is None
                or (not p.sub_path.startswith("/") and ".." not in p.sub_path.split("/"))
            ),
            field_path=".subPath",
        ),
    )

    claim_name: str = Field(min_length=1, max_length=253, description="The claim's name.")
    sub_path: str | None = Field(
        None,
        min_length=1,
        max_length=1024,
        description="The model's directory (or .gguf file) inside the claim; "
        "default: the claim's root.",
    )
    read_only: bool = Field(True, description="Mount the claim read-only.")


class HuggingFaceSource(SpecModel):
    """A Hugging Face Hub repository, downloaded by an init container into the pod.

    The engine then loads the local copy: it never downloads at run time.
    Every new pod downloads again; for large models a pvc starts pods faster.
    """

    id: str = Field(
        min_length=1,
        max_length=256,
        pattern=r"^[A-Za-z0-9][-A-Za-z0-9_.]*(/[A-Za-z0-9][-A-Za-z0-9_.]*)?$",
        description="Repository id, e.g. HuggingFaceTB/SmolLM2-135M-Instruct.",
    )
    revision: str = Field(
        "main",
        min_length=1,
        max_length=256,
        description="Branch, tag or commit; pin a commit for reproducible pods.",
    )
    token_secret_name: SecretName | None = Field(
        None,
        description="A Secret whose key `token` holds a Hub token (gated or private models).",
    )


class ModelSpec(SpecModel):
    """Where the weights come from (exactly one source) and the name clients ask for."""

    cel_rules = (
        CelRule(
            rule="(has(self.path) ? 1 : 0) + (has(self.pvc) ? 1 : 0)"
            " + (has(self.huggingFace) ? 1 : 0) == 1",
            message="spec.model needs exactly one source: path, pvc or huggingFace",
            holds=lambda m: count_set(m.path, m.pvc, m.hugging_face) == 1,
        ),
    )

    path: str | None = Field(
        None,
        min_length=1,
        max_length=4096,
        description="A Hugging Face directory or .gguf file inside the image or a volume "
        "(or an engine built-in such as smollm2), passed to `--model` as is.",
    )
    pvc: PvcSource | None = Field(None, description="Weights on a PersistentVolumeClaim.")
    hugging_face: HuggingFaceSource | None = Field(
        None, description="Weights fetched from the Hugging Face Hub before the engine starts."
    )
    served_model_name: str | None = Field(
        None,
        min_length=1,
        max_length=253,
        # RE2's \s spelled out: the API server's \s is ASCII, pydantic's Unicode (a
        # name with a no-break space passed one and failed the other).
        pattern=r"^[^{} \t\n\f\r]+$",
        description="The model name clients ask for (`--served-model-name`); "
        "default: metadata.name.",
    )
