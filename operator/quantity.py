"""Kubernetes quantities ("4Gi", "500m", 8) in the spec: kept as written, checked on the way in.

The schema is the one controller-gen emits for resource.Quantity, so the API
server and the operator accept the same strings.
"""

from __future__ import annotations

import re
from decimal import Decimal
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


# Kubernetes keeps a quantity in an int64 of its base unit; past that, turning
# "1e1000000" into an int would hold the operator's event loop for minutes.
_LARGEST = Decimal(2**63 - 1)


def quantity_value(value: int | str) -> Decimal:
    """The quantity as a number ("4Gi" -> 4294967296); ValueError naming the value otherwise."""
    if isinstance(value, int) and not isinstance(value, bool):
        number = Decimal(value)
    else:
        match = _QUANTITY.fullmatch(value) if isinstance(value, str) else None
        if match is None:
            raise ValueError(
                f"{_shown(value)} is not a Kubernetes quantity (e.g. 8, '500m', '4Gi', '16G')"
            )
        suffix = match["suffix"]
        try:
            # Built from the string, so the exponent is never expanded into digits.
            if suffix not in _SUFFIXES:  # a decimal exponent, e.g. 1e3
                number = Decimal(match["number"] + suffix)
            else:
                number = Decimal(match["number"]) * _SUFFIXES[suffix]
        except ArithmeticError:  # InvalidOperation, Overflow
            raise ValueError(f"{_shown(value)} is not a Kubernetes quantity") from None
    if number.copy_abs() > _LARGEST:  # copy_abs: no context, so no overflow
        raise ValueError(
            f"{_shown(value)} is out of a Kubernetes quantity's range (2^63 - 1 at most)"
        )
    return number


def _shown(value: object) -> str:
    """The value for a message: a runaway string cut short (a reason is one line)."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:30]}... ({len(text) - 2} characters)"


def _check_quantity(value: int | str) -> int | str:
    quantity_value(value)
    return value


def quantity_bytes(value: int | str) -> int:
    """A quantity of bytes as an int; ValueError for fractions or negatives."""
    number = quantity_value(value)
    if number != number.to_integral_value() or number < 1:
        raise ValueError(f"{_shown(value)} is not a positive whole number of bytes")
    return int(number)


# The least KV cache an engine is given: "1" (one byte) is a typo for 1Gi, and
# less than a MiB holds too few tokens of any real model to serve a request.
MIN_KV_CACHE_BYTES = 1 << 20


def _check_kv_bytes(value: int | str) -> int | str:
    size = quantity_bytes(value)
    if size < MIN_KV_CACHE_BYTES:
        raise ValueError(f"{_shown(value)} is too little KV cache ({size} bytes): at least 1Mi")
    return value


# A quantity kept as the user wrote it (int or string), so a round trip changes nothing.
Quantity = Annotated[
    StrictInt | StrictStr, AfterValidator(_check_quantity), WithJsonSchema(QUANTITY_SCHEMA)
]
# The KV cache's bytes: a whole number of at least MIN_KV_CACHE_BYTES.
KvCacheBytes = Annotated[
    StrictInt | StrictStr, AfterValidator(_check_kv_bytes), WithJsonSchema(QUANTITY_SCHEMA)
]
