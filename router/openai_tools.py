"""OpenAI tool calls on /v1/chat/completions: the request's ``tools`` and
``tool_choice`` checked, the prompt that shows them to the model, the guide of a forced
call, and the calls parsed back out of the answer (whole, or as it streams).

- ``tools``: at most ``MAX_TOOLS`` ``{"type": "function", "function": {"name",
  "description", "parameters", "strict"}}``, names ``^[a-zA-Z0-9_-]{1,64}$`` and unique,
  ``parameters`` a JSON schema object (omitted: no arguments), all of it at most
  ``MAX_TOOLS_CHARS`` of JSON and ``MAX_SCHEMA_DEPTH`` deep.
- ``tool_choice``: "none", "auto" (the default with tools), "required", or
  ``{"type": "function", "function": {"name": ...}}`` naming one of them. "required" and
  a named function are a ``json_schema`` guide (``call_schema``): the answer is one call,
  ``{"name": ..., "arguments": {...}}``, its arguments held to that tool's parameters.
- The prompt (``chat_inputs``): a template that mentions ``tools`` renders them itself
  (``tools=``); for one that does not, the tools go into a system message in Hermes form
  (``fallback_system_text``), an assistant message's calls become their Hermes text and
  ``role: "tool"`` results become a user message of ``<tool_response>`` blocks.
- The answer (``parse_tool_calls``; ``ToolStream`` when streamed): ``<tool_call>{json}
  </tool_call>`` blocks (the last may be left open), or a whole answer that is one
  ``{"name", "arguments"}`` object, naming a given tool; text outside them stays content,
  and a block that does not parse stays content too.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from pdserve.router.openai_errors import HTTPError, body_field
from pdserve.rpc import router_pb2
from pdserve.scheduler.sampling_params import MAX_GUIDE_CHARS

MAX_TOOLS = 128
MAX_TOOLS_CHARS = 1 << 16  # the tools as JSON
MAX_SCHEMA_DEPTH = 24  # nesting of a tool's parameters (the template sees at most 32)
MAX_TOOL_CALLS = 128  # in one assistant message
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
TOOL_KEYS = ("type", "function")
FUNCTION_KEYS = ("name", "description", "parameters", "strict")
CHOICES = ("none", "auto", "required")
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
CALL_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
NO_ARGUMENTS = {"type": "object", "properties": {}}
# JSON schema keywords whose values are data, not schemas: no $ref in them is rewritten
DATA_KEYWORDS = ("const", "enum", "default", "examples")
FALLBACK_INTRO = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n")
FALLBACK_CALLS = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


@dataclass(frozen=True)
class ToolPlan:
    """A request's checked tools and what its ``tool_choice`` asks."""

    tools: tuple[dict, ...]  # as given (plain JSON), checked
    choice: str  # "none", "auto", "required" or "named"
    named: str | None = None  # the function of a named choice

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t["function"]["name"] for t in self.tools)

    @property
    def parses(self) -> bool:
        """Whether the answer is read for calls."""
        return self.choice != "none"

    @property
    def guided(self) -> bool:
        return self.choice in ("required", "named")


# -- the request ---------------------------------------------------------------------------

def tool_fields(body: dict, c) -> None:
    """``tools`` and ``tool_choice`` of a chat body onto ``c`` (``Common``): its
    ``tools`` plan, and for a forced call the structured output that forces it."""
    c.tools = plan = tool_plan(body)
    if plan is None or not plan.guided:
        return
    if c.structured_output is not None:
        raise HTTPError(400, f"tool_choice {_choice_words(plan)} cannot be combined with "
                        f"{c.structured_field.split('.', 1)[0]}: the answer is a tool call",
                        "tool_choice")
    if c.ignore_eos:
        raise HTTPError(400, "ignore_eos cannot be combined with a tool_choice that forces "
                        "a call: the answer ends where the call does", "ignore_eos")
    spec = json.dumps(call_schema(plan), ensure_ascii=False)
    if len(spec) > MAX_GUIDE_CHARS:
        raise HTTPError(400, f"tools: the schema of the forced call is {len(spec)} characters,"
                        f" more than a guide may hold ({MAX_GUIDE_CHARS})", "tools")
    try:
        strict = all(t["function"].get("strict") is True for t in _called(plan))
        c.structured_output = router_pb2.StructuredOutput(json_schema=spec, loose=not strict)
    except ValueError as exc:  # a string protobuf cannot hold (a lone surrogate)
        raise HTTPError(400, f"tools must be valid Unicode text: {exc}", "tools") from None
    c.structured_field = "tools"


def _choice_words(plan: ToolPlan) -> str:
    return f"naming {plan.named!r}" if plan.choice == "named" else repr(plan.choice)


