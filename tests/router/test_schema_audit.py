"""The keywords the grammar engine does not enforce, each checked against xgrammar itself
(compiled as the ranks compile schemas): every keyword ``unenforced`` names lets an answer
that breaks it through, every keyword it leaves alone stops one. A newer xgrammar that
enforces more (or less) fails here and the table in docs/structured-output.md is redone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.router.schema_audit import Finding, unenforced

xgr = pytest.importorskip("xgrammar")
from xgrammar.testing import _is_grammar_accept_string  # noqa: E402

OBJ = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
INTS = {"type": "array", "items": {"type": "integer"}}
# keyword -> (schema, an answer that breaks that keyword)
IGNORED = {
    "uniqueItems": ({**INTS, "uniqueItems": True}, "[1, 1]"),
    "not": ({"type": "integer", "not": {"const": 1}}, "1"),
    "if": ({**OBJ, "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}},
           '{"a": 1}'),
    "dependentRequired": ({**OBJ, "dependentRequired": {"a": ["b"]}}, '{"a": 1}'),
    "dependentSchemas": ({**OBJ, "dependentSchemas": {"a": {"required": ["b"]}}}, '{"a": 1}'),
    "dependencies": ({**OBJ, "dependencies": {"a": ["b"]}}, '{"a": 1}'),
    "contains": ({**INTS, "contains": {"const": 5}}, "[1]"),
    "maxContains": ({**INTS, "contains": {"const": 5}, "maxContains": 1}, "[5, 5]"),
    "oneOf": ({"oneOf": [{"type": "integer", "minimum": 0},
                         {"type": "integer", "maximum": 10}]}, "5"),
    "allOf": ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "2"),
    'format "iri"': ({"type": "string", "format": "iri"}, '"!! zz"'),
    'format "regex"': ({"type": "string", "format": "regex"}, '"(("'),
    "multipleOf": ({"type": "number", "multipleOf": 0.5}, "0.3"),
    "pattern lookahead": ({"type": "string", "pattern": "(?!x)[a-z]"}, '"x"'),
}
ENFORCED = {
    "uniqueItems false": ({**INTS, "uniqueItems": False}, "[1.5]"),
    "format email": ({"type": "string", "format": "email"}, '"no at sign"'),
    "format date": ({"type": "string", "format": "date"}, '"yesterday"'),
    "multipleOf integer": ({"type": "integer", "multipleOf": 3}, "4"),
    "allOf of one": ({"allOf": [{"type": "integer", "minimum": 3}]}, "2"),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, '"s"'),
    "pattern": ({"type": "string", "pattern": "^[0-9]{2}$"}, '"abc"'),
    "pattern with an escaped paren": ({"type": "string", "pattern": "^a\\(?=b$"}, '"a(=c"'),
    "minimum": ({"type": "integer", "minimum": 3}, "2"),
    "maxLength": ({"type": "string", "maxLength": 3}, '"abcd"'),
    "additionalProperties": ({**OBJ, "additionalProperties": False}, '{"c": 1}'),
    "propertyNames": ({"type": "object", "propertyNames": {"pattern": "^x"},
                       "additionalProperties": True}, '{"y": 1}'),
    "$ref": ({"$defs": {"i": {"type": "integer"}}, "$ref": "#/$defs/i"}, '"s"'),
}


def _accepts(schema: dict, answer: str) -> bool:
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    return _is_grammar_accept_string(grammar, answer)


@pytest.mark.parametrize("keyword", sorted(IGNORED))
def test_each_named_keyword_lets_a_breaking_answer_through(keyword):
    schema, answer = IGNORED[keyword]
    assert keyword in [f.keyword for f in unenforced(schema)]
    assert _accepts(schema, answer), f"xgrammar now enforces {keyword}: move it to ENFORCED"


@pytest.mark.parametrize("case", sorted(ENFORCED))
def test_each_enforced_keyword_stops_a_breaking_answer(case):
    schema, answer = ENFORCED[case]
    assert unenforced(schema) == []
    assert not _accepts(schema, answer)


def test_the_issues_schema_names_unique_items_at_its_path():
    schema = json.loads((Path(__file__).parent.parent / "data" / "unique_langs_schema.json")
                        .read_text())
    assert unenforced(schema) == [Finding("uniqueItems", "$.properties.person.properties.langs")]
    assert str(unenforced(schema)[0]) == "uniqueItems at $.properties.person.properties.langs"


def test_paths_through_every_kind_of_subschema():
    u = {"uniqueItems": True}
    schema = {"anyOf": [{}, u], "items": [u], "prefixItems": [{}, u], "$defs": {"x y": u},
              "additionalProperties": {"not": {}}, "patternProperties": {"^a": u}}
    assert [str(f) for f in unenforced(schema)] == [
        "not at $.additionalProperties", "uniqueItems at $.anyOf[1]",
        "uniqueItems at $.prefixItems[1]", "uniqueItems at $.items[0]",
        "uniqueItems at $.patternProperties.'^a'", "uniqueItems at $.$defs.'x y'"]
    assert unenforced(True) == [] and unenforced({"type": "string"}) == []
