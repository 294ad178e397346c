"""The OpenAI-compatible HTTP front: FastAPI on the router's own asyncio loop (uvicorn).

1. A call authenticates with the same tokens as gRPC (``Authorization: Bearer``;
   `/health` and `/metrics` stay open, as gRPC health and the metrics port do).
2. Its JSON body is checked field by field (OpenAI's names; vLLM's extensions where
   users rely on them); a field pdserve does not support yet is a 400 that says so.
3. Each prompt becomes a ``GenerateRequest`` that goes through the same
   ``validation.prepare`` and ``RouterService.admit`` as gRPC: one validation, one
   admission, one set of limits.
4. Its output streams through ``request_stream.stream_chunks`` (stop strings, logprobs,
   exactly-once ending); the response is OpenAI's schema, or SSE chunks when streamed.
5. Errors are OpenAI error objects: 400 naming the field, 401, 404 (unknown model), 429
   (queue full), 503 (no rank could serve it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.responses import StreamingResponse

from pdserve.router.auth import Authenticator, AuthError
from pdserve.router.request_stream import Chunk, merged_chunks, stream_chunks
from pdserve.router.validation import RequestError, prepare
from pdserve.rpc import router_pb2

MAX_BODY_BYTES = 16 << 20
MAX_PROMPTS = 64  # prompts in one /v1/completions call
MAX_LOGPROBS = 20
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
}
ERROR_TYPE = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
              404: "NotFoundError", 409: "ConflictError", 429: "RateLimitError",
              503: "ServiceUnavailableError", 500: "InternalServerError"}
# Fields OpenAI defines that pdserve does not do yet: refused, never ignored.
UNSUPPORTED = {
    "completions": ("suffix", "echo", "best_of", "logit_bias", "presence_penalty",
                    "frequency_penalty", "min_tokens"),
    "chat": ("tools", "tool_choice", "functions", "function_call", "response_format",
             "logit_bias", "presence_penalty", "frequency_penalty", "audio", "modalities",
             "prediction", "web_search_options", "min_tokens"),
}
# Accepted and without effect on the output (documented): labels and hints.
IGNORED = ("user", "metadata", "store", "service_tier", "parallel_tool_calls")


class HTTPError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def _request_error(exc: RequestError) -> HTTPError:
    status = HTTP_STATUS.get(exc.code, 500)
    return HTTPError(status, exc.message, _param_of(exc.message))


def _param_of(message: str) -> str | None:
    first = message.split(" ", 1)[0].split("[", 1)[0]
    return first if first.isidentifier() else None


def error_body(err: HTTPError) -> dict:
    return {"error": {"message": err.message, "type": ERROR_TYPE.get(err.status, "Error"),
                      "param": err.param, "code": err.status}}


# -- request fields ----------------------------------------------------------------------

def _field(body: dict, name: str, kinds: tuple, default: Any = None) -> Any:
    if name not in body or body[name] is None:
        return default
    value = body[name]
    if isinstance(value, bool) and bool not in kinds:  # JSON true is not a number here
        raise HTTPError(400, f"{name} must be {_kind_names(kinds)}, got {json.dumps(value)}",
                        name)
    if not isinstance(value, kinds):
        raise HTTPError(400, f"{name} must be {_kind_names(kinds)}, got {json.dumps(value)[:80]}",
                        name)
    return value


def _kind_names(kinds: tuple) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
             list: "a list", dict: "an object"}
    return " or ".join(dict.fromkeys(names[k] for k in kinds))


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


def _common(body: dict, endpoint: str, logprobs: int | None) -> Common:
    for name in UNSUPPORTED[endpoint]:
        if body.get(name) not in (None, 0, False, [], {}):
            raise HTTPError(400, f"{name} is not supported by pdserve yet", name)
    n = _field(body, "n", (int,), 1)
    if n < 1:  # the upper bound (max_choices) is the shared validation's
        raise HTTPError(400, f"n must be >= 1, got {n}", "n")
    stop = _field(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) for s in stop):
        raise HTTPError(400, "stop must be a string or a list of strings", "stop")
    stop_ids = _field(body, "stop_token_ids", (list,), [])
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise HTTPError(400, "stop_token_ids must be a list of integers", "stop_token_ids")
    stream = _field(body, "stream", (bool,), False)
    options = _field(body, "stream_options", (dict,), {})
    if options and not stream:
        raise HTTPError(400, "stream_options is only allowed with stream: true",
                        "stream_options")
    include_usage = bool(_field(options, "include_usage", (bool,), False)) if options else False
    _field(body, "user", (str,))  # a label: checked, not used
    max_tokens = _field(body, "max_tokens", (int,))
    if endpoint == "chat":
        max_tokens = _field(body, "max_completion_tokens", (int,), max_tokens)
    if max_tokens is not None and max_tokens < 1:
        raise HTTPError(400, f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
    temperature = _field(body, "temperature", (int, float))
    top_p = _field(body, "top_p", (int, float))
    seed = _field(body, "seed", (int,))
    top_k = _field(body, "top_k", (int,))
    return Common(
        max_tokens=max_tokens,
        temperature=None if temperature is None else float(temperature),
        top_p=None if top_p is None else float(top_p), top_k=top_k, seed=seed, stop=stop,
        stop_token_ids=stop_ids, ignore_eos=_field(body, "ignore_eos", (bool,), False),
        include_stop_str_in_output=_field(body, "include_stop_str_in_output", (bool,), False),
        logprobs=logprobs, stream=stream, include_usage=include_usage,
        return_token_ids=_field(body, "return_token_ids", (bool,), False), n=n)


def _check_int32(name: str, ids: list[int]) -> None:
    # The proto's ids are int32: a larger JSON integer is a bad field, not a crash.
    if any(not -2**31 <= t < 2**31 for t in ids):
        raise HTTPError(400, f"{name} holds a token id outside the 32-bit range", name)


def _grpc_request(prompt: str | list[int], c: Common) -> router_pb2.GenerateRequest:
    _check_int32("stop_token_ids", c.stop_token_ids)
    if not isinstance(prompt, str):
        _check_int32("prompt", prompt)
    req = router_pb2.GenerateRequest(stop=c.stop, stop_token_ids=c.stop_token_ids,
                                     ignore_eos=c.ignore_eos,
                                     include_stop_str_in_output=c.include_stop_str_in_output)
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
        if not prompt:
            req.token_ids.SetInParent()
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs", "n"):
        value = getattr(c, name)
        if value is not None:
            if name in ("max_tokens", "top_k", "logprobs", "n") and not -2**31 <= value < 2**31:
                raise HTTPError(400, f"{name} is out of range: {value}", name)
            if name in ("temperature", "top_p") and not math.isfinite(value):
                raise HTTPError(400, f"{name} must be a finite number, got {value}", name)
            try:
                setattr(req, name, value)
            except (ValueError, AttributeError) as exc:  # a field this proto lacks
                raise HTTPError(400, f"{name}: {exc}", name) from exc
    return req


def _prompts(body: dict) -> list[str | list[int]]:
    if "prompt" not in body:
        raise HTTPError(400, "prompt is required", "prompt")
    p = body["prompt"]
    if isinstance(p, str):
        return [p]
    if isinstance(p, list) and p and all(isinstance(x, int) and not isinstance(x, bool)
                                         for x in p):
        return [p]
    if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        prompts = p
    elif isinstance(p, list) and p and all(
            isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                        for t in x) for x in p):
        prompts = p
    else:
        raise HTTPError(400, "prompt must be a string, a list of strings, a list of token "
                        "ids or a list of token-id lists (not empty)", "prompt")
    if len(prompts) > MAX_PROMPTS:
        raise HTTPError(400, f"prompt may hold at most {MAX_PROMPTS} prompts, got "
                        f"{len(prompts)}", "prompt")
    return prompts


# -- the app -------------------------------------------------------------------------------

class OpenAIFront:
    """The endpoints, bound to one RouterService and Authenticator."""

    def __init__(self, svc, auth: Authenticator, model_name: str, chat_template=None) -> None:
        self.svc = svc
        self.auth = auth
        self.model_name = model_name
        self.chat_template = chat_template
        self.created = int(time.time())

    def authenticate(self, request) -> str:
        header = request.headers.get("authorization")
        metadata = [("authorization", header)] if header is not None else []
        try:
            return self.auth.authenticate(metadata).tenant
        except AuthError as exc:
            raise HTTPError(401, exc.message) from None

    async def body(self, request) -> dict:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            raise HTTPError(413, f"the request body must be at most {MAX_BODY_BYTES} bytes")
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise HTTPError(413, f"the request body must be at most {MAX_BODY_BYTES} bytes")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise HTTPError(400, f"the request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise HTTPError(400, "the request body must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise HTTPError(400, "model is required (a string)", "model")
        if model != self.model_name:
            raise HTTPError(404, f"the model {model!r} does not exist; this server serves "
                            f"{self.model_name!r}", "model")
        return body

    def models(self) -> dict:
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created,
            "owned_by": "pdserve", "max_model_len": self.svc.limits.max_model_len}]}

    async def admit(self, prompts: list, c: Common, tenant: str) -> list:
        svc = self.svc
        states = []
        try:
            for prompt in prompts:
                req = _grpc_request(prompt, c)
                prepared = await asyncio.to_thread(prepare, req, svc.tokenizer, svc.limits,
                                                   svc.config.default_max_tokens)
                states += svc.admit(prepared, tenant=tenant)  # n choices, in order
        except RequestError as exc:
            self._end_all(states)
            raise _request_error(exc) from None
        except BaseException:
            self._end_all(states)
            raise
        return states

    def _end_all(self, states: list) -> None:
        """End and release requests no stream will read (no await: cancel-safe)."""
        for state in states:
            self.svc.end_now(state, "another prompt of the same call was refused")
            self.svc.tracker.release(state.rid)

    # -- completions --------------------------------------------------------------------

    async def completions(self, request):
        tenant = self.authenticate(request)
        body = await self.body(request)
        logprobs = _field(body, "logprobs", (int,))
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise HTTPError(400, f"logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}",
                            "logprobs")
        c = _common(body, "completions", logprobs)
        prompts = _prompts(body)
        states = await self.admit(prompts, c, tenant)
        rid = f"cmpl-{states[0].rid}"
        if c.stream:
            return self._sse(self._completion_events(rid, states, c))
        choices = await asyncio.gather(*(_collect(self.svc, s) for s in states))
        _raise_if_failed(choices)
        return {
            "id": rid, "object": "text_completion", "created": int(time.time()),
            "model": self.model_name,
            "choices": [self._completion_choice(i, s, ch, c) for i, (s, ch)
                        in enumerate(zip(states, choices, strict=True))],
            "usage": _usage(states, choices)}

    def _completion_choice(self, index: int, state, ch: _Collected, c: Common) -> dict:
        choice = {"index": index, "text": ch.text,
                  "logprobs": self._completion_logprobs(ch, c) if c.logprobs is not None
                  else None, "finish_reason": _openai_finish(ch.finish_reason)}
        if c.return_token_ids:
            choice["token_ids"] = ch.token_ids
            choice["prompt_token_ids"] = list(state.request.prompt_token_ids)
        return choice

    def _completion_logprobs(self, ch, c: Common, text_offset: int = 0) -> dict:
        tok = self.svc.tokenizer
        tokens, token_lps, tops, offsets = [], [], [], []
        offset = text_offset
        for t, lp in zip(ch.token_ids, ch.logprobs or [], strict=False):
            piece = tok.decode([t], False)
            tokens.append(piece)
            token_lps.append(lp.logprob)
            tops.append({tok.decode([i], False): v for i, v in _top(lp)} if c.logprobs else {})
            offsets.append(offset)
            offset += len(piece)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                "text_offset": offsets}

    async def _completion_events(self, rid: str, states: list, c: Common):
        created = int(time.time())
        totals = [0] * len(states)
        chars = [0] * len(states)  # text streamed per choice: where a chunk's offsets start
        async with contextlib.aclosing(_choice_chunks(self.svc, states, totals)) as chunks:
            async for index, chunk in chunks:
                if index is None:  # a choice ended without its output: an error event
                    yield chunk
                    continue
                choice = {"index": index, "text": chunk.text, "logprobs": (
                    self._completion_logprobs(_Collected.of(chunk), c, chars[index])
                    if c.logprobs is not None else None),
                    "finish_reason": _openai_finish(chunk.finish_reason)}
                chars[index] += len(chunk.text)
                if c.return_token_ids:
                    choice["token_ids"] = chunk.token_ids
                yield {"id": rid, "object": "text_completion", "created": created,
                       "model": self.model_name, "choices": [choice]}
        if c.include_usage:
            yield {"id": rid, "object": "text_completion", "created": created,
                   "model": self.model_name, "choices": [],
                   "usage": _usage_numbers(_prompt_tokens(states), sum(totals),
                                           _cached_tokens(states))}

    # -- chat -------------------------------------------------------------------------------

    async def chat(self, request):
        tenant = self.authenticate(request)
        body = await self.body(request)
        want = _field(body, "logprobs", (bool,), False)
        top = _field(body, "top_logprobs", (int,))
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise HTTPError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}",
                            "top_logprobs")
        if top is not None and not want:
            raise HTTPError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        c = _common(body, "chat", (top or 0) if want else None)
        if self.chat_template is None:
            raise HTTPError(400, f"the model {self.model_name!r} has no chat template "
                            "(neither its folder nor its GGUF file carries one); use /v1/completions",
                            "messages")
        if "messages" not in body:
            raise HTTPError(400, "messages is required", "messages")
        try:
            prompt = self.chat_template.render(
                body["messages"], True,
                chat_template_kwargs=_field(body, "chat_template_kwargs", (dict,), {}))
        except ValueError as exc:
            raise HTTPError(400, str(exc), "messages") from None
        prompt_ids = self._chat_prompt_ids(prompt)
        states = await self.admit([prompt_ids], c, tenant)
        rid = f"chatcmpl-{states[0].rid}"
        if c.stream:
            return self._sse(self._chat_events(rid, states, c))
        collected = await asyncio.gather(*(_collect(self.svc, s) for s in states))
        _raise_if_failed(collected)
        choices = []
        for index, ch in enumerate(collected):
            choice = {"index": index, "message": {"role": "assistant", "content": ch.text},
                      "logprobs": self._chat_logprobs(ch) if c.logprobs is not None else None,
                      "finish_reason": _openai_finish(ch.finish_reason)}
            if c.return_token_ids:
                choice["token_ids"] = ch.token_ids
            choices.append(choice)
        return {"id": rid, "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices, "usage": _usage(states, collected)}

    def _chat_prompt_ids(self, prompt: str) -> list[int]:
        """The rendered conversation's ids: the template writes its own special tokens
        (a BOS among them), so none is added again."""
        encode = getattr(self.chat_template, "encode", None)
        if encode is not None:
            return list(encode(self.svc.tokenizer, prompt))
        return list(self.svc.tokenizer.encode(prompt))

    def _chat_logprobs(self, ch) -> dict:
        tok = self.svc.tokenizer

        def entry(token_id: int, value: float) -> dict:
            piece = tok.decode([token_id], False)
            return {"token": piece, "logprob": value, "bytes": list(piece.encode())}

        content = []
        for t, lp in zip(ch.token_ids, ch.logprobs or [], strict=False):
            item = entry(t, lp.logprob)
            item["top_logprobs"] = [entry(i, v) for i, v in _top(lp)]
            content.append(item)
        return {"content": content}

    async def _chat_events(self, rid: str, states: list, c: Common):
        created = int(time.time())
        head = {"id": rid, "object": "chat.completion.chunk", "created": created,
                "model": self.model_name}
        for index in range(len(states)):
            yield {**head, "choices": [{"index": index,
                                        "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}]}
        totals = [0] * len(states)
        async with contextlib.aclosing(_choice_chunks(self.svc, states, totals)) as chunks:
            async for index, chunk in chunks:
                if index is None:  # a choice ended without its output: an error event
                    yield chunk
                    continue
                delta = {"content": chunk.text} if chunk.text or chunk.finish_reason is None else {}
                choice = {"index": index, "delta": delta, "logprobs": (
                    self._chat_logprobs(_Collected.of(chunk)) if c.logprobs is not None else None),
                    "finish_reason": _openai_finish(chunk.finish_reason)}
                if c.return_token_ids:
                    choice["token_ids"] = chunk.token_ids
                yield {**head, "choices": [choice]}
        if c.include_usage:
            yield {**head, "choices": [],
                   "usage": _usage_numbers(_prompt_tokens(states), sum(totals),
                                           _cached_tokens(states))}

    # -- plumbing ---------------------------------------------------------------------------

    def _sse(self, events):
        async def lines():
            try:
                async for event in events:
                    yield f"data: {json.dumps(event)}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                await events.aclose()  # ends the requests of a stream the client left

        return _ClosingStream(lines(), media_type="text/event-stream",
                              headers={"Cache-Control": "no-cache"})


class _ClosingStream(StreamingResponse):
    """A StreamingResponse that closes its body generator however the response ends:
    Starlette stops iterating when the client is gone (a failed send) but leaves the
    generator suspended, which would leave its requests running until it is collected."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


