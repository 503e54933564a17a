"""Manifests and key files read as kubectl reads YAML: a repeated key is an error."""

import pytest
import yaml

from tandem import strict_yaml


def test_a_repeated_key_is_an_error_naming_both_lines():
    with pytest.raises(yaml.MarkedYAMLError) as failed:
        strict_yaml.load("spec:\n  engine:\n    maxNumSeqs: 8\n    maxNumSeqs: 64\n")
    assert failed.value.problem == "key 'maxNumSeqs' is given twice (first at line 3)"
    assert failed.value.problem_mark.line + 1 == 4


def test_the_same_key_in_different_mappings_and_merge_overrides_are_fine():
    text = (
        "base: &base {blockSize: 16, maxNumSeqs: 8}\n"
        "a: {<<: *base, maxNumSeqs: 64}\n"  # an override is what a merge key is for
        "b: {maxNumSeqs: 8}\n"
    )
    loaded = strict_yaml.load(text)
    assert loaded["a"] == {"blockSize": 16, "maxNumSeqs": 64}
    assert loaded["b"] == {"maxNumSeqs": 8}


def test_it_builds_no_python_objects():
    with pytest.raises(yaml.constructor.ConstructorError):
        strict_yaml.load("!!python/object/apply:os.getcwd []")
