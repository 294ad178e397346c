"""OpenAI tool calls, no server: ``tools`` and ``tool_choice`` checked (each refusal a
400 naming its field), the schema of a forced call (held against ``jsonschema``), the
prompt (a template's own tools, or the Hermes fallback), the calls parsed out of an
answer, whole and streamed."""

from __future__ import annotations

import json

import pytest

from pdserve.router.chat_template import ChatTemplate
from pdserve.router.openai_errors import HTTPError
from pdserve.router.openai_request import chat_fields, generate_request, http_error
from pdserve.router.openai_response import Collected, _tool_events, chat_body
from pdserve.router.openai_tools import (
    MAX_TOOLS,
    ToolPlan,
    ToolStream,
    call_schema,
    chat_inputs,
    fallback_system_text,
    parse_tool_calls,
)
from pdserve.router.request_error import RequestError
from pdserve.router.request_stream import Chunk
from pdserve.router.validation import ModelLimits, prepare

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string"},
                                  "unit": {"$ref": "#/$defs/unit"}},
                   "required": ["city", "unit"],
                   "$defs": {"unit": {"enum": ["C", "F"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get-time", "parameters": {"type": "object",
                                       "properties": {"zone": {"$ref": "#/$defs/unit"}},
                                       "required": ["zone"],
                                       "$defs": {"unit": {"enum": ["UTC", "CET"]}}}}}
NOARGS = {"type": "function", "function": {"name": "ping"}}
TOOLS = [WEATHER, TIME, NOARGS]
# a plain ChatML template, without tools (as SmolLM2's)
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# a template that renders tools and calls itself
NATIVE = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n"
          "{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}"
          "{% for c in m.tool_calls or [] %}[{{ c.function.name }} "
          "{{ c.function.arguments | tojson }}]{% endfor %}"
          "{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %}\n{% endfor %}")
LIMITS = ModelLimits(vocab_size=100, max_model_len=64, max_tokens_limit=63)


def body(**fields) -> dict:
    return {"model": "m", "messages": MESSAGES, **fields}


def refused(**fields) -> HTTPError:
    with pytest.raises(HTTPError) as err:
        chat_fields(body(**fields))
    assert err.value.status == 400
    return err.value


def plan(choice: str = "auto", tools=TOOLS, named: str | None = None) -> ToolPlan:
    return ToolPlan(tuple(tools), choice, named)


# --- the request ---------------------------------------------------------------------------

@pytest.mark.parametrize("fields, param, words", [
    ({"tools": {"type": "function"}}, "tools", "tools must be a list"),
    ({"tools": [NOARGS] * (MAX_TOOLS + 1)}, "tools", f"at most {MAX_TOOLS} tools"),
    ({"tools": ["f"]}, "tools", "tools[0] must be an object"),
    ({"tools": [{"type": "custom", "function": {"name": "f"}}]}, "tools", "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools", "tools[0].function must be an object"),
    ({"tools": [NOARGS, {"type": "function", "function": {"name": "a b"}}]}, "tools",
     "tools[1].function.name must match"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools",
     "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools", "tools[0].function.name"),
    ({"tools": [NOARGS, NOARGS]}, "tools", "'ping' is given twice"),
    ({"tools": [{**NOARGS, "extra": 1}]}, "tools", "tools[0].extra is not supported"),
    ({"tools": [{"type": "function", "function": {"name": "f", "returns": {}}}]}, "tools",
     "tools[0].function.returns is not supported"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": 3}}]},
     "tools", "tools[0].function.description must be a string"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]},
     "tools", "tools[0].function.strict must be a boolean"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
     "tools", "tools[0].function.parameters must be a JSON schema"),
    ({"tools": [{"type": "function", "function": {"name": "f",
                                                  "parameters": {"type": "string"}}}]},
     "tools", 'of type "object"'),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": json.loads('{"a":' * 30 + "1" + "}" * 30)}}}]},
     "tools", "nested more than"),
    ({"tools": [{"type": "function", "function": {"name": "f",
                                                  "description": "d" * 70_000}}]},
     "tools", "characters of JSON"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "tool_choice must be one of"),
    ({"tools": TOOLS, "tool_choice": 3}, "tool_choice", "a string or an object"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "'nope', which is not among tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice", "to name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "ping"}}, "tool_choice",
     "to name"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "ping"}}}, "tool_choice",
     "not among tools"),
    # a forced call and another constraint
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "cannot be combined with response_format"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice",
     "guided_regex"),
    ({"tools": TOOLS, "tool_choice": "required", "ignore_eos": True}, "ignore_eos",
     "forces a call"),
    # the legacy names stay refused, saying what to use
    ({"functions": [{"name": "f"}]}, "functions", "use tools"),
    ({"function_call": "auto"}, "function_call", "use tool_choice"),
])
def test_bad_tool_fields_are_400s_naming_the_field(fields, param, words):
    err = refused(**fields)
    assert err.param == param and words in err.message, (err.param, err.message)


