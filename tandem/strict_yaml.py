"""YAML read as Kubernetes reads it: a key given twice in one mapping is an error.

PyYAML keeps the last of a repeated key without a word; kubectl refuses the
document ("mapping key ... already defined"). A manifest that `tandem up -f`
or the simulator accepts must mean the same in a cluster, and a setting typed
twice is almost always a mistake in one of the two.
"""

from __future__ import annotations

from typing import Any

import yaml

_MERGE_TAG = "tag:yaml.org,2002:merge"


class _StrictLoader(yaml.SafeLoader):
    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        # Checked before the merge keys (`<<: *base`) are flattened in: a key that
        # overrides a merged one is what merging is for.
        seen: dict[Any, yaml.Mark] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG:
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node.start_mark)
            except TypeError:
                continue  # an unhashable key: the base constructor says why
            if first is not key_node.start_mark:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"key {key!r} is given twice (first at line {first.line + 1})",
                    key_node.start_mark,
                )
        return super().construct_mapping(node, deep=deep)


def load(text: str) -> Any:
    """The one document in `text`; yaml.YAMLError (a MarkedYAMLError naming the line
    for a repeated key) if it is not valid."""
    return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader: builds no objects


def load_all(text: str) -> list[Any]:
    """Every document in `text` (empty ones left out: a leading or trailing ---), each
    read as `load` reads one."""
    return [d for d in yaml.load_all(text, Loader=_StrictLoader) if d is not None]


def problem(exc: yaml.YAMLError) -> str:
    """What is wrong, and where, in one line: not PyYAML's text, whose excerpt quotes the
    offending line (in a keys file, an API key in plain text)."""
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        return f"{exc.problem}{where}"
    return type(exc).__name__  # unmarked: PyYAML's own words may hold anything
