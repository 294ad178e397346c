"""Structured output in an OpenAI body, into a ``StructuredOutput`` message.

Three spellings, at most one per request (vLLM's semantics):

- OpenAI's ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``
  (the answer is held to the schema, ``strict`` or not; a keyword the grammar cannot
  enforce, ``router/schema_audit.py``, is refused under ``strict: true`` and only
  advises without it: ``advisories`` names them for the response's header);
- vLLM's ``structured_outputs``: an object with exactly one of ``json`` (a schema, or
  its JSON text), ``regex``, ``grammar``, ``choice`` (a list of strings) or
  ``json_object`` (true);
- vLLM's older top-level ``guided_json``, ``guided_regex``, ``guided_grammar`` and
  ``guided_choice``; ``guided_decoding_backend`` is accepted when it names xgrammar or
  ``auto`` (pdserve's one backend) and refused otherwise.

Only the shapes are checked here: the shared validation parses the message
(``sampling_fields.guide_of``) and its errors name the body's field this returns.
"""

from __future__ import annotations

import json
from typing import Any

from pdserve.router.openai_errors import HTTPError, body_field
from pdserve.router.schema_audit import unenforced
from pdserve.rpc import router_pb2

# vLLM's older top-level fields -> the structured_outputs key they stand for
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_grammar": "grammar",
          "guided_choice": "choice"}
KEYS = ("json", "regex", "grammar", "choice", "json_object")  # structured_outputs'
BACKENDS = ("xgrammar", "auto")
RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def structured_output(body: dict) -> tuple[router_pb2.StructuredOutput | None, str]:
    """The body's structured output and the field it came from (``None, ""``: none).
    Two of them at once is a 400 naming both."""
    backend = body_field(body, "guided_decoding_backend", (str,))
    if backend is not None and backend not in BACKENDS:
        raise HTTPError(400, f"guided_decoding_backend must be one of {', '.join(BACKENDS)} "
                        f"(pdserve's structured output is xgrammar's), got {backend!r}"[:300],
                        "guided_decoding_backend")
    found = [f for f in (_response_format(body), _structured_outputs(body),
                         *(_guided(body, name) for name in GUIDED)) if f is not None]
    if len(found) > 1:
        names = [field.split(".", 1)[0] for _, field in found]
        raise HTTPError(400, f"give one structured output at most, got {' and '.join(names)}",
                        names[1])
    return found[0] if found else (None, "")


def _response_format(body: dict) -> tuple[router_pb2.StructuredOutput, str] | None:
    rf = body_field(body, "response_format", (dict,))
    if rf is None:
        return None
    kind = rf.get("type")
    if kind not in RESPONSE_FORMATS:
        raise HTTPError(400, f"response_format.type must be one of {', '.join(RESPONSE_FORMATS)}"
                        f", got {json.dumps(kind)[:80]}", "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return router_pb2.StructuredOutput(json_object=True), "response_format"
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise HTTPError(400, "response_format.json_schema must be an object (name, schema, "
                        "strict)", "response_format")
    for key, kind in (("name", str), ("description", str), ("strict", bool)):
        if spec.get(key) is not None and not isinstance(spec[key], kind):
            raise HTTPError(400, f"response_format.json_schema.{key} must be "
                            f"{'a boolean' if kind is bool else 'a string'}", "response_format")
    if not isinstance(spec.get("schema"), dict):
        raise HTTPError(400, "response_format.json_schema.schema must be a JSON schema (an "
                        "object)", "response_format")
    field = "response_format.json_schema.schema"
    so = message("json", spec["schema"], field)
    # OpenAI's default is strict: false: keywords the grammar cannot enforce only advise
    so.loose = spec.get("strict") is not True
    return so, field


def _structured_outputs(body: dict) -> tuple[router_pb2.StructuredOutput, str] | None:
    so = body_field(body, "structured_outputs", (dict,))
    if so is None:
        return None
    for key, value in so.items():
        if key not in KEYS and value is not None:
            raise HTTPError(400, f"structured_outputs.{key} is not supported by pdserve "
                            f"(give one of {', '.join(KEYS)})"[:300], "structured_outputs")
    given = [key for key in KEYS if so.get(key) is not None]
    if len(given) != 1:
        raise HTTPError(400, f"structured_outputs must set exactly one of {', '.join(KEYS)}, "
                        f"got {' and '.join(given) or 'none'}", "structured_outputs")
    field = f"structured_outputs.{given[0]}"
    return message(given[0], so[given[0]], field), field


def _guided(body: dict, name: str) -> tuple[router_pb2.StructuredOutput, str] | None:
    if body.get(name) is None:
        return None
    return message(GUIDED[name], body[name], name), name


def advisories(so: router_pb2.StructuredOutput | None) -> list[str]:
    """What a loose JSON schema asks that the grammar does not enforce ("uniqueItems at
    $.properties.langs"): the response says so (``ADVISORY_HEADER``)."""
    if so is None or not so.loose or so.WhichOneof("kind") != "json_schema":
        return []
    try:
        return [str(f) for f in unenforced(json.loads(so.json_schema))]
    except ValueError:  # refused by the shared validation before any answer
        return []


ADVISORY_HEADER = "X-PDServe-Schema-Advisory"


def message(kind: str, value: Any, field: str) -> router_pb2.StructuredOutput:
    """The StructuredOutput of one spelling: ``kind`` is a structured_outputs key."""
    param = field.split(".", 1)[0]
    if kind == "json_object":
        if value is not True:
            raise HTTPError(400, f"{field} must be true", param)
        return router_pb2.StructuredOutput(json_object=True)
    if kind == "json" and isinstance(value, dict):
        value = json.dumps(value)
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise HTTPError(400, f"{field} must be a list of strings", param)
    elif not isinstance(value, str):
        what = "a JSON schema (an object, or its JSON text)" if kind == "json" else "a string"
        raise HTTPError(400, f"{field} must be {what}", param)
    try:
        if kind == "choice":
            return router_pb2.StructuredOutput(choice=router_pb2.ChoiceList(choices=value))
        name = "json_schema" if kind == "json" else kind
        return router_pb2.StructuredOutput(**{name: value})
    except ValueError as exc:  # a string protobuf cannot hold (a lone surrogate)
        raise HTTPError(400, f"{field} must be valid Unicode text: {exc}", param) from None
