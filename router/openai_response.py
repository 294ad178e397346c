"""A request's streamed chunks (``request_stream``) as OpenAI's response objects.

Completions and chat completions, whole or as SSE events: choices in order, logprobs
in each endpoint's shape, a chat answer's tool calls (``openai_tools``: parsed from the
whole answer, or held back while streamed and sent at its end), ``usage`` counting each
prompt once, and a choice that ended without its output (aborted, no rank could serve
it) as a 503: the whole response when collected, an error event in a stream.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

from pdserve.router.openai_errors import HTTPError, error_body
from pdserve.router.openai_request import Common
from pdserve.router.openai_tools import ToolStream, call_deltas, tool_message
from pdserve.router.request_stream import Chunk, merged_chunks, stream_chunks


@dataclass
class Collected:
    """One choice's whole output."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list | None = None
    finish_reason: str | None = None
    error: str | None = None
    num_completion_tokens: int = 0

    @classmethod
    def of(cls, chunk: Chunk) -> Collected:
        return cls(list(chunk.token_ids), chunk.text, chunk.logprobs, chunk.finish_reason,
                   chunk.error, chunk.num_completion_tokens)


async def collect(svc, state) -> Collected:
    out = Collected()
    async for chunk in stream_chunks(svc, state):
        out.token_ids += chunk.token_ids
        out.text += chunk.text
        if chunk.logprobs is not None:
            out.logprobs = (out.logprobs or []) + list(chunk.logprobs)
        if chunk.finish_reason is not None:
            out.finish_reason, out.error = chunk.finish_reason, chunk.error
            out.num_completion_tokens = chunk.num_completion_tokens
    return out


async def _choice_chunks(svc, states: list, totals: list[int]):
    """The choices' chunks for an SSE stream, as (index, chunk), counting each choice's
    tokens in ``totals``; a chunk that ends its choice with an error (abort, no rank)
    comes as (None, its OpenAI error event)."""
    async with contextlib.aclosing(merged_chunks(svc, states)) as chunks:
        async for index, chunk in chunks:
            totals[index] = chunk.num_completion_tokens or totals[index] + len(chunk.token_ids)
            if chunk.finish_reason is not None and chunk.finish_reason not in ("stop", "length"):
                yield None, {"error": error_body(_finish_error(chunk))["error"]}
            else:
                yield index, chunk


def _top(entry) -> list[tuple[int, float]]:
    """(token id, logprob) of a TokenLogprobs' alternatives, most likely first."""
    return list(zip(entry.top_ids, entry.top_logprobs, strict=True))


def _openai_finish(reason: str | None) -> str | None:
    return reason if reason in (None, "stop", "length") else "stop"


def _finish_error(chunk) -> HTTPError:
    if chunk.finish_reason == "abort":
        return HTTPError(503, f"the request was aborted: {chunk.error or 'router stopping'}")
    return HTTPError(503, chunk.error or "no rank could serve the request")


def raise_if_failed(choices: list) -> None:
    for ch in choices:
        if ch.finish_reason not in ("stop", "length"):
            raise _finish_error(ch)


def _usage_numbers(prompt: int, completion: int, cached: int = 0) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _cached_tokens(states: list) -> int:
    """Prompt tokens the prefills took from prefix caches, each prompt once."""
    return sum(s.cached_tokens for s in states if s.choice == 0)


def _prompt_tokens(states: list) -> int:
    """Each prompt counts once, however many choices it has."""
    return sum(len(s.request.prompt_token_ids) for s in states if s.choice == 0)


def _usage(states: list, choices: list) -> dict:
    return _usage_numbers(_prompt_tokens(states), sum(ch.num_completion_tokens for ch in choices),
                          _cached_tokens(states))


def _streamed_usage(states: list, totals: list[int]) -> dict:
    return _usage_numbers(_prompt_tokens(states), sum(totals), _cached_tokens(states))


# -- completions ---------------------------------------------------------------------------

def completion_body(tokenizer, model: str, rid: str, states: list, collected: list,
                    c: Common) -> dict:
    return {
        "id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [_completion_choice(tokenizer, i, s, ch, c) for i, (s, ch)
                    in enumerate(zip(states, collected, strict=True))],
        "usage": _usage(states, collected)}


def _completion_choice(tokenizer, index: int, state, ch: Collected, c: Common) -> dict:
    choice = {"index": index, "text": ch.text,
              "logprobs": _completion_logprobs(tokenizer, ch, c) if c.logprobs is not None
              else None, "finish_reason": _openai_finish(ch.finish_reason)}
    if c.return_token_ids:
        choice["token_ids"] = ch.token_ids
        choice["prompt_token_ids"] = list(state.request.prompt_token_ids)
    return choice


def _completion_logprobs(tokenizer, ch: Collected, c: Common, text_offset: int = 0) -> dict:
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = text_offset
    for t, lp in zip(ch.token_ids, ch.logprobs or [], strict=False):
        piece = tokenizer.decode([t], False)
        tokens.append(piece)
        token_lps.append(lp.logprob)
        tops.append({tokenizer.decode([i], False): v for i, v in _top(lp)} if c.logprobs
                    else {})
        offsets.append(offset)
        offset += len(piece)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


