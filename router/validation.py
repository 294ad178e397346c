"""Checks a GenerateRequest before anything is allocated; each failure names its field.

Cheap checks (sizes, counts, numbers) come before any per-element work, and the prompt
is tokenized last (then the bad words), so an oversized or malformed request costs the
router almost nothing. The logits controls and the structured output are checked by
``sampling_fields.py``.
Every limit here is listed in the "Limits" section of router/README.md.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from pdserve.router.chat_template import MAX_MESSAGES
from pdserve.router.request_error import invalid
from pdserve.router.sampling_fields import bad_words_token_ids, control_values
from pdserve.scheduler.sampling_params import MAX_LOGPROBS, SamplingParams

_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs")

# request_id is a client label that ends up in logs, metrics and error messages.
MAX_REQUEST_ID_CHARS = 256
# A text prompt is tokenized on a worker thread; this bounds that work (and its memory)
# before the tokenizer sees it. 1 MiB of text is far beyond any max_model_len we serve.
MAX_PROMPT_BYTES = 1 << 20
MAX_STOP_TOKEN_IDS = 64
# Stop strings are matched against the streamed text at every step: bound their work.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256


@dataclass
class ModelLimits:
    vocab_size: int
    max_model_len: int
    max_tokens_limit: int
    max_choices: int = 1  # the router sets RouterConfig.max_choices


@dataclass
class PreparedRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    # Stop strings (matched on the router, on the detokenized text): see text_output.py.
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    n: int = 1  # completions of this prompt (choice i samples with sampling.for_choice(i))

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


def check_stop_strings(stop) -> tuple[str, ...]:
    """The stop strings, checked: at most MAX_STOP_STRINGS, each non-empty and at most
    MAX_STOP_STRING_CHARS characters."""
    if len(stop) > MAX_STOP_STRINGS:
        raise invalid(f"stop must hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
    for i, text in enumerate(stop):
        if not isinstance(text, str) or not text:
            raise invalid(f"stop[{i}] must be a non-empty string")
        if len(text) > MAX_STOP_STRING_CHARS:
            raise invalid(f"stop[{i}] must be at most {MAX_STOP_STRING_CHARS} characters, "
                          f"got {len(text)}")
    return tuple(stop)


def check_request_id(request_id: str) -> None:
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise invalid(f"request_id must be at most {MAX_REQUEST_ID_CHARS} characters, "
                      f"got {len(request_id)}")
    if not request_id.isprintable():
        bad = next(c for c in request_id if not c.isprintable())
        raise invalid(f"request_id must be printable text, got the control or separator "
                      f"character {bad!r}")


def _check_prompt_too_long(num_tokens: int, field: str, limits: ModelLimits) -> None:
    # The prompt must leave room for at least one generated token.
    if num_tokens >= limits.max_model_len:
        raise invalid(
            f"prompt (field: {field}) has {num_tokens} tokens; the model allows at most "
            f"{limits.max_model_len - 1} (max_model_len {limits.max_model_len})")


def _text_exceeds_byte_limit(text: str) -> bool:
    # Every character is at least one UTF-8 byte, so a long str is over the limit without
    # encoding it; a short one is encoded (at most 4 * MAX_PROMPT_BYTES) to count exactly.
    return len(text) > MAX_PROMPT_BYTES or len(text.encode("utf-8")) > MAX_PROMPT_BYTES


def _chat_token_ids(chat, tokenizer, limits: ModelLimits, chat_template) -> list[int]:
    if chat_template is None:
        raise invalid("this model has no chat template: send text or token_ids "
                      "(field: chat)")
    if not 0 < len(chat.messages) <= MAX_MESSAGES:  # before converting them one by one
        raise invalid(f"chat.messages must hold 1..{MAX_MESSAGES} messages, got "
                      f"{len(chat.messages)}")
    for i, m in enumerate(chat.messages):
        if not m.role:
            raise invalid(f"chat.messages[{i}].role must not be empty (field: chat)")
    messages = [{"role": m.role, "content": m.content} for m in chat.messages]
    try:
        prompt = chat_template.render(messages, True)
    except ValueError as exc:  # names the message and field, e.g. messages[2].content
        raise invalid(f"{exc} (field: chat)") from None
    ids = list(chat_template.encode(tokenizer, prompt))
    if not ids:
        raise invalid("prompt must not be empty (field: chat renders to no tokens)")
    _check_prompt_too_long(len(ids), "chat", limits)
    return ids


def _prompt_token_ids(request, tokenizer, limits: ModelLimits,
                      chat_template=None) -> list[int]:
    kind = request.WhichOneof("prompt")
    if kind == "chat":
        return _chat_token_ids(request.chat, tokenizer, limits, chat_template)
    if kind == "text":
        text = request.text
        if not text:
            raise invalid("prompt must not be empty (field: text)")
        if _text_exceeds_byte_limit(text):
            raise invalid(f"prompt text must be at most {MAX_PROMPT_BYTES} bytes of UTF-8 "
                          f"(field: text)")
        ids = tokenizer.encode(text)
        if not ids:
            raise invalid("prompt must not be empty (field: text encodes to no tokens)")
        _check_prompt_too_long(len(ids), "text", limits)
        return ids
    if kind == "token_ids":
        raw_ids = request.token_ids.ids
        if not raw_ids:
            raise invalid("prompt must not be empty (field: token_ids)")
        _check_prompt_too_long(len(raw_ids), "token_ids", limits)  # before converting them
        return _check_ids("token_ids", raw_ids, limits.vocab_size)
    raise invalid("prompt must not be empty: set text, token_ids or chat")


def _sampling_values(request, limits: ModelLimits, default_max_tokens: int) -> dict:
    values = {name: getattr(request, name) for name in _SAMPLING_FIELDS if request.HasField(name)}
    values.setdefault("max_tokens", default_max_tokens)
    max_tokens = values["max_tokens"]
    if max_tokens < 1:
        raise invalid(f"max_tokens must be >= 1, got {max_tokens}")
    if max_tokens > limits.max_tokens_limit:
        raise invalid(f"max_tokens must be <= {limits.max_tokens_limit}, got {max_tokens}")
    temperature = values.get("temperature", 1.0)
    # inf would turn logits / temperature into NaNs; nan compares false with everything.
    if not math.isfinite(temperature) or temperature < 0:
        raise invalid(f"temperature must be a finite number >= 0, got {temperature}")
    top_p = values.get("top_p", 1.0)
    if not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
        raise invalid(f"top_p must be a finite number in (0, 1], got {top_p}")
    logprobs = values.get("logprobs")
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise invalid(f"logprobs must be in [0, {MAX_LOGPROBS}] (unset: none), got {logprobs}")
    return values


def prepare(request, tokenizer, limits: ModelLimits,
            default_max_tokens: int = 16, chat_template=None) -> PreparedRequest:
    """GenerateRequest -> PreparedRequest (request_id left as given; may be empty).
    A ``chat`` prompt is rendered with ``chat_template`` (the model's; None: refused).

    Raises RequestError(INVALID_ARGUMENT) naming the field. Safe to call off the event
    loop: it touches nothing but its arguments.
    """
    check_request_id(request.request_id)
    n = request.n if request.HasField("n") else 1
    if not 1 <= n <= limits.max_choices:
        raise invalid(f"n must be in [1, {limits.max_choices}] (max_choices), got {n}")
    values = _sampling_values(request, limits, default_max_tokens)
    num_stop_ids = len(request.stop_token_ids)
    if num_stop_ids > MAX_STOP_TOKEN_IDS:  # before converting them one by one
        raise invalid(f"stop_token_ids must hold at most {MAX_STOP_TOKEN_IDS} ids, "
                      f"got {num_stop_ids}")
    stop_ids = _check_ids("stop_token_ids", request.stop_token_ids, limits.vocab_size)
    stop = check_stop_strings(request.stop)
    # the logits controls and the structured output (sampling_fields.py): numbers and
    # counts, then the guide's parse; the bad words are tokenized after the prompt
    values.update(control_values(request, limits, values["max_tokens"]))
    ids = _prompt_token_ids(request, tokenizer, limits, chat_template)
    if request.bad_words:
        values["bad_words_token_ids"] = bad_words_token_ids(request.bad_words, tokenizer,
                                                            limits.vocab_size)
    try:
        sampling = SamplingParams(stop_token_ids=tuple(stop_ids), ignore_eos=request.ignore_eos,
                                  **values)
    except ValueError as exc:  # SamplingParams names the field first
        raise invalid(str(exc)) from exc
    return PreparedRequest(request.request_id, ids, sampling, stop,
                           request.include_stop_str_in_output, n)
