"""OpenAI request bodies, checked field by field, into ``GenerateRequest`` messages.

OpenAI's field names, and vLLM's extensions where users rely on them; a field pdserve
does not support yet is refused (a 400 naming it), never ignored. Every problem is an
``HTTPError`` that the front turns into an OpenAI error object (``error_body``,
openai_errors.py).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import grpc

from pdserve.router.openai_errors import HTTPError, body_field
from pdserve.router.openai_structured import structured_output
from pdserve.router.openai_tools import tool_fields
from pdserve.router.request_error import RequestError
from pdserve.rpc import router_pb2
from pdserve.scheduler.sampling_params import MAX_LOGIT_BIAS

MAX_PROMPTS = 64  # prompts in one /v1/completions call
TOKEN_ID_KEY = re.compile(r"-?[0-9]{1,12}")  # a logit_bias key
MAX_LOGPROBS = 20
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
}
# Fields OpenAI defines that pdserve does not do yet: refused, never ignored.
UNSUPPORTED = {
    "completions": ("suffix", "echo", "best_of"),
    "chat": ("functions", "function_call", "audio", "modalities", "prediction",
             "web_search_options"),
}
# what a refusal says beyond "not supported" (the legacy names of tools and tool_choice)
UNSUPPORTED_HINT = {"functions": "the legacy function-calling API; use tools",
                    "function_call": "the legacy function-calling API; use tool_choice"}
# Accepted and without effect on the output (documented): labels and hints.
IGNORED = ("user", "metadata", "store", "service_tier", "parallel_tool_calls")
# The logits controls (vLLM's semantics; their ranges are the shared validation's).
CONTROL_FLOATS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")
# GenerateRequest fields set from Common when given, and the ones the proto holds as int32
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs", "n",
                   "min_tokens", *CONTROL_FLOATS)
INT32_FIELDS = ("max_tokens", "top_k", "logprobs", "n", "min_tokens")
FLOAT_FIELDS = ("temperature", "top_p", *CONTROL_FLOATS)


def http_error(exc: RequestError, c: Common | None = None) -> HTTPError:
    """The HTTP form of a refusal by the shared validation or admission. A refusal of
    the structured output names the body's field it came from (``c.structured_field``)."""
    status = HTTP_STATUS.get(exc.code, 500)
    message = exc.message
    head = message.split(" ", 1)[0].rstrip(":")
    if c is not None and c.structured_field and head.startswith("structured_output"):
        message = c.structured_field + message[len(head):]
        return HTTPError(status, message, c.structured_field.split(".", 1)[0])
    return HTTPError(status, message, _param_of(message))


def _param_of(message: str) -> str | None:
    first = message.split(" ", 1)[0].split("[", 1)[0]
    return first if first.isidentifier() else None


# -- fields --------------------------------------------------------------------------------

@dataclass
class Common:
    """The sampling fields both endpoints share, checked."""

    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    seed: int | None
    stop: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    include_stop_str_in_output: bool
    logprobs: int | None  # top-k alternatives to return; None: no logprobs
    stream: bool
    include_usage: bool
    return_token_ids: bool
    n: int  # choices per prompt
    # the logits controls (None: unset), vLLM's semantics
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    bad_words: list[str] = field(default_factory=list)
    # the structured output (openai_structured.py) and the body's field it came from
    structured_output: router_pb2.StructuredOutput | None = None
    structured_field: str = ""
    tools: Any = None  # chat: the ToolPlan of tools and tool_choice (openai_tools.py)