def tool_plan(body: dict) -> ToolPlan | None:
    """The body's tools and tool choice, checked; None without tools (or with none
    given and ``tool_choice`` "none" or "auto")."""
    tools = body_field(body, "tools", (list,), [])
    if len(tools) > MAX_TOOLS:
        raise HTTPError(400, f"tools must hold at most {MAX_TOOLS} tools, got {len(tools)}",
                        "tools")
    checked = tuple(_tool(tool, i) for i, tool in enumerate(tools))
    if checked:
        _check_tools_size(checked)
    names = [t["function"]["name"] for t in checked]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise HTTPError(400, f"tools[{i}].function.name: {name!r} is given twice "
                            "(tool names must be unique)", "tools")
    choice, named = _tool_choice(body, names)
    if not checked:
        return None
    return ToolPlan(checked, choice, named)


def _tool(tool: Any, i: int) -> dict:
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise HTTPError(400, f"{where} must be an object {{\"type\": \"function\", "
                        "\"function\": {...}}", "tools")
    _known_keys(tool, TOOL_KEYS, where)
    if tool.get("type") != "function":
        raise HTTPError(400, f"{where}.type must be \"function\" (pdserve's only tool kind),"
                        f" got {json.dumps(tool.get('type'))[:40]}", "tools")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise HTTPError(400, f"{where}.function must be an object (name, description, "
                        "parameters)", "tools")
    _known_keys(fn, FUNCTION_KEYS, f"{where}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise HTTPError(400, f"{where}.function.name must match ^[a-zA-Z0-9_-]{{1,64}}$, got "
                        f"{json.dumps(name)[:80]}", "tools")
    for key, kind, words in (("description", str, "a string"), ("strict", bool, "a boolean")):
        if fn.get(key) is not None and not isinstance(fn[key], kind):
            raise HTTPError(400, f"{where}.function.{key} must be {words}", "tools")
    _check_parameters(fn.get("parameters"), f"{where}.function.parameters")
    return tool


def _known_keys(value: dict, keys: tuple, where: str) -> None:
    for key in value:
        if key not in keys:
            raise HTTPError(400, f"{where}.{str(key)[:40]} is not supported by pdserve "
                            f"(give {', '.join(keys)})", "tools")


def _check_parameters(params: Any, where: str) -> None:
    if params is None:
        return
    if not isinstance(params, dict):
        raise HTTPError(400, f"{where} must be a JSON schema (an object)", "tools")
    if params.get("type", "object") != "object":
        raise HTTPError(400, f"{where} must be a JSON schema of type \"object\", got type "
                        f"{json.dumps(params.get('type'))[:40]}", "tools")
    if _depth(params) > MAX_SCHEMA_DEPTH:
        raise HTTPError(400, f"{where} is nested more than {MAX_SCHEMA_DEPTH} levels deep",
                        "tools")


