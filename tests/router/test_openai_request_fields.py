"""The OpenAI front's logits controls and structured output, parsed: each field reaches
the GenerateRequest and the SamplingParams with its value, and each bad value is a 400
whose ``param`` names the field (no server: the parsing layer, then the shared
validation, as http_api.py chains them)."""

from __future__ import annotations

import argparse
import json

import pytest

from pdserve.router.openai_errors import HTTPError
from pdserve.router.openai_request import (
    chat_fields,
    completion_fields,
    generate_request,
    http_error,
)
from pdserve.router.request_error import RequestError
from pdserve.router.validation import ModelLimits, prepare
from pdserve.scheduler.sampling_params import Guide

LIMITS = ModelLimits(vocab_size=100, max_model_len=64, max_tokens_limit=63)
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
MESSAGES = [{"role": "user", "content": "hi"}]


class ByteTokenizer:
    """One token per UTF-8 byte (ids 3..98)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [3 + b % 96 for b in text.encode("utf-8")]


def parse(endpoint: str, **fields):
    """(Common, the GenerateRequest of its first prompt) of a body with ``fields``."""
    if endpoint == "chat":
        c = chat_fields({"model": "m", "messages": MESSAGES, **fields})
        return c, generate_request([5, 6, 7], c)
    c, prompts = completion_fields({"model": "m", "prompt": "hi", **fields})
    return c, generate_request(prompts[0], c)


def sampling(endpoint: str = "completions", **fields):
    c, req = parse(endpoint, **fields)
    try:
        return prepare(req, ByteTokenizer(), LIMITS).sampling
    except RequestError as exc:
        raise http_error(exc, c) from None


def refused(endpoint: str = "completions", **fields) -> HTTPError:
    with pytest.raises(HTTPError) as err:
        sampling(endpoint, **fields)
    assert err.value.status == 400, err.value.message
    return err.value


ENDPOINTS = pytest.mark.parametrize("endpoint", ["completions", "chat"])


# --- the fields reach the request ----------------------------------------------------------


@ENDPOINTS
def test_every_control_reaches_the_request_and_the_sampling_params(endpoint):
    fields = {"presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.25,
              "logit_bias": {"7": 2.5, "5": -100}, "min_tokens": 3, "min_p": 0.25,
              "bad_words": ["ab", " c"], "max_tokens": 8}
    _, req = parse(endpoint, **fields)
    assert (req.presence_penalty, req.frequency_penalty, req.repetition_penalty) == (0.5, -1, 1.25)
    assert (req.min_tokens, req.min_p) == (3, 0.25)
    assert dict(req.logit_bias) == {7: 2.5, 5: -100.0}
    assert list(req.bad_words) == ["ab", " c"]
    assert not req.HasField("structured_output")
    s = sampling(endpoint, **fields)
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -1.0, 1.25)
    assert (s.min_tokens, s.min_p, s.max_tokens) == (3, 0.25, 8)
    assert s.logit_bias == ((5, -100.0), (7, 2.5))  # by token id
    # ByteTokenizer: "ab" -> (4, 5); " ab" is longer, so only the bare form (vLLM's rule)
    assert s.bad_words_token_ids == ((4, 5), (6,))
    assert s.guide is None and not s.ignore_eos


@ENDPOINTS
def test_unset_controls_stay_unset(endpoint):
    _, req = parse(endpoint)
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
                 "min_p", "structured_output"):
        assert not req.HasField(name)
    assert not req.logit_bias and not req.bad_words
    s = sampling(endpoint)
    assert not s.has_controls and s.min_p == 0.0


@ENDPOINTS
@pytest.mark.parametrize("fields, guide", [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, Guide("json_object")),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": SCHEMA, "strict": True}}}, Guide("json", json.dumps(SCHEMA))),
    ({"structured_outputs": {"json": SCHEMA}}, Guide("json", json.dumps(SCHEMA))),
    ({"structured_outputs": {"json": '{"type": "string"}'}},
     Guide("json", '{"type": "string"}')),
    ({"structured_outputs": {"regex": "[a-z]+", "grammar": None}}, Guide("regex", "[a-z]+")),
    ({"structured_outputs": {"grammar": 'root ::= "x"'}}, Guide("grammar", 'root ::= "x"')),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, Guide("choice", '["yes", "no"]')),
    ({"structured_outputs": {"json_object": True}}, Guide("json_object")),
    ({"guided_json": SCHEMA}, Guide("json", json.dumps(SCHEMA))),
    ({"guided_regex": "[0-9]{3}", "guided_decoding_backend": "xgrammar"},
     Guide("regex", "[0-9]{3}")),
    ({"guided_grammar": 'root ::= "a" | "b"', "guided_decoding_backend": "auto"},
     Guide("grammar", 'root ::= "a" | "b"')),
    ({"guided_choice": ["red", "green"]}, Guide("choice", '["red", "green"]')),
    ({"guided_decoding_backend": "xgrammar"}, None),
])
def test_structured_output_spellings_become_one_guide(endpoint, fields, guide):
    assert sampling(endpoint, **fields).guide == guide


# --- bad values are 400s naming the field ------------------------------------------------


@ENDPOINTS
@pytest.mark.parametrize("fields, param, words", [
    ({"presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
    ({"presence_penalty": "high"}, "presence_penalty", "number"),
    ({"frequency_penalty": -3}, "frequency_penalty", "[-2, 2]"),
    ({"frequency_penalty": True}, "frequency_penalty", "number"),
    ({"repetition_penalty": 0}, "repetition_penalty", "> 0"),
    ({"repetition_penalty": -1.0}, "repetition_penalty", "> 0"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty", "finite"),
    ({"min_p": 1.5}, "min_p", "[0, 1]"),
    ({"min_p": float("nan")}, "min_p", "finite"),
    ({"min_tokens": -1}, "min_tokens", "min_tokens"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens", "max_tokens"),
    ({"min_tokens": 1.5}, "min_tokens", "integer"),
    ({"min_tokens": 2**40}, "min_tokens", "out of range"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {"1.5": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {"99999999999": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"5": "x"}}, "logit_bias", "number"),
    ({"logit_bias": {"100": 1}}, "logit_bias", "vocabulary"),
    ({"logit_bias": {"-1": 1}}, "logit_bias", "vocabulary"),
    ({"logit_bias": [[5, 1]]}, "logit_bias", "object"),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", "1024"),
    ({"bad_words": "ab"}, "bad_words", "list"),
    ({"bad_words": ["ab", 3]}, "bad_words", "strings"),
    ({"bad_words": [""]}, "bad_words", "empty"),
    ({"bad_words": ["   "]}, "bad_words", "empty"),
    ({"bad_words": ["x" * 257]}, "bad_words", "256"),
    ({"bad_words": ["w"] * 33}, "bad_words", "32"),
    ({"bad_words": ["\ud800"]}, "bad_words", "Unicode"),
])
def test_bad_controls_are_400s_naming_the_field(endpoint, fields, param, words):
    err = refused(endpoint, **fields)
    assert err.param == param and param in err.message and words in err.message, err.message


@ENDPOINTS
@pytest.mark.parametrize("fields, param, words", [
    ({"response_format": {"type": "xml"}}, "response_format", "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
     "response_format", "schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA,
                                                                 "strict": "yes"}}},
     "response_format", "strict"),
    ({"response_format": "json"}, "response_format", "object"),
    # a schema that does not parse: the parser's reason, under the body's field name
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}},
     "response_format", "response_format.json_schema.schema: Unsupported type"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs",
     "structured_outputs.json: the JSON schema is not valid JSON"),
    ({"structured_outputs": {"regex": "a["}}, "structured_outputs",
     "structured_outputs.regex: Regex parsing error"),
    ({"structured_outputs": {"grammar": 'start ::= "a"'}}, "structured_outputs",
     "structured_outputs.grammar: "),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "structured_outputs.choice"),
    ({"structured_outputs": {"choice": ["a", ""]}}, "structured_outputs",
     "structured_outputs.choice"),
    ({"structured_outputs": {"choice": "a"}}, "structured_outputs", "list of strings"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs", "true"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "regex and choice"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs",
     "whitespace_pattern"),
    ({"guided_json": 5}, "guided_json", "JSON schema"),
    ({"guided_json": {"type": "foo"}}, "guided_json", "guided_json: Unsupported type"),
    ({"guided_regex": "(a"}, "guided_regex", "guided_regex: "),
    ({"guided_regex": "\ud800"}, "guided_regex", "Unicode"),
    ({"guided_grammar": ""}, "guided_grammar", "empty"),
    ({"guided_choice": []}, "guided_choice", "1..256"),
    ({"guided_choice": [1, 2]}, "guided_choice", "list of strings"),
    ({"guided_choice": ["x"] * 257}, "guided_choice", "1..256"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend",
     "xgrammar"),
    # two structured outputs at once: both named
    ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "guided_json",
     "response_format and guided_json"),
    ({"structured_outputs": {"regex": "a"}, "guided_regex": "b"}, "guided_regex",
     "structured_outputs and guided_regex"),
    ({"guided_choice": ["a"], "guided_grammar": 'root ::= "a"'}, "guided_choice",
     "guided_grammar and guided_choice"),
    # structured output and ignore_eos: the answer ends where its grammar does
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos",
     "response_format"),
    ({"guided_regex": "a+", "ignore_eos": True}, "ignore_eos", "guided_regex"),
])
def test_bad_structured_outputs_are_400s_naming_the_field(endpoint, fields, param, words):
    err = refused(endpoint, **fields)
    assert err.param == param and words in err.message, (err.param, err.message)


def test_the_legacy_function_fields_stay_refused():
    # tools and tool_choice are tests/router/test_openai_tools.py's
    for name, value in (("functions", [{"name": "f"}]), ("function_call", "auto")):
        with pytest.raises(HTTPError) as err:
            chat_fields({"model": "m", "messages": MESSAGES, name: value})
        assert err.value.param == name and "not supported" in err.value.message
    for name in ("suffix", "echo", "best_of"):
        with pytest.raises(HTTPError) as err:
            completion_fields({"model": "m", "prompt": "hi", name: "x"})
        assert err.value.param == name


def test_a_refusal_from_admission_keeps_its_own_param():
    import grpc

    c, _ = parse("completions", guided_regex="a")
    err = http_error(RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, "the router has 9 "
                                  "requests in flight"), c)
    assert err.status == 429 and err.message.startswith("the router has")
    assert err.param != "guided_regex"


# --- the gRPC client and `pdserve generate` ----------------------------------------------


def test_generate_cli_flags_reach_the_request(tmp_path):
    from pdserve.router.cli_commands import _add_generate_args, control_options
    from pdserve.router.client import build_request

    parser = argparse.ArgumentParser()
    _add_generate_args(parser)
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    args = parser.parse_args(["hi", "--presence-penalty", "0.5", "--frequency-penalty", "1",
                              "--repetition-penalty", "1.1", "--min-tokens", "2",
                              "--min-p", "0.5", "--json-schema", str(schema)])
    req = build_request(args.prompt, **control_options(args))
    assert (req.presence_penalty, req.frequency_penalty, req.min_tokens, req.min_p) == (
        0.5, 1.0, 2, 0.5)
    assert req.structured_output.json_schema == json.dumps(SCHEMA)
    assert not req.structured_output.loose  # strict unless asked
    loose = build_request("hi", **control_options(parser.parse_args(
        ["hi", "--json-schema", str(schema), "--loose-schema"])))
    assert loose.structured_output.loose
    choice = build_request("hi", **control_options(parser.parse_args(
        ["hi", "--choice", "yes", "--choice", "no"])))
    assert list(choice.structured_output.choice.choices) == ["yes", "no"]
    regex = build_request("hi", **control_options(parser.parse_args(["hi", "--regex", "a+"])))
    assert regex.structured_output.regex == "a+" and not regex.HasField("min_p")
    with pytest.raises(SystemExit):  # one structured output at most
        parser.parse_args(["hi", "--regex", "a", "--choice", "b"])
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="--json-schema"):
        control_options(parser.parse_args(["hi", "--json-schema", str(bad)]))
    with pytest.raises(ValueError, match="--grammar"):
        control_options(parser.parse_args(["hi", "--grammar", str(tmp_path / "missing")]))


def test_client_builds_structured_output_and_controls():
    from pdserve.router.client import build_request

    req = build_request("hi", logit_bias={5: -1.0}, bad_words=["x"], min_p=0.1,
                        structured_output={"json_schema": SCHEMA})
    assert dict(req.logit_bias) == {5: -1.0} and list(req.bad_words) == ["x"]
    assert req.structured_output.json_schema == json.dumps(SCHEMA)
    assert build_request("hi", structured_output={"json_object": True}
                         ).structured_output.json_object
    with pytest.raises(ValueError):
        build_request("hi", structured_output={"regex": "a", "grammar": "b"})