def common_fields(body: dict, endpoint: str, logprobs: int | None) -> Common:
    _refuse_unsupported(body, endpoint)
    n = body_field(body, "n", (int,), 1)
    if n < 1:  # the upper bound (max_choices) is the shared validation's
        raise HTTPError(400, f"n must be >= 1, got {n}", "n")
    stop, stop_ids = _stop_fields(body)
    stream, include_usage = _stream_fields(body)
    body_field(body, "user", (str,))  # a label: checked, not used
    max_tokens = _max_tokens(body, endpoint)
    temperature = body_field(body, "temperature", (int, float))
    top_p = body_field(body, "top_p", (int, float))
    seed = body_field(body, "seed", (int,))
    top_k = body_field(body, "top_k", (int,))
    ignore_eos = body_field(body, "ignore_eos", (bool,), False)
    controls = _control_fields(body, ignore_eos)
    return Common(
        max_tokens=max_tokens,
        temperature=None if temperature is None else float(temperature),
        top_p=None if top_p is None else float(top_p), top_k=top_k, seed=seed, stop=stop,
        stop_token_ids=stop_ids, ignore_eos=ignore_eos,
        include_stop_str_in_output=body_field(body, "include_stop_str_in_output", (bool,),
                                              False),
        logprobs=logprobs, stream=stream, include_usage=include_usage,
        return_token_ids=body_field(body, "return_token_ids", (bool,), False), n=n,
        **controls)


def _control_fields(body: dict, ignore_eos: bool) -> dict:
    """Common's logits controls and structured output, as keyword arguments."""
    out = {}
    for name in CONTROL_FLOATS:
        value = body_field(body, name, (int, float))
        out[name] = None if value is None else float(value)
    out["min_tokens"] = body_field(body, "min_tokens", (int,))
    out["logit_bias"] = _logit_bias(body)
    bad_words = body_field(body, "bad_words", (list,), [])
    if not all(isinstance(w, str) for w in bad_words):
        raise HTTPError(400, "bad_words must be a list of strings", "bad_words")
    out["bad_words"] = bad_words
    out["structured_output"], out["structured_field"] = structured_output(body)
    if out["structured_output"] is not None and ignore_eos:
        raise HTTPError(400, f"ignore_eos cannot be combined with {out['structured_field']}: "
                        "the answer ends where its grammar does", "ignore_eos")
    return out


def _logit_bias(body: dict) -> dict[int, float]:
    """OpenAI's ``logit_bias``: token ids (as JSON object keys, strings) to biases."""
    bias = body_field(body, "logit_bias", (dict,), {})
    if len(bias) > MAX_LOGIT_BIAS:  # before reading them one by one
        raise HTTPError(400, f"logit_bias must hold at most {MAX_LOGIT_BIAS} entries, got "
                        f"{len(bias)}", "logit_bias")
    out = {}
    for key, value in bias.items():
        if not TOKEN_ID_KEY.fullmatch(key) or not -2**31 <= int(key) < 2**31:
            raise HTTPError(400, f"logit_bias keys must be token ids (integers), got "
                            f"{json.dumps(key)[:40]}", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise HTTPError(400, f"logit_bias[{key}] must be a number, got "
                            f"{json.dumps(value)[:40]}", "logit_bias")
        out[int(key)] = float(value)
    return out


def _refuse_unsupported(body: dict, endpoint: str) -> None:
    for name in UNSUPPORTED[endpoint]:
        if body.get(name) not in (None, 0, False, [], {}):
            hint = f" ({UNSUPPORTED_HINT[name]})" if name in UNSUPPORTED_HINT else ""
            raise HTTPError(400, f"{name} is not supported by pdserve yet{hint}", name)


def _stop_fields(body: dict) -> tuple[list[str], list[int]]:
    stop = body_field(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) for s in stop):
        raise HTTPError(400, "stop must be a string or a list of strings", "stop")
    stop_ids = body_field(body, "stop_token_ids", (list,), [])
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise HTTPError(400, "stop_token_ids must be a list of integers", "stop_token_ids")
    return stop, stop_ids


def _stream_fields(body: dict) -> tuple[bool, bool]:
    """``stream``, and whether its last chunk carries the usage."""
    stream = body_field(body, "stream", (bool,), False)
    options = body_field(body, "stream_options", (dict,), {})
    if options and not stream:
        raise HTTPError(400, "stream_options is only allowed with stream: true",
                        "stream_options")
    include_usage = bool(body_field(options, "include_usage", (bool,), False)) if options else False
    return stream, include_usage