def test_tool_choice_defaults_and_plans():
    assert chat_fields(body()).tools is None
    assert chat_fields(body(tool_choice="none")).tools is None
    assert chat_fields(body(tool_choice="auto", tools=[])).tools is None
    c = chat_fields(body(tools=TOOLS))
    assert c.tools.choice == "auto" and c.tools.parses and not c.tools.guided
    assert c.structured_output is None
    c = chat_fields(body(tools=TOOLS, tool_choice="none"))
    assert not c.tools.parses and c.structured_output is None
    # auto leaves another structured output alone
    c = chat_fields(body(tools=TOOLS, response_format={"type": "json_object"}))
    assert c.structured_output.json_object and c.structured_field == "response_format"
    c = chat_fields(body(tools=TOOLS, tool_choice={"type": "function",
                                                   "function": {"name": "get-time"}}))
    assert (c.tools.choice, c.tools.named, c.structured_field) == ("named", "get-time", "tools")
    assert json.loads(c.structured_output.json_schema) == call_schema(c.tools)


def test_a_forced_call_is_a_json_schema_guide_that_parses():
    pytest.importorskip("xgrammar")

    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        c = chat_fields(body(tools=TOOLS, tool_choice=choice, max_tokens=8))
        guide = prepare(generate_request([5, 6], c), None, LIMITS).sampling.guide
        assert guide.kind == "json" and json.loads(guide.spec) == call_schema(c.tools)


def test_a_schema_xgrammar_refuses_is_a_400_naming_tools():
    pytest.importorskip("xgrammar")

    bad = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "foo"}}}}}
    c = chat_fields(body(tools=[bad], tool_choice="required"))
    with pytest.raises(RequestError) as err:
        prepare(generate_request([5, 6], c), None, LIMITS)
    http = http_error(err.value, c)
    assert http.param == "tools" and http.message.startswith("tools: "), http.message


def test_the_schema_of_a_forced_call():
    jsonschema = pytest.importorskip("jsonschema")

    required = call_schema(plan("required"))
    assert len(required["anyOf"]) == 3
    good = [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}},
            {"name": "get-time", "arguments": {"zone": "UTC"}},
            {"name": "ping", "arguments": {}}]
    bad = [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "UTC"}},  # other $defs
           {"name": "get-time", "arguments": {"zone": "C"}},
           {"name": "nope", "arguments": {}},
           {"name": "ping"},
           {"name": "ping", "arguments": {}, "extra": 1}]
    for call in good:
        jsonschema.validate(call, required)
    for call in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(call, required)
    named = call_schema(plan("named", named="get_weather"))
    assert "anyOf" not in named and named["properties"]["name"] == {"const": "get_weather"}
    assert named["properties"]["arguments"]["properties"]["unit"] == {
        "$ref": "#/properties/arguments/$defs/unit"}
    jsonschema.validate(good[0], named)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good[1], named)
    # data keywords keep their values, refs and all
    const = {"type": "function", "function": {"name": "c", "parameters": {
        "type": "object", "properties": {"k": {"const": {"$ref": "#/x"}}}}}}
    schema = call_schema(plan("required", tools=[const]))
    assert schema["properties"]["arguments"]["properties"]["k"] == {"const": {"$ref": "#/x"}}


# --- the prompt ----------------------------------------------------------------------------

CONVERSATION = [
    {"role": "user", "content": "Weather in Paris, and the time?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get-time", "arguments": {"zone": "CET"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "09:00"}]},
]


def test_the_fallback_prompt_lists_the_tools_in_hermes_form():
    template = ChatTemplate(CHATML)
    messages, extra = chat_inputs(template, CONVERSATION, plan())
    assert extra == {}
    prompt = template.render(messages, True)
    system = fallback_system_text(plan())
    assert prompt.startswith("<|im_start|>system\n# Tools\n") and system in prompt
    for tool in TOOLS:
        assert json.dumps(tool) in system
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n' \
           "</tool_call>" in system
    # the calls as Hermes text, the two results as one user message
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris", "unit": "C"}}\n</tool_call>\n<tool_call>\n{"name": "get-time", '
            '"arguments": {"zone": "CET"}}\n</tool_call><|im_end|>') in prompt
    assert ("<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response>\n"
            "<tool_response>\n09:00\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n") in prompt


