"""The keywords of a JSON schema the grammar engine does not enforce.

pdserve holds a JSON answer to its schema with xgrammar (0.2.9, as
``engine/guided/grammar`` compiles schemas). xgrammar enforces most of JSON Schema and
ignores some keywords silently; an answer may then break the schema the client asked
for. ``unenforced`` lists each such keyword with its JSON path, so that a strict request
is refused naming it and a non-strict one is answered with a warning
(``docs/structured-output.md`` has the table). Each entry below was checked against
xgrammar by a schema and an instance that breaks the keyword
(``tests/router/test_schema_audit.py``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# ignored by xgrammar whenever they are present
IGNORED = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas",
           "dependencies", "contains", "minContains", "maxContains", "oneOf")
# the string formats xgrammar enforces; any other ``format`` is ignored
FORMATS = frozenset({"email", "date", "date-time", "time", "duration", "uuid", "uri",
                     "uri-reference", "uri-template", "ipv4", "ipv6", "hostname",
                     "json-pointer", "relative-json-pointer"})
# a lookahead in a ``pattern`` (not after a backslash): xgrammar drops it silently
LOOKAHEAD = re.compile(r"(?<!\\)\(\?[=!]")
# keywords whose value is a subschema, a list of them, or a map of names to them
ONE = ("additionalProperties", "items", "not", "if", "then", "else", "contains",
       "propertyNames", "unevaluatedProperties", "unevaluatedItems", "additionalItems")
MANY = ("anyOf", "oneOf", "allOf", "prefixItems")
NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


@dataclass(frozen=True)
class Finding:
    keyword: str
    path: str  # where the keyword sits, JSONPath-like: $.properties.person

    def __str__(self) -> str:
        return f"{self.keyword} at {self.path}"


def unenforced(schema: Any, path: str = "$") -> list[Finding]:
    """Every keyword of ``schema`` (and its subschemas) that the grammar may let an
    answer break, in document order."""
    return list(_walk(schema, path))


def _walk(schema: Any, path: str) -> Iterator[Finding]:
    if not isinstance(schema, dict):
        return
    for keyword in schema:
        if _ignored(schema, keyword):
            yield Finding(_named(schema, keyword), path)
    for sub, at in _subschemas(schema, path):
        yield from _walk(sub, at)


def _subschemas(schema: dict, path: str) -> Iterator[tuple[Any, str]]:
    for keyword in ONE:
        if isinstance(schema.get(keyword), dict):
            yield schema[keyword], f"{path}.{keyword}"
    for keyword in (*MANY, "items"):  # a list of items: draft 4-7 tuples
        if isinstance(schema.get(keyword), list):
            for i, sub in enumerate(schema[keyword]):
                yield sub, f"{path}.{keyword}[{i}]"
    for keyword in NAMED:
        if isinstance(schema.get(keyword), dict):
            for name, sub in schema[keyword].items():
                yield sub, f"{path}.{keyword}.{_key(name)}"


def _ignored(schema: dict, keyword: str) -> bool:
    value = schema[keyword]
    if keyword in IGNORED:
        return True
    if keyword == "uniqueItems":
        return value is True
    if keyword == "allOf":  # one subschema is applied; more are not intersected
        return isinstance(value, list) and len(value) > 1
    if keyword == "format":
        return value not in FORMATS
    if keyword == "pattern":
        return isinstance(value, str) and LOOKAHEAD.search(value) is not None
    if keyword == "multipleOf":  # enforced for integers only
        types = schema.get("type")
        types = types if isinstance(types, list) else [types]
        return not (isinstance(value, int) and "integer" in types and "number" not in types)
    return False


def _named(schema: dict, keyword: str) -> str:
    if keyword == "pattern":
        return "pattern lookahead"
    return f"format \"{schema[keyword]}\"" if keyword == "format" else keyword


def _key(name: str) -> str:
    """A property name as a path step: bare when it is a plain word, else quoted."""
    return name if name.isidentifier() else repr(name)