def _max_tokens(body: dict, endpoint: str) -> int | None:
    max_tokens = body_field(body, "max_tokens", (int,))
    if endpoint == "chat":  # the newer name wins
        max_tokens = body_field(body, "max_completion_tokens", (int,), max_tokens)
    if max_tokens is not None and max_tokens < 1:
        raise HTTPError(400, f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
    return max_tokens


def completion_fields(body: dict) -> tuple[Common, list[str | list[int]]]:
    """A /v1/completions body's sampling fields and its prompts."""
    logprobs = body_field(body, "logprobs", (int,))
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise HTTPError(400, f"logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}",
                        "logprobs")
    c = common_fields(body, "completions", logprobs)
    return c, completion_prompts(body)


def chat_fields(body: dict) -> Common:
    """A /v1/chat/completions body's sampling fields (its messages are the template's)."""
    want = body_field(body, "logprobs", (bool,), False)
    top = body_field(body, "top_logprobs", (int,))
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise HTTPError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}",
                        "top_logprobs")
    if top is not None and not want:
        raise HTTPError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    c = common_fields(body, "chat", (top or 0) if want else None)
    tool_fields(body, c)  # tools and tool_choice; a forced call's structured output
    return c


# -- into the proto ------------------------------------------------------------------------

def _check_int32(name: str, ids: list[int]) -> None:
    # The proto's ids are int32: a larger JSON integer is a bad field, not a crash.
    if any(not -2**31 <= t < 2**31 for t in ids):
        raise HTTPError(400, f"{name} holds a token id outside the 32-bit range", name)


def generate_request(prompt: str | list[int], c: Common) -> router_pb2.GenerateRequest:
    """One prompt's GenerateRequest, for the shared validation (``validation.prepare``)."""
    _check_int32("stop_token_ids", c.stop_token_ids)
    if not isinstance(prompt, str):
        _check_int32("prompt", prompt)
    req = router_pb2.GenerateRequest(stop=c.stop, stop_token_ids=c.stop_token_ids,
                                     ignore_eos=c.ignore_eos,
                                     include_stop_str_in_output=c.include_stop_str_in_output)
    _set_controls(req, c)
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
        if not prompt:
            req.token_ids.SetInParent()
    for name in SAMPLING_FIELDS:
        value = getattr(c, name)
        if value is not None:
            _set_sampling_field(req, name, value)
    return req


def _set_controls(req: router_pb2.GenerateRequest, c: Common) -> None:
    """The logit bias, bad words and structured output (their values are checked by
    the shared validation)."""
    for token, bias in c.logit_bias.items():
        req.logit_bias[token] = bias
    try:
        req.bad_words.extend(c.bad_words)
    except ValueError as exc:  # a string protobuf cannot hold (a lone surrogate)
        raise HTTPError(400, f"bad_words must be valid Unicode text: {exc}",
                        "bad_words") from None
    if c.structured_output is not None:
        req.structured_output.CopyFrom(c.structured_output)


def _set_sampling_field(req: router_pb2.GenerateRequest, name: str, value: Any) -> None:
    if name in INT32_FIELDS and not -2**31 <= value < 2**31:
        raise HTTPError(400, f"{name} is out of range: {value}", name)
    if name in FLOAT_FIELDS and not math.isfinite(value):
        raise HTTPError(400, f"{name} must be a finite number, got {value}", name)
    try:
        setattr(req, name, value)
    except (ValueError, AttributeError) as exc:  # a field this proto lacks
        raise HTTPError(400, f"{name}: {exc}", name) from exc


def _is_token_ids(value: Any) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def completion_prompts(body: dict) -> list[str | list[int]]:
    """``prompt`` as a list of prompts: one string or token-id list, or a batch of them."""
    if "prompt" not in body:
        raise HTTPError(400, "prompt is required", "prompt")
    p = body["prompt"]
    if isinstance(p, str):
        return [p]
    if isinstance(p, list) and p and _is_token_ids(p):
        return [p]
    if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        prompts = p
    elif isinstance(p, list) and p and all(isinstance(x, list) and _is_token_ids(x) for x in p):
        prompts = p
    else:
        raise HTTPError(400, "prompt must be a string, a list of strings, a list of token "
                        "ids or a list of token-id lists (not empty)", "prompt")
    if len(prompts) > MAX_PROMPTS:
        raise HTTPError(400, f"prompt may hold at most {MAX_PROMPTS} prompts, got "
                        f"{len(prompts)}", "prompt")
    return prompts
