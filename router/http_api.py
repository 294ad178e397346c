"""The OpenAI-compatible HTTP front: FastAPI on the router's own asyncio loop (uvicorn).

1. A call authenticates with the same tokens as gRPC (``Authorization: Bearer``;
   `/health` and `/metrics` stay open, as gRPC health and the metrics port do).
2. Its JSON body is checked field by field (``openai_request``: OpenAI's names; vLLM's
   extensions where users rely on them); a field pdserve does not support yet is a 400
   that says so.
3. Each prompt becomes a ``GenerateRequest`` that goes through the same
   ``validation.prepare`` and ``RouterService.admit`` as gRPC: one validation, one
   admission, one set of limits.
4. Its output streams through ``request_stream.stream_chunks`` (stop strings, logprobs,
   exactly-once ending); the response is OpenAI's schema, or SSE chunks when streamed
   (``openai_response``).
5. Errors are OpenAI error objects: 400 naming the field, 401, 404 (unknown model), 429
   (queue full), 503 (no rank could serve it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.responses import StreamingResponse

from pdserve.router.auth import Authenticator, AuthError
from pdserve.router.embedded_ray import public_binds
from pdserve.router.openai_errors import HTTPError, body_field, error_body
from pdserve.router.openai_request import (
    Common,
    chat_fields,
    completion_fields,
    generate_request,
    http_error,
)
from pdserve.router.openai_response import (
    chat_body,
    chat_events,
    collect,
    completion_body,
    completion_events,
    raise_if_failed,
)
from pdserve.router.openai_structured import ADVISORY_HEADER, advisories
from pdserve.router.openai_tools import chat_inputs
from pdserve.router.request_error import RequestError
from pdserve.router.validation import prepare

MAX_BODY_BYTES = 16 << 20

log = logging.getLogger(__name__)


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
                req = generate_request(prompt, c)
                prepared = await asyncio.to_thread(prepare, req, svc.tokenizer, svc.limits,
                                                   svc.config.default_max_tokens)
                states += svc.admit(prepared, tenant=tenant)  # n choices, in order
        except RequestError as exc:
            self._end_all(states)
            raise http_error(exc, c) from None
        except BaseException:
            self._end_all(states)
            raise
        return states

    def _end_all(self, states: list) -> None:
        """End and release requests no stream will read (no await: cancel-safe)."""
        for state in states:
            self.svc.end_now(state, "another prompt of the same call was refused")
            self.svc.tracker.release(state.rid)

    async def completions(self, request):
        tenant = self.authenticate(request)
        body = await self.body(request)
        c, prompts = completion_fields(body)
        states = await self.admit(prompts, c, tenant)
        rid = f"cmpl-{states[0].rid}"
        headers = self._advice(c)
        if c.stream:
            return self._sse(completion_events(self.svc, self.model_name, rid, states, c),
                             headers)
        collected = await asyncio.gather(*(collect(self.svc, s) for s in states))
        raise_if_failed(collected)
        return JSONResponse(completion_body(self.svc.tokenizer, self.model_name, rid, states,
                                            collected, c), headers=headers)

    async def chat(self, request):
        tenant = self.authenticate(request)
        body = await self.body(request)
        c = chat_fields(body)
        prompt_ids = self._chat_prompt_ids(self._render_chat(body, c))
        states = await self.admit([prompt_ids], c, tenant)
        rid = f"chatcmpl-{states[0].rid}"
        headers = self._advice(c)
        if c.stream:
            return self._sse(chat_events(self.svc, self.model_name, rid, states, c), headers)
        collected = await asyncio.gather(*(collect(self.svc, s) for s in states))
        raise_if_failed(collected)
        return JSONResponse(chat_body(self.svc.tokenizer, self.model_name, rid, states,
                                      collected, c), headers=headers)

    @staticmethod
    def _advice(c: Common) -> dict[str, str]:
        """The response's header naming what a loose JSON schema asks that the grammar
        does not enforce (``openai_structured.advisories``), logged too."""
        advice = advisories(c.structured_output)
        if not advice:
            return {}
        text = "; ".join(advice)
        log.warning("a JSON schema's keywords only advise (the grammar does not enforce "
                    "them): %s", text[:500])
        return {ADVISORY_HEADER: text.encode("ascii", "backslashreplace").decode()[:2000]}

    def _render_chat(self, body: dict, c: Common) -> str:
        """The conversation in ``messages`` as the model's chat template writes it, with
        the tools (``openai_tools.chat_inputs``: the template's, or the Hermes fallback)."""
        if self.chat_template is None:
            raise HTTPError(400, f"the model {self.model_name!r} has no chat template "
                            "(neither its folder nor its GGUF file carries one); use /v1/completions",
                            "messages")
        if "messages" not in body:
            raise HTTPError(400, "messages is required", "messages")
        messages, tools = chat_inputs(self.chat_template, body["messages"], c.tools)
        try:
            return self.chat_template.render(
                messages, True,
                chat_template_kwargs=body_field(body, "chat_template_kwargs", (dict,), {}),
                **tools)
        except ValueError as exc:
            raise HTTPError(400, str(exc), "messages") from None

    def _chat_prompt_ids(self, prompt: str) -> list[int]:
        """The rendered conversation's ids: the template writes its own special tokens
        (a BOS among them), so none is added again."""
        encode = getattr(self.chat_template, "encode", None)
        if encode is not None:
            return list(encode(self.svc.tokenizer, prompt))
        return list(self.svc.tokenizer.encode(prompt))

    def _sse(self, events, headers: dict[str, str]):
        async def lines():
            try:
                async for event in events:
                    yield f"data: {json.dumps(event)}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                await events.aclose()  # ends the requests of a stream the client left

        return _ClosingStream(lines(), media_type="text/event-stream",
                              headers={"Cache-Control": "no-cache", **headers})


class _ClosingStream(StreamingResponse):
    """A StreamingResponse that closes its body generator however the response ends:
    Starlette stops iterating when the client is gone (a failed send) but leaves the
    generator suspended, which would leave its requests running until it is collected."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


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