def test_the_fallback_merges_into_a_system_message_and_none_adds_nothing():
    template = ChatTemplate(CHATML)
    system = [{"role": "system", "content": "Be brief."}, *MESSAGES]
    messages, _ = chat_inputs(template, system, plan())
    assert len(messages) == 2
    assert messages[0]["content"] == "Be brief.\n\n" + fallback_system_text(plan())
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}, *MESSAGES]
    messages, _ = chat_inputs(template, parts, plan())
    assert template.render(messages).startswith(
        "<|im_start|>system\nBe brief.\n\n" + fallback_system_text(plan()))
    # tool_choice none: no tools text, the conversation still in Hermes form
    messages, _ = chat_inputs(template, CONVERSATION, plan("none"))
    assert messages[0] == CONVERSATION[0] and "<tool_call>" in messages[1]["content"]
    assert chat_inputs(template, MESSAGES, None) == (MESSAGES, {})


def test_a_template_with_tools_renders_them_itself():
    template = ChatTemplate(NATIVE)
    messages, extra = chat_inputs(template, CONVERSATION, plan())
    assert extra == {"tools": TOOLS}
    prompt = template.render(messages, True, **extra)
    assert prompt.startswith("TOOLS:get_weather;get-time;ping;user: ")
    # arguments as objects (templates write them with tojson), content "" beside calls
    assert ('assistant: [get_weather {"city": "Paris", "unit": "C"}]'
            '[get-time {"zone": "CET"}]') in prompt
    assert "tool: 18 C, sunny(call_1)" in prompt
    messages, extra = chat_inputs(template, CONVERSATION, None)
    assert extra == {} and messages[1]["tool_calls"][0]["function"]["arguments"] == {
        "city": "Paris", "unit": "C"}


@pytest.mark.parametrize("message, words", [
    ({"role": "user", "content": "x", "tool_calls": [NOARGS]}, "only an assistant"),
    ({"role": "assistant", "tool_calls": "f"}, "must be a list of 1..128 calls"),
    ({"role": "assistant", "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]},
     "messages[1].tool_calls[0] must be"),
    ({"role": "assistant", "tool_calls": [{"id": 3, "function": {"name": "f"}}]},
     "id a string"),
    ({"role": "assistant", "tool_calls": [{"id": "c", "function": {
        "name": "f", "arguments": "{not json"}}]}, "tool_calls[0].function.arguments"),
    ({"role": "assistant", "tool_calls": [{"id": "c", "function": {
        "name": "f", "arguments": "[1]"}}]}, "must be a JSON object"),
    ({"role": "tool", "content": "x"}, "messages[1].tool_call_id"),
    ({"role": "tool", "tool_call_id": 7, "content": "x"}, "tool_call_id"),
    ({"role": "tool", "tool_call_id": "c"}, "messages[1].content: missing"),
    ({"role": "tool", "tool_call_id": "c", "content": [{"type": "image"}]},
     "messages[1].content: must be a string"),
])
def test_bad_tool_messages_are_400s_naming_them(message, words):
    with pytest.raises(HTTPError) as err:
        chat_inputs(ChatTemplate(CHATML), [*MESSAGES, message], plan())
    assert err.value.param == "messages" and words in err.value.message, err.value.message


def test_an_assistant_message_without_calls_is_left_alone():
    messages = [*MESSAGES, {"role": "assistant", "content": "hi", "tool_calls": []}]
    out, _ = chat_inputs(ChatTemplate(CHATML), messages, plan())
    assert out[-1] == {"role": "assistant", "content": "hi"}


# --- the answer ----------------------------------------------------------------------------

def call(name: str, **args) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


def calls_of(text: str, p: ToolPlan | None = None) -> tuple[str | None, list]:
    content, calls = parse_tool_calls(text, p or plan())
    for c in calls:
        assert c["id"].startswith("call_") and len(c["id"]) > 10 and c["type"] == "function"
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                     for c in calls]


def test_hermes_calls_are_parsed():
    assert calls_of(call("get_weather", city="Paris", unit="C")) == (
        None, [("get_weather", {"city": "Paris", "unit": "C"})])
    two = call("get_weather", city="Rome", unit="F") + "\n" + call("ping")
    assert calls_of(two) == (None, [("get_weather", {"city": "Rome", "unit": "F"}),
                                    ("ping", {})])
    around = "Let me look.\n" + call("ping") + "\nDone."
    assert calls_of(around) == ("Let me look.\n\nDone.", [("ping", {})])
    # the last block may be left open; arguments may be JSON text
    assert calls_of('<tool_call>{"name": "ping", "arguments": "{\\"a\\": 1}"}') == (
        None, [("ping", {"a": 1})])
    # a whole answer that is one call, bare; Llama's "parameters" too
    assert calls_of(' {"name": "get-time", "arguments": {"zone": "UTC"}}\n') == (
        None, [("get-time", {"zone": "UTC"})])
    assert calls_of('{"name": "ping", "parameters": {}}') == (None, [("ping", {})])