async def completion_events(svc, model: str, rid: str, states: list, c: Common):
    created = int(time.time())
    totals = [0] * len(states)
    chars = [0] * len(states)  # text streamed per choice: where a chunk's offsets start
    async with contextlib.aclosing(_choice_chunks(svc, states, totals)) as chunks:
        async for index, chunk in chunks:
            if index is None:  # a choice ended without its output: an error event
                yield chunk
                continue
            choice = {"index": index, "text": chunk.text, "logprobs": (
                _completion_logprobs(svc.tokenizer, Collected.of(chunk), c, chars[index])
                if c.logprobs is not None else None),
                "finish_reason": _openai_finish(chunk.finish_reason)}
            chars[index] += len(chunk.text)
            if c.return_token_ids:
                choice["token_ids"] = chunk.token_ids
            yield {"id": rid, "object": "text_completion", "created": created,
                   "model": model, "choices": [choice]}
    if c.include_usage:
        yield {"id": rid, "object": "text_completion", "created": created, "model": model,
               "choices": [], "usage": _streamed_usage(states, totals)}


# -- chat ----------------------------------------------------------------------------------

def chat_body(tokenizer, model: str, rid: str, states: list, collected: list,
              c: Common) -> dict:
    choices = []
    for index, ch in enumerate(collected):
        message, finish = {"role": "assistant", "content": ch.text}, _openai_finish(
            ch.finish_reason)
        if c.tools is not None and c.tools.parses:  # the answer's calls (openai_tools.py)
            message, finish = tool_message(ch.text, c.tools, finish)
        choice = {"index": index, "message": message,
                  "logprobs": _chat_logprobs(tokenizer, ch) if c.logprobs is not None else None,
                  "finish_reason": finish}
        if c.return_token_ids:
            choice["token_ids"] = ch.token_ids
        choices.append(choice)
    return {"id": rid, "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": _usage(states, collected)}


def _chat_logprobs(tokenizer, ch: Collected) -> dict:
    def entry(token_id: int, value: float) -> dict:
        piece = tokenizer.decode([token_id], False)
        return {"token": piece, "logprob": value, "bytes": list(piece.encode())}

    content = []
    for t, lp in zip(ch.token_ids, ch.logprobs or [], strict=False):
        item = entry(t, lp.logprob)
        item["top_logprobs"] = [entry(i, v) for i, v in _top(lp)]
        content.append(item)
    return {"content": content}


async def chat_events(svc, model: str, rid: str, states: list, c: Common):
    created = int(time.time())
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
    for index in range(len(states)):
        yield {**head, "choices": [{"index": index,
                                    "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}]}
    totals = [0] * len(states)
    tools = [ToolStream(c.tools) for _ in states] if c.tools is not None and c.tools.parses \
        else None
    async with contextlib.aclosing(_choice_chunks(svc, states, totals)) as chunks:
        async for index, chunk in chunks:
            if index is None:  # a choice ended without its output: an error event
                yield chunk
                continue
            if tools is not None:  # the text held where calls may be, the calls at the end
                for event in _tool_events(svc, head, index, chunk, tools[index], c):
                    yield event
                continue
            delta = {"content": chunk.text} if chunk.text or chunk.finish_reason is None else {}
            choice = {"index": index, "delta": delta, "logprobs": (
                _chat_logprobs(svc.tokenizer, Collected.of(chunk)) if c.logprobs is not None
                else None),
                "finish_reason": _openai_finish(chunk.finish_reason)}
            if c.return_token_ids:
                choice["token_ids"] = chunk.token_ids
            yield {**head, "choices": [choice]}
    if c.include_usage:
        yield {**head, "choices": [], "usage": _streamed_usage(states, totals)}


def _tool_events(svc, head: dict, index: int, chunk, stream: ToolStream, c: Common) -> list:
    """A chunk of a choice whose answer may hold tool calls (``ToolStream``): its content
    so far, and at the end the rest of it, each call's deltas and the finish reason
    ("tool_calls" when it made calls); the chunk's logprobs and token ids go on the last."""
    text = stream.feed(chunk.text)
    extra = {"logprobs": _chat_logprobs(svc.tokenizer, Collected.of(chunk))
             if c.logprobs is not None else None}
    if c.return_token_ids:
        extra["token_ids"] = chunk.token_ids
    if chunk.finish_reason is None:
        if not text and extra["logprobs"] is None and not c.return_token_ids:
            return []
        return [{**head, "choices": [{"index": index, "delta": {"content": text}, **extra,
                                      "finish_reason": None}]}]
    rest, calls = stream.finish()
    deltas = ([{"content": text + rest}] if text + rest else []) + call_deltas(calls)
    events = [{**head, "choices": [{"index": index, "delta": d, "logprobs": None,
                                    "finish_reason": None}]} for d in deltas]
    finish = "tool_calls" if calls else _openai_finish(chunk.finish_reason)
    events.append({**head, "choices": [{"index": index, "delta": {}, **extra,
                                        "finish_reason": finish}]})
    return events
