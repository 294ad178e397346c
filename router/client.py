"""Python clients for the router: `Client` (blocking) and `AsyncClient` (asyncio).

    from pdserve.router.client import Client
    with Client("127.0.0.1:50051") as c:
        out = c.generate("def add(x, y):", max_tokens=16, temperature=0)
        print(out.text, out.finish_reason)
        for chunk in c.stream("hello", max_tokens=8):
            print(chunk.text, end="", flush=True)
        # a conversation, rendered by the model's chat template on the router
        chat = [{"role": "user", "content": "What is the capital of France?"}]
        print(c.generate(chat, max_tokens=32, temperature=0).text)

Errors surface as `grpc.RpcError` (code() and details() say what was wrong).

A router with tokens (SECURITY.md) wants ``token=`` (sent as ``authorization: Bearer``
metadata on every call); one serving TLS wants ``tls_ca_file=`` (the CA that signed its
certificate; ``tls_server_name=`` when the address is not a name the certificate holds).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import grpc

from pdserve.rpc import router_pb2, router_pb2_grpc

DEFAULT_ADDRESS = "127.0.0.1:50051"
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 16 << 20),
    ("grpc.max_send_message_length", 16 << 20),
]


@dataclass
class Completion:
    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    error: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens the prefill took from a prefix cache
    num_messages: int = 0
    # router_pb2.TokenLogprob per token (logprob, top_token_ids, top_logprobs), aligned
    # with token_ids when the request asked for logprobs; empty otherwise.
    logprobs: list = field(default_factory=list)

    def add(self, msg: router_pb2.GenerateResponse) -> None:
        self.request_id = msg.request_id or self.request_id
        self.token_ids.extend(msg.token_ids)
        self.logprobs.extend(msg.logprobs)
        self.text += msg.text
        self.num_messages += 1
        if msg.finish_reason:
            self.finish_reason = msg.finish_reason
            self.error = msg.error
            self.prompt_tokens = msg.usage.prompt_tokens
            self.completion_tokens = msg.usage.completion_tokens
            self.cached_prompt_tokens = msg.usage.cached_prompt_tokens

    def to_dict(self) -> dict:
        d = {"request_id": self.request_id, "token_ids": self.token_ids, "text": self.text,
             "finish_reason": self.finish_reason, "error": self.error,
             "usage": {"prompt_tokens": self.prompt_tokens,
                       "completion_tokens": self.completion_tokens,
                       "cached_prompt_tokens": self.cached_prompt_tokens}}
        if self.logprobs:
            d["logprobs"] = [{"logprob": lp.logprob, "top_token_ids": list(lp.top_token_ids),
                              "top_logprobs": list(lp.top_logprobs)} for lp in self.logprobs]
        return d


def build_request(prompt: str | Sequence[int] | Sequence[Mapping[str, str]], *,
                  request_id: str = "",
                  max_tokens: int | None = None, temperature: float | None = None,
                  top_p: float | None = None, top_k: int | None = None,
                  seed: int | None = None, stop_token_ids: Sequence[int] = (),
                  ignore_eos: bool = False, stop: Sequence[str] = (),
                  include_stop_str_in_output: bool = False,
                  logprobs: int | None = None, n: int | None = None,
                  presence_penalty: float | None = None, frequency_penalty: float | None = None,
                  repetition_penalty: float | None = None, min_tokens: int | None = None,
                  min_p: float | None = None, logit_bias: Mapping[int, float] | None = None,
                  bad_words: Sequence[str] = (),
                  structured_output: router_pb2.StructuredOutput | Mapping | None = None,
                  ) -> router_pb2.GenerateRequest:
    """A GenerateRequest (router.proto documents each field). ``structured_output``: a
    StructuredOutput message, or one of ``{"json_schema": schema (a dict or its JSON
    text)}``, ``{"regex": str}``, ``{"grammar": str}``, ``{"choice": [str, ...]}``,
    ``{"json_object": True}``."""
    req = router_pb2.GenerateRequest(request_id=request_id, stop_token_ids=list(stop_token_ids),
                                     ignore_eos=ignore_eos, stop=list(stop),
                                     include_stop_str_in_output=include_stop_str_in_output,
                                     logit_bias=dict(logit_bias or {}), bad_words=list(bad_words))
    if structured_output is not None:
        req.structured_output.CopyFrom(structured_output_message(structured_output))
    if isinstance(prompt, str):
        req.text = prompt
    elif prompt and isinstance(prompt[0], Mapping):  # a conversation: [{role, content}, ...]
        req.chat.messages.extend(router_pb2.ChatMessage(role=m["role"], content=m["content"])
                                 for m in prompt)
    else:
        req.token_ids.ids.extend(int(t) for t in prompt)
        if not req.token_ids.ids:
            req.token_ids.SetInParent()  # an explicit, empty token list
    for name, value in (("max_tokens", max_tokens), ("temperature", temperature),
                        ("top_p", top_p), ("top_k", top_k), ("seed", seed),
                        ("logprobs", logprobs), ("n", n),
                        ("presence_penalty", presence_penalty),
                        ("frequency_penalty", frequency_penalty),
                        ("repetition_penalty", repetition_penalty),
                        ("min_tokens", min_tokens), ("min_p", min_p)):
        if value is not None:
            setattr(req, name, value)
    return req


def structured_output_message(spec: router_pb2.StructuredOutput | Mapping
                              ) -> router_pb2.StructuredOutput:
    """``{kind: value}`` (one entry, and ``"loose": True`` beside a json_schema whose
    keywords the grammar cannot enforce may only advise) as a StructuredOutput message;
    a message as is."""
    if isinstance(spec, router_pb2.StructuredOutput):
        return spec
    spec = dict(spec)
    loose = bool(spec.pop("loose", False))
    if len(spec) != 1:
        raise ValueError("structured_output must hold one of json_schema, json_object, "
                         "regex, grammar, choice")
    (kind, value), = spec.items()
    if kind == "choice":
        return router_pb2.StructuredOutput(choice=router_pb2.ChoiceList(choices=list(value)))
    if kind == "json_schema" and not isinstance(value, str):
        value = json.dumps(value)
    return router_pb2.StructuredOutput(**{kind: value}, loose=loose)


def channel_credentials(tls_ca_file: str | None) -> grpc.ChannelCredentials | None:
    if not tls_ca_file:
        return None
    with open(tls_ca_file, "rb") as f:
        return grpc.ssl_channel_credentials(root_certificates=f.read())


def _channel_options(tls_server_name: str | None) -> list:
    if tls_server_name:
        return CHANNEL_OPTIONS + [("grpc.ssl_target_name_override", tls_server_name)]
    return CHANNEL_OPTIONS


def _call_metadata(token: str | None) -> tuple:
    if token is None:
        return ()
    token = token.strip()
    if not token or not token.isprintable() or any(c.isspace() for c in token):
        raise ValueError("token must be non-empty printable text without spaces")
    return (("authorization", f"Bearer {token}"),)


def _one_choice(kwargs: dict) -> None:
    if kwargs.get("n") not in (None, 1):
        raise ValueError("generate() returns one completion: use generate_choices(prompt, n)")


def step_dicts(timeline: router_pb2.Timeline) -> list[dict]:
    """A Timeline's step records as plain dicts (every field)."""
    names = [f.name for f in router_pb2.StepRecord.DESCRIPTOR.fields]
    return [{n: getattr(s, n) for n in names} for s in timeline.steps]


