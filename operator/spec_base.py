"""SpecModel: the pydantic base of every part of a ModelDeployment, and its cross-field rules.

A cross-field rule is written once, as a CelRule: the CEL expression the CRD
carries (the API server rejects at `kubectl apply`), the message both sides
give, and the same check in Python (the operator's re-check in validation.py).
The CRD generator reads each class's rules from its JSON schema; the pydantic
validator below runs the Python twins. tests/operator/test_crd.py makes both
agree on a table of specs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Self

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from tandem.operator.settings import SECRET_NAME_PATTERN, SECRET_NAME_RULE, is_secret_name

# The schema key the API server reads CEL rules from.
CEL_KEY = "x-kubernetes-validations"


@dataclass(frozen=True)
class CelRule:
    """One rule: CEL for the API server, `holds` for the operator, one message for both.

    `rule` sees `self` as the object the rule is attached to, after the API
    server applied the schema's defaults; `holds` gets the validated pydantic
    model, whose defaults are the same ones.
    """

    rule: str
    message: str
    holds: Callable[[Any], bool]
    # The field the API server names in its error (apiextensions fieldPath).
    field_path: str | None = None

    def to_schema(self) -> dict[str, str]:
        entry = {"rule": self.rule, "message": self.message}
        if self.field_path is not None:
            entry["fieldPath"] = self.field_path
        return entry


def _add_cel_rules(schema: dict[str, Any], cls: type[BaseModel]) -> None:
    rules: tuple[CelRule, ...] = getattr(cls, "cel_rules", ())
    if rules:
        schema[CEL_KEY] = [rule.to_schema() for rule in rules]


class SpecModel(BaseModel):
    """Camel-case aliases (the Kubernetes style), unknown fields refused, immutable.

    Strict types, as the API server's schema: "3" or true is no integer. Enum
    fields opt out (strict=False on the field) to accept their string values.
    """

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        strict=True,
        json_schema_extra=_add_cel_rules,
    )

    cel_rules: ClassVar[tuple[CelRule, ...]] = ()

    @model_validator(mode="after")
    def _check_cel_rules(self) -> Self:
        for rule in self.cel_rules:
            if not rule.holds(self):
                raise ValueError(rule.message)
        return self

    def to_dict(self) -> dict[str, Any]:
        """The object as the Kubernetes API stores it: camelCase, unset fields left out."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


def count_set(*values: object) -> int:
    """How many of the values are set (not None): for exactly-one-of rules."""
    return sum(value is not None for value in values)


def _check_secret_name(name: str) -> str:
    # Its own message: pydantic's would quote the pattern, which explains nothing.
    if not is_secret_name(name):
        raise ValueError(f"{name!r} is not a Secret name: {SECRET_NAME_RULE}")
    return name


# A Secret's name, checked as the API server checks it (settings.SECRET_NAME_RULE).
SecretName = Annotated[
    str,
    Field(min_length=1, max_length=253, json_schema_extra={"pattern": SECRET_NAME_PATTERN}),
    AfterValidator(_check_secret_name),  # after the lengths: their messages are clearer
]