@dataclass
class _Collected:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list | None = None
    finish_reason: str | None = None
    error: str | None = None
    num_completion_tokens: int = 0

    @classmethod
    def of(cls, chunk: Chunk) -> _Collected:
        return cls(list(chunk.token_ids), chunk.text, chunk.logprobs, chunk.finish_reason,
                   chunk.error, chunk.num_completion_tokens)


async def _collect(svc, state) -> _Collected:
    out = _Collected()
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


def _raise_if_failed(choices: list) -> None:
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


def build_app(front: OpenAIFront) -> FastAPI:
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None)

    def error_response(err: HTTPError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
        return JSONResponse(error_body(err), status_code=err.status, headers=headers)

    @app.exception_handler(HTTPError)
    async def _on_error(request, exc: HTTPError):
        return error_response(exc)

    @app.get("/health")
    async def health():
        return PlainTextResponse("ok")

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(front.svc.metrics.text(),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request):
        front.authenticate(request)
        return front.models()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await front.completions(request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await front.chat(request)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def unknown(path: str):
        return error_response(HTTPError(404, f"no such endpoint: /{path}"))

    return app


class HTTPServer:
    """uvicorn serving the app on the router's loop, on a socket bound up front (TLS
    with the router's certificate when it has one)."""

    def __init__(self, app, sock, tls_cert_file: str | None = None,
                 tls_key_file: str | None = None) -> None:
        import uvicorn

        self.sock = sock
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False,
                                timeout_graceful_shutdown=2, ssl_certfile=tls_cert_file,
                                ssl_keyfile=tls_key_file)
        self.server = uvicorn.Server(config)
        self.task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[sock]))

    async def wait_started(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if self.task.done():
                self.task.result()  # raises what stopped it
                raise RuntimeError("the HTTP server stopped before it started")
            if time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start in time")
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        self.server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self.task), 5)
        except Exception:
            self.task.cancel()
        self.sock.close()


def bind_socket(host: str, port: int):
    import socket

    from pdserve.router.embedded_ray import public_binds

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        with public_binds(host):
            sock.bind((host.strip("[]"), port))
    except OSError:
        sock.close()
        raise
    sock.listen(1024)
    sock.setblocking(False)
    return sock


async def start_http(svc, auth: Authenticator, config) -> HTTPServer:
    """The HTTP front of a started RouterService on config.host:http_port."""
    front = OpenAIFront(svc, auth, config.model_name, svc.chat_template)
    port = config.http_port if config.http_port is not None else (
        config.port + 2 if config.port else 0)
    sock = bind_socket(config.host, port)
    server = HTTPServer(build_app(front), sock, config.tls_cert_file, config.tls_key_file)
    await server.wait_started()
    return server