class Client:
    """Blocking client. `timeout` (seconds) becomes the gRPC deadline of each call."""

    def __init__(self, address: str = DEFAULT_ADDRESS, timeout: float | None = None, *,
                 token: str | None = None, tls_ca_file: str | None = None,
                 tls_server_name: str | None = None) -> None:
        self.address = address
        self.timeout = timeout
        self._metadata = _call_metadata(token)
        creds = channel_credentials(tls_ca_file)
        options = _channel_options(tls_server_name)
        self._channel = (grpc.secure_channel(address, creds, options=options) if creds
                         else grpc.insecure_channel(address, options=options))
        self._stub = router_pb2_grpc.RouterStub(self._channel)

    def __repr__(self) -> str:  # never the token
        return f"Client({self.address!r})"

    def stream(self, prompt, **kwargs) -> Iterator[router_pb2.GenerateResponse]:
        timeout = kwargs.pop("timeout", self.timeout)
        call = self._stub.Generate(build_request(prompt, **kwargs), timeout=timeout,
                                   metadata=self._metadata)
        try:
            yield from call
        finally:  # left early (an exception, Ctrl-C, a break): the router aborts it
            call.cancel()

    def generate(self, prompt, **kwargs) -> Completion:
        _one_choice(kwargs)
        out = Completion()
        for msg in self.stream(prompt, **kwargs):
            out.add(msg)
        return out

    def generate_choices(self, prompt, n: int, **kwargs) -> list[Completion]:
        """n completions of one prompt (one prefill), by choice index."""
        outs = [Completion() for _ in range(n)]
        for msg in self.stream(prompt, n=n, **kwargs):
            outs[msg.index].add(msg)
        return outs

    def abort(self, request_id: str) -> bool:
        return self._stub.Abort(router_pb2.AbortRequest(request_id=request_id),
                                timeout=self.timeout, metadata=self._metadata).found

    def cluster_state(self, timeout: float | None = None) -> router_pb2.ClusterState:
        return self._stub.GetClusterState(router_pb2.ClusterStateRequest(),
                                          timeout=timeout or self.timeout,
                                          metadata=self._metadata)

    def scale(self, pool: str, replicas: int, timeout: float | None = None) -> router_pb2.ScalePoolResponse:
        return self._stub.ScalePool(router_pb2.ScalePoolRequest(pool=pool, replicas=replicas),
                                    timeout=timeout or self.timeout, metadata=self._metadata)

    def timeline(self, since: float = 0.0, timeout: float | None = None) -> list[dict]:
        """Engine steps of every live rank that ended after unix time `since`."""
        reply = self._stub.GetTimeline(router_pb2.TimelineRequest(since=since),
                                       timeout=timeout or self.timeout, metadata=self._metadata)
        return step_dicts(reply)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """asyncio client; use inside a running event loop."""

    def __init__(self, address: str = DEFAULT_ADDRESS, timeout: float | None = None, *,
                 token: str | None = None, tls_ca_file: str | None = None,
                 tls_server_name: str | None = None) -> None:
        self.address = address
        self.timeout = timeout
        self._metadata = _call_metadata(token)
        creds = channel_credentials(tls_ca_file)
        options = _channel_options(tls_server_name)
        self._channel = (grpc.aio.secure_channel(address, creds, options=options) if creds
                         else grpc.aio.insecure_channel(address, options=options))
        self._stub = router_pb2_grpc.RouterStub(self._channel)

    def __repr__(self) -> str:  # never the token
        return f"AsyncClient({self.address!r})"

    async def stream(self, prompt, **kwargs) -> AsyncIterator[router_pb2.GenerateResponse]:
        timeout = kwargs.pop("timeout", self.timeout)
        async for msg in self._stub.Generate(build_request(prompt, **kwargs), timeout=timeout,
                                             metadata=self._metadata):
            yield msg

    async def generate(self, prompt, **kwargs) -> Completion:
        _one_choice(kwargs)
        out = Completion()
        async for msg in self.stream(prompt, **kwargs):
            out.add(msg)
        return out

    async def generate_choices(self, prompt, n: int, **kwargs) -> list[Completion]:
        """n completions of one prompt (one prefill), by choice index."""
        outs = [Completion() for _ in range(n)]
        async for msg in self.stream(prompt, n=n, **kwargs):
            outs[msg.index].add(msg)
        return outs

    async def abort(self, request_id: str) -> bool:
        reply = await self._stub.Abort(router_pb2.AbortRequest(request_id=request_id),
                                       timeout=self.timeout, metadata=self._metadata)
        return reply.found

    async def cluster_state(self) -> router_pb2.ClusterState:
        return await self._stub.GetClusterState(router_pb2.ClusterStateRequest(),
                                                timeout=self.timeout, metadata=self._metadata)

    async def scale(self, pool: str, replicas: int,
                    timeout: float | None = None) -> router_pb2.ScalePoolResponse:
        """Resize a pool. The resize is the router's: if this call's deadline passes, it
        completes (or rolls back) all the same."""
        return await self._stub.ScalePool(router_pb2.ScalePoolRequest(pool=pool, replicas=replicas),
                                          timeout=timeout or self.timeout,
                                          metadata=self._metadata)

    async def timeline(self, since: float = 0.0) -> list[dict]:
        """Engine steps of every live rank that ended after unix time `since`."""
        reply = await self._stub.GetTimeline(router_pb2.TimelineRequest(since=since),
                                             timeout=self.timeout, metadata=self._metadata)
        return step_dicts(reply)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