def _depth(value: Any) -> int:
    """How deep lists and objects nest in ``value`` (no recursion: any depth is safe)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in item)
    return deepest


def _check_tools_size(tools: tuple[dict, ...]) -> None:
    try:
        size = len(json.dumps(tools, ensure_ascii=False))
    except (TypeError, ValueError) as exc:  # not plain JSON (cannot come from a body)
        raise HTTPError(400, f"tools must be plain JSON: {exc}", "tools") from None
    if size > MAX_TOOLS_CHARS:
        raise HTTPError(400, f"tools must be at most {MAX_TOOLS_CHARS} characters of JSON, "
                        f"got {size}", "tools")


def _tool_choice(body: dict, names: list[str]) -> tuple[str, str | None]:
    choice = body_field(body, "tool_choice", (str, dict), "auto" if names else "none")
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise HTTPError(400, f"tool_choice must be one of {', '.join(CHOICES)} or "
                            "{\"type\": \"function\", \"function\": {\"name\": ...}}, got "
                            f"{json.dumps(choice)[:80]}", "tool_choice")
        if choice == "required" and not names:
            raise HTTPError(400, "tool_choice \"required\" needs tools", "tool_choice")
        return choice, None
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str) or set(choice) != {
            "type", "function"} or set(fn) != {"name"}:
        raise HTTPError(400, "tool_choice must be {\"type\": \"function\", \"function\": "
                        "{\"name\": ...}} to name a function", "tool_choice")
    if name not in names:
        raise HTTPError(400, f"tool_choice names the function {name[:80]!r}, which is not "
                        "among tools", "tool_choice")
    return "named", name


# -- the guide of a forced call ------------------------------------------------------------

def _called(plan: ToolPlan) -> list[dict]:
    """The tools a forced call may name."""
    return [t for t in plan.tools if plan.choice != "named" or t["function"]["name"] == plan.named]


def call_schema(plan: ToolPlan) -> dict:
    """The JSON schema a forced call's answer is held to: ``{"name": NAME, "arguments":
    PARAMETERS}`` for the named tool, or any of the tools' ("required"). A tool's local
    ``$ref``s ("#/...") are rewritten to where its parameters now sit."""
    tools = _called(plan)
    if len(tools) == 1:
        return _call_object(tools[0], "#/properties/arguments")
    return {"anyOf": [_call_object(t, f"#/anyOf/{i}/properties/arguments")
                      for i, t in enumerate(tools)]}


def _call_object(tool: dict, at: str) -> dict:
    fn = tool["function"]
    params = fn.get("parameters")
    return {"type": "object",
            "properties": {"name": {"const": fn["name"]},
                           "arguments": _moved(NO_ARGUMENTS if params is None else params, at)},
            "required": ["name", "arguments"], "additionalProperties": False}


def _moved(schema: Any, at: str) -> Any:
    """``schema`` with each local ``$ref`` ("#..." ) prefixed by ``at`` (a JSON pointer)."""
    if isinstance(schema, list):
        return [_moved(v, at) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = at + value[1:]
        else:
            out[key] = value if key in DATA_KEYWORDS else _moved(value, at)
    return out


# -- the prompt ----------------------------------------------------------------------------

def chat_inputs(template, messages: Any, plan: ToolPlan | None) -> tuple[Any, dict]:
    """The messages the template renders and ``render``'s extra arguments. A template
    that mentions ``tools`` gets them (``tools=``) and the messages with each call's
    ``arguments`` as an object (as templates read them); another gets the Hermes fallback
    (the module's doc). Messages that are not a list of objects go on unchanged: the
    template's checks name what is wrong."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        return messages, {}
    native = _renders_tools(template, plan)
    out: list[dict] = []
    for i, message in enumerate(messages):
        converted = _tool_message(message, i, native)
        if not native and message.get("role") == "tool" and i and messages[i - 1].get(
                "role") == "tool":  # consecutive results: one user message
            out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + converted["content"]}
        else:
            out.append(converted)
    if native:
        return out, ({"tools": list(plan.tools)} if plan is not None else {})
    if plan is not None and plan.choice != "none":
        out = _with_system_text(out, fallback_system_text(plan))
    return out, {}


def _renders_tools(template, plan: ToolPlan | None) -> bool:
    try:
        source = template.template_source(list(plan.tools) if plan is not None else None)
    except ValueError:  # several templates, none fits: render says so
        return True
    return "tools" in source


def fallback_system_text(plan: ToolPlan) -> str:
    """The tools in Hermes form, for a template that cannot show them."""
    tools = "\n".join(json.dumps(t, ensure_ascii=False) for t in plan.tools)
    return FALLBACK_INTRO + tools + FALLBACK_CALLS


