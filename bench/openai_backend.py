"""`bench serve --backend openai`: any OpenAI-compatible server (pdserve's HTTP front,
vLLM, SGLang, ...) driven with the same workloads and metrics as the gRPC client.

Each request is a streamed `/v1/completions` call with `stream_options.include_usage`
(the usage chunk gives the exact completion token count) and `ignore_eos` (vLLM's
extension, honoured by pdserve). A chunk's token count is `len(token_ids)` when the
server returns them (`return_token_ids`: pdserve, recent vLLM), else one per chunk that
carries text (how vLLM streams).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0  # the server's prompt_tokens_details.cached_tokens


@dataclass
class Message:
    """What bench/serve_client.py reads of a GenerateResponse."""

    token_ids: list[int] = field(default_factory=list)
    request_id: str = ""
    finish_reason: str = ""
    error: str = ""
    usage: _Usage = field(default_factory=_Usage)

    def HasField(self, name: str) -> bool:  # noqa: N802 (protobuf's name)
        return False  # no router timings over HTTP


class OpenAIBackend:
    """An AsyncClient look-alike (``stream``, ``close``) over the OpenAI API."""

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None,
                 timeout: float = 600.0) -> None:
        # lazy: openai is heavy; only --backend openai needs it
        import openai

        self.client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key or "none",
                                         max_retries=0, timeout=timeout)
        self.model = model

    async def _model(self) -> str:
        if self.model is None:
            models = await self.client.models.list()
            self.model = models.data[0].id
        return self.model

    async def stream(self, prompt, *, max_tokens: int, temperature: float = 0.0,
                     ignore_eos: bool = True, timeout: float | None = None):
        model = await self._model()
        stream = await self.client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=temperature,
            stream=True, stream_options={"include_usage": True}, timeout=timeout,
            extra_body={"ignore_eos": ignore_eos, "return_token_ids": True})
        finish = None
        async for chunk in stream:
            if chunk.usage is not None and not chunk.choices:
                details = getattr(chunk.usage, "prompt_tokens_details", None)
                cached = getattr(details, "cached_tokens", None) or 0
                last = Message(request_id=chunk.id, finish_reason=finish or "length",
                               usage=_Usage(chunk.usage.prompt_tokens,
                                            chunk.usage.completion_tokens, cached))
                yield last
                return
            for choice in chunk.choices:
                ids = (choice.model_extra or {}).get("token_ids")
                count = len(ids) if ids is not None else (1 if choice.text else 0)
                finish = choice.finish_reason or finish
                if count:
                    yield Message(token_ids=[0] * count, request_id=chunk.id)
        if finish:  # a server that sent no usage chunk
            yield Message(finish_reason=finish)

    async def close(self) -> None:
        await self.client.close()