@pytest.mark.parametrize("text", [
    "Paris is sunny.",
    "<tool_call>\n{\"name\": \"ping\", \"arguments\": {}\n</tool_call>",  # broken JSON
    "<tool_call>not json at all</tool_call>",
    call("unknown_tool"),  # not one of the tools
    '<tool_call>{"name": "ping", "arguments": [1]}</tool_call>',  # arguments not an object
    '<tool_call>{"name": "ping", "arguments": "{oops"}</tool_call>',
    '{"name": "ping"}',
    '{"city": "Paris"}',
    "",
])
def test_text_that_is_no_call_stays_content(text):
    assert calls_of(text) == (text, [])


def test_a_broken_block_stays_content_beside_a_good_one():
    text = "<tool_call>{broken}</tool_call>\n" + call("ping")
    assert calls_of(text) == ("<tool_call>{broken}</tool_call>\n", [("ping", {})])


STREAMED = [
    "Sure, checking.\n" + call("get_weather", city="Paris", unit="C") + "\nOne moment.",
    call("ping") + call("get-time", zone="UTC"),
    '{"name": "ping", "arguments": {}}',
    '{"city": "Paris"}',
    "No call here, just <tool_ talk and a < sign.",
    "Text then a broken <tool_call>{\"name\": \"ping\"",
    "   \n",
]


@pytest.mark.parametrize("text", STREAMED)
@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_a_streamed_answer_gives_the_whole_answers_content_and_calls(text, size):
    stream = ToolStream(plan())
    sent = "".join(stream.feed(text[i:i + size]) for i in range(0, len(text), size))
    rest, calls = stream.finish()
    content, want = calls_of(text)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] \
        == want
    assert sent + rest == (content or "") if want else sent + rest == text
    assert "<tool_call" not in sent  # nothing of a call goes out as content


def test_a_stream_sends_content_before_a_call_as_it_comes():
    stream = ToolStream(plan())
    assert stream.feed("  ") == ""  # whitespace alone: may still be a bare call
    assert stream.feed("Hello <tool") == "  Hello "
    assert stream.feed("box>") == "<toolbox>"
    assert stream.feed(" <tool_call>{") == " "
    assert stream.feed('"name": "ping", "arguments": {}}</tool_call> bye') == ""
    assert stream.finish()[0] == " bye"


def test_chat_body_carries_the_tool_calls():
    c = chat_fields(body(tools=TOOLS))
    collected = [Collected(text="I will check.\n" + call("ping"), finish_reason="stop"),
                 Collected(text="No need.", finish_reason="length")]

    class State:
        choice, cached_tokens = 0, 0
        request = type("R", (), {"prompt_token_ids": [1, 2]})

    out = chat_body(None, "m", "id", [State(), State()], collected, c)
    first, second = out["choices"]
    assert first["finish_reason"] == "tool_calls"
    assert first["message"]["content"] == "I will check.\n"
    assert first["message"]["tool_calls"][0]["function"] == {"name": "ping", "arguments": "{}"}
    assert second["finish_reason"] == "length" and second["message"] == {
        "role": "assistant", "content": "No need."}
    # tool_choice none: no parsing
    c = chat_fields(body(tools=TOOLS, tool_choice="none"))
    out = chat_body(None, "m", "id", [State()], collected[:1], c)
    assert out["choices"][0]["message"]["content"] == collected[0].text
    assert out["choices"][0]["finish_reason"] == "stop"


def test_streamed_tool_call_events():
    c = chat_fields(body(tools=TOOLS))
    stream, head = ToolStream(c.tools), {"id": "x"}
    events = []
    for piece, finish in (("Ok ", None), ("<tool_call>\n", None),
                          ('{"name": "get-time", "arguments": {"zone": "UTC"}}', None),
                          ("\n</tool_call>", "stop")):
        events += _tool_events(None, head, 0, Chunk([1], piece, finish_reason=finish), stream, c)
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0] == {"content": "Ok "}
    call_id = deltas[1]["tool_calls"][0]["id"]
    assert deltas[1:] == [
        {"tool_calls": [{"index": 0, "id": call_id, "type": "function",
                         "function": {"name": "get-time", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"zone": "UTC"}'}}]},
        {}]
    assert [e["choices"][0]["finish_reason"] for e in events] == [None, None, None,
                                                                  "tool_calls"]
    # no call: the held text goes out at the end, with the model's finish reason
    stream = ToolStream(c.tools)
    events = _tool_events(None, head, 1, Chunk([1], '{"a": 1}', finish_reason="length"),
                          stream, c)
    assert [(e["choices"][0]["delta"], e["choices"][0]["finish_reason"]) for e in events] == [
        ({"content": '{"a": 1}'}, None), ({}, "length")]
