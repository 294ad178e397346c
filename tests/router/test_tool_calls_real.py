"""OpenAI tool calls on the real model (SmolLM2-135M-Instruct, whose template has no
tools: the Hermes fallback) served disaggregated, through the `openai` client:
``tool_choice`` "required" and a named function always give one call whose arguments
validate (``jsonschema``), sampled with several seeds, streamed and not; a conversation
goes round (the call, the tool's result, an answer under "auto")."""

from __future__ import annotations

import json

import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")
openai = pytest.importorskip("openai")

MODEL = "smollm2-135m-instruct"
WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 20},
                          "unit": {"$ref": "#/$defs/unit"}},
           "required": ["city", "unit"], "additionalProperties": False,
           "$defs": {"unit": {"enum": ["celsius", "fahrenheit"]}}}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
        "required": ["zone"], "additionalProperties": False}
SEARCH = {"type": "object",
          "properties": {"query": {"type": "string", "maxLength": 40},
                         "limit": {"type": "integer", "minimum": 1, "maximum": 10}},
          "required": ["query"], "additionalProperties": False}
PARAMS = {"get_weather": WEATHER, "get_time": TIME, "search": SEARCH}
TOOLS = [{"type": "function", "function": {"name": name, "description": words,
                                           "parameters": PARAMS[name]}}
         for name, words in (("get_weather", "The current weather in a city"),
                             ("get_time", "The time in a time zone"),
                             ("search", "Search the web"))]
ASK = [[{"role": "user", "content": "What is the weather like in Paris today?"}],
       [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Find me a recipe for pancakes."}]]
MAX_TOKENS = 64


def _client(router):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{router.server.http_port}/v1",
                         api_key="unused", max_retries=0, timeout=120)


def _check_call(name: str, arguments: str, want: str | None = None) -> dict:
    assert name in PARAMS and (want is None or name == want), name
    args = json.loads(arguments)
    jsonschema.validate(args, PARAMS[name])
    return args


def _streamed(stream) -> tuple[dict[int, dict], list, list]:
    """(calls by index, content pieces, finish reasons) of a streamed answer; the
    usage chunk is checked."""
    calls: dict[int, dict] = {}
    content, finishes, usage = [], [], None
    for chunk in stream:
        if not chunk.choices:
            usage = chunk.usage
            continue
        choice = chunk.choices[0]
        content.append(choice.delta.content or "")
        finishes.append(choice.finish_reason)
        for tc in choice.delta.tool_calls or []:
            call = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = tc.id or call["id"]
            call["name"] += (tc.function.name or "") if tc.function else ""
            call["arguments"] += (tc.function.arguments or "") if tc.function else ""
    assert usage is not None and usage.completion_tokens > 0
    return calls, content, finishes


def test_required_always_gives_a_valid_call(real_router):
    with _client(real_router) as c:
        outs = [c.chat.completions.create(model=MODEL, messages=ask, tools=TOOLS,
                                          tool_choice="required", n=3, temperature=1.0,
                                          seed=seed, max_tokens=MAX_TOKENS)
                for ask, seed in zip(ASK, (1, 2), strict=True)]
    choices = [choice for out in outs for choice in out.choices]
    assert len(choices) == 6
    for choice in choices:
        assert choice.finish_reason == "tool_calls", choice.message
        assert choice.message.content is None and len(choice.message.tool_calls) == 1
        call = choice.message.tool_calls[0]
        assert call.type == "function" and call.id.startswith("call_")
        _check_call(call.function.name, call.function.arguments)
    assert len({choice.message.tool_calls[0].id for choice in choices}) == 6


def test_a_named_function_is_called_streamed_and_not(real_router):
    named = {"type": "function", "function": {"name": "get_time"}}
    with _client(real_router) as c:
        whole = c.chat.completions.create(model=MODEL, messages=ASK[0], tools=TOOLS,
                                          tool_choice=named, temperature=0,
                                          max_tokens=MAX_TOKENS)
        stream = c.chat.completions.create(model=MODEL, messages=ASK[0], tools=TOOLS,
                                           tool_choice=named, temperature=0,
                                           max_tokens=MAX_TOKENS, stream=True,
                                           stream_options={"include_usage": True})
        calls, content, finishes = _streamed(stream)
        required = c.chat.completions.create(model=MODEL, messages=ASK[1], tools=TOOLS,
                                             tool_choice="required", temperature=0.7, seed=3,
                                             max_tokens=MAX_TOKENS, stream=True,
                                             stream_options={"include_usage": True})
        required_calls, _, required_finishes = _streamed(required)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0].function
    args = _check_call(call.name, call.arguments, "get_time")
    # the stream: no content, one call, the same greedy arguments
    assert "".join(content) == "" and list(calls) == [0]
    assert calls[0]["name"] == "get_time" and calls[0]["id"].startswith("call_")
    assert _check_call(calls[0]["name"], calls[0]["arguments"], "get_time") == args
    assert [f for f in finishes if f] == ["tool_calls"]
    assert list(required_calls) == [0] and [f for f in required_finishes if f] == ["tool_calls"]
    _check_call(required_calls[0]["name"], required_calls[0]["arguments"])


def test_a_conversation_goes_round_the_tool(real_router):
    with _client(real_router) as c:
        first = c.chat.completions.create(
            model=MODEL, messages=ASK[0], tools=TOOLS, temperature=0, max_tokens=MAX_TOKENS,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        call = first.choices[0].message.tool_calls[0]
        _check_call(call.function.name, call.function.arguments, "get_weather")
        messages = [*ASK[0],
                    first.choices[0].message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id,
                     "content": json.dumps({"temperature": 18, "sky": "sunny"})}]
        final = c.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                          tool_choice="auto", temperature=0, max_tokens=48)
        streamed = c.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                             temperature=0, max_tokens=48, stream=True,
                                             stream_options={"include_usage": True})
        calls, content, finishes = _streamed(streamed)
    answer = final.choices[0]
    assert answer.finish_reason in ("stop", "length"), answer.message
    assert answer.message.content and not answer.message.tool_calls
    # the same greedy answer, streamed
    assert calls == {} and "".join(content) == answer.message.content
    assert [f for f in finishes if f] == [answer.finish_reason]
