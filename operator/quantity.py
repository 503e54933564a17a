"""Kubernetes quantities ("4Gi", "500m", 8) in the spec: kept as written, checked on the way in.

The schema is the one controller-gen emits for resource.Quantity, so the API
server and the operator accept the same strings.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Annotated

from pydantic import AfterValidator, StrictInt, StrictStr, WithJsonSchema

# resource.Quantity's pattern, as controller-gen writes it into CRDs.
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)

QUANTITY_SCHEMA = {
    "anyOf": [{"type": "integer"}, {"type": "string"}],
    "pattern": QUANTITY_PATTERN,
    "x-kubernetes-int-or-string": True,
}


# Parsed here rather than with kubernetes.utils, whose import pulls in the whole
# API client (half a second) for what is one regular expression.
_QUANTITY = re.compile(
    r"(?P<number>[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))"
    r"(?P<suffix>[KMGTPE]i|[numkMGTPE]|[eE][+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))?"
)
_SUFFIXES = {
    **{s: Decimal(1024) ** (i + 1) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
    **{
        s: Decimal(10) ** e
        for s, e in zip("numkMGTPE", (-9, -6, -3, 3, 6, 9, 12, 15, 18), strict=True)
    },
    None: Decimal(1),
}


def quantity_value(value: int | str) -> Decimal:
    """The quantity as a number ("4Gi" -> 4294967296); ValueError naming the value otherwise."""
    if isinstance(value, int) and not isinstance(value, bool):
        return Decimal(value)
    match = _QUANTITY.fullmatch(value) if isinstance(value, str) else None
    if match is None:
        raise ValueError(f"{value!r} is not a Kubernetes quantity (e.g. 8, '500m', '4Gi', '16G')")
    suffix = match["suffix"]
    try:
        if suffix not in _SUFFIXES:  # a decimal exponent, e.g. 1e3
            return Decimal(match["number"] + suffix)
        return Decimal(match["number"]) * _SUFFIXES[suffix]
    except InvalidOperation:
        raise ValueError(f"{value!r} is not a Kubernetes quantity") from None


def _check_quantity(value: int | str) -> int | str:
    quantity_value(value)
    return value


def quantity_bytes(value: int | str) -> int:
    """A quantity of bytes as an int; ValueError for fractions or negatives."""
    number = quantity_value(value)
    if number != number.to_integral_value() or number < 1:
        raise ValueError(f"{value!r} is not a positive whole number of bytes")
    return int(number)


def _check_bytes(value: int | str) -> int | str:
    quantity_bytes(value)
    return value


# A quantity kept as the user wrote it (int or string), so a round trip changes nothing.
Quantity = Annotated[
    StrictInt | StrictStr, AfterValidator(_check_quantity), WithJsonSchema(QUANTITY_SCHEMA)
]
# A quantity of bytes: a positive whole number once the suffix is applied.
ByteQuantity = Annotated[
    StrictInt | StrictStr, AfterValidator(_check_bytes), WithJsonSchema(QUANTITY_SCHEMA)
]