def _with_system_text(messages: list[dict], text: str) -> list[dict]:
    first = messages[0] if messages else None
    if first is not None and first.get("role") == "system":
        content = first.get("content")
        if isinstance(content, str):
            return [{**first, "content": f"{content}\n\n{text}" if content else text},
                    *messages[1:]]
        if isinstance(content, list):
            return [{**first, "content": [*content, {"type": "text", "text": "\n" + text}]},
                    *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _tool_message(message: dict, i: int, native: bool) -> dict:
    """One message with its tool fields checked: an assistant's ``tool_calls`` and a
    tool result's ``tool_call_id``; as the fallback writes them when not ``native``."""
    where = f"messages[{i}]"
    role = message.get("role")
    calls = message.get("tool_calls")
    if calls == []:  # no calls: a plain message
        message = {k: v for k, v in message.items() if k != "tool_calls"}
    elif calls is not None:
        if role != "assistant":
            raise HTTPError(400, f"{where}.tool_calls: only an assistant message has "
                            "tool_calls", "messages")
        checked = _tool_calls(calls, f"{where}.tool_calls")
        content = message.get("content")
        if not native:
            return {"role": role, "content": _calls_text(content, checked, where)}
        return {**message, "content": "" if content is None else content,
                "tool_calls": checked}
    if role != "tool":
        return message
    if not isinstance(message.get("tool_call_id"), str):
        raise HTTPError(400, f"{where}.tool_call_id: a tool message needs the id (a string)"
                        " of the call it answers", "messages")
    if native:
        return message
    return {"role": "user", "content": "<tool_response>\n"
            f"{_text_of(message.get('content'), where + '.content')}\n</tool_response>"}


def _tool_calls(calls: Any, where: str) -> list[dict]:
    if not isinstance(calls, list) or not calls or len(calls) > MAX_TOOL_CALLS:
        raise HTTPError(400, f"{where} must be a list of 1..{MAX_TOOL_CALLS} calls",
                        "messages")
    return [_past_call(call, f"{where}[{j}]") for j, call in enumerate(calls)]


def _past_call(call: Any, where: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise HTTPError(400, f"{where} must be {{\"id\", \"type\": \"function\", \"function\":"
                        " {\"name\", \"arguments\"}}", "messages")
    if call.get("type", "function") != "function" or not isinstance(call.get("id", ""), str):
        raise HTTPError(400, f"{where}: type must be \"function\" and id a string", "messages")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            args = None
    if not isinstance(args, dict):
        raise HTTPError(400, f"{where}.function.arguments must be a JSON object (or its "
                        "JSON text)", "messages")
    return {**call, "type": "function", "function": {"name": fn["name"], "arguments": args}}


def _calls_text(content: Any, calls: list[dict], where: str) -> str:
    """An assistant message's text and its calls, as Hermes writes them."""
    blocks = [CALL_OPEN + "\n" + json.dumps(
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
        ensure_ascii=False) + "\n" + CALL_CLOSE for c in calls]
    text = "" if content is None else _text_of(content, f"{where}.content")
    return "\n".join([text, *blocks] if text else blocks)


def _text_of(content: Any, where: str) -> str:
    if content is None:
        raise HTTPError(400, f"{where}: missing", "messages")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "\n".join(p["text"] for p in content)
    raise HTTPError(400, f"{where}: must be a string or a list of text parts", "messages")


# -- the answer ----------------------------------------------------------------------------

def parse_tool_calls(text: str, plan: ToolPlan) -> tuple[str | None, list[dict]]:
    """(content, calls) of an answer: ``text`` and no calls when it holds none."""
    names = plan.names
    whole = _call_of(text, names) if text.lstrip().startswith("{") else None
    if whole is not None:
        return None, [whole]
    pieces, calls, at = [], [], 0
    for block in CALL_BLOCK.finditer(text):
        call = _call_of(block.group(1), names)
        if call is not None:
            pieces.append(text[at:block.start()])
            calls.append(call)
            at = block.end()
    if not calls:
        return text, []
    content = "".join(pieces) + text[at:]
    return (content if content.strip() else None), calls


def _call_of(text: str, names: frozenset[str]) -> dict | None:
    """The OpenAI tool call of one call's JSON (``arguments``, or Llama's
    ``parameters``, an object or its JSON text), None when it is not one of a tool."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    args = value.get("arguments", value.get("parameters"))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": value["name"],
                         "arguments": json.dumps(args, ensure_ascii=False)}}


def tool_message(text: str, plan: ToolPlan, finish: str | None) -> tuple[dict, str | None]:
    """A whole answer's message and finish reason ("tool_calls" when it made calls)."""
    content, calls = parse_tool_calls(text, plan)
    if not calls:
        return {"role": "assistant", "content": text}, finish
    return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"


def call_deltas(calls: list[dict]) -> list[dict]:
    """The streamed deltas of ``calls``, as OpenAI streams them: each call's id, type and
    name (arguments ""), then its arguments."""
    deltas = []
    for i, call in enumerate(calls):
        fn = call["function"]
        deltas.append({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                       "function": {"name": fn["name"], "arguments": ""}}]})
        deltas.append({"tool_calls": [{"index": i, "function": {
            "arguments": fn["arguments"]}}]})
    return deltas


class ToolStream:
    """One streamed choice's text: content goes out as it comes until a call may begin
    (``<tool_call>``, or a first ``{``); from there on it is held, and ``finish`` parses
    the whole answer. What was sent plus ``finish``'s content is ``parse_tool_calls``'
    content (or the text when it made no calls)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.sent = 0  # characters of text sent as content
        self.holding = False

    def feed(self, piece: str) -> str:
        """The content of ``piece`` to send now."""
        self.text += piece
        if self.holding:
            return ""
        text = self.text
        if not text.strip():
            return ""  # nothing yet says whether the answer is a call
        if self.sent == 0 and text.lstrip().startswith("{"):
            self.holding = True  # the whole answer may be one call
            return ""
        start = text.find(CALL_OPEN, self.sent)
        if start >= 0:
            self.holding = True
            end = start
        else:
            end = len(text) - _partial_open(text)
        out, self.sent = text[self.sent:end], max(self.sent, end)
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """(the content not sent yet, the calls)."""
        content, calls = parse_tool_calls(self.text, self.plan)
        if not calls:
            return self.text[self.sent:], []
        return (content or "")[self.sent:], calls


def _partial_open(text: str) -> int:
    """How many characters at the end of ``text`` may begin ``<tool_call>``."""
    for k in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):
        if text.endswith(CALL_OPEN[:k]):
            return k
    return 0
