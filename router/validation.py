"""Checks a GenerateRequest before anything is allocated; each failure names its field."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import grpc
from pdserve.scheduler.sampling_params import SamplingParams

_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed")


class RequestError(Exception):
    """A request refused with a gRPC status code and a message naming the field."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


@dataclass
class ModelLimits:
    vocab_size: int
    max_model_len: int
    max_tokens_limit: int


@dataclass
class PreparedRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams

    def sampling_dict(self) -> dict:
        d = asdict(self.sampling)
        d["stop_token_ids"] = list(d["stop_token_ids"])
        return d


def _check_ids(name: str, ids, vocab_size: int) -> list[int]:
    out = [int(t) for t in ids]
    for i, t in enumerate(out):
        if not 0 <= t < vocab_size:
            raise invalid(f"{name}[{i}] = {t} is outside the vocabulary [0, {vocab_size})")
    return out


def prepare(request, tokenizer, limits: ModelLimits, default_max_tokens: int = 16) -> PreparedRequest:
    """GenerateRequest -> PreparedRequest (request_id left as given; may be empty)."""
    kind = request.WhichOneof("prompt")
    if kind == "text":
        if not request.text:
            raise invalid("prompt must not be empty (field: text)")
        ids = tokenizer.encode(request.text)
        if not ids:
            raise invalid("prompt must not be empty (field: text encodes to no tokens)")
    elif kind == "token_ids":
        if not request.token_ids.ids:
            raise invalid("prompt must not be empty (field: token_ids)")
        ids = _check_ids("token_ids", request.token_ids.ids, limits.vocab_size)
    else:
        raise invalid("prompt must not be empty: set text or token_ids")
    if len(ids) >= limits.max_model_len:
        raise invalid(
            f"prompt has {len(ids)} tokens; the model allows at most "
            f"{limits.max_model_len - 1} (max_model_len {limits.max_model_len})")

    values = {name: getattr(request, name) for name in _SAMPLING_FIELDS if request.HasField(name)}
    values.setdefault("max_tokens", default_max_tokens)
    max_tokens = values["max_tokens"]
    if max_tokens < 1:
        raise invalid(f"max_tokens must be >= 1, got {max_tokens}")
    if max_tokens > limits.max_tokens_limit:
        raise invalid(f"max_tokens must be <= {limits.max_tokens_limit}, got {max_tokens}")
    temperature = values.get("temperature", 1.0)
    if temperature != temperature:  # NaN
        raise invalid("temperature must be a number >= 0, got nan")
    stop_ids = _check_ids("stop_token_ids", request.stop_token_ids, limits.vocab_size)
    try:
        sampling = SamplingParams(stop_token_ids=tuple(stop_ids), ignore_eos=request.ignore_eos,
                                  **values)
    except ValueError as exc:  # SamplingParams names the field first
        raise invalid(str(exc)) from exc
    return PreparedRequest(request.request_id, ids, sampling)
