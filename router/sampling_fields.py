"""A GenerateRequest's logits controls and structured output, checked into
``SamplingParams`` keyword arguments (vLLM's semantics); each failure names its field.

``prepare`` (validation.py) calls ``control_values`` after the cheap checks and before
the prompt is tokenized: numbers and counts first, then the structured output's parse
(xgrammar, on the worker thread ``prepare`` runs on; its outcome is cached per guide);
``bad_words_token_ids`` runs after the prompt is tokenized. Every limit here is listed
in the "Limits" section of router/README.md.
"""

from __future__ import annotations

import functools
import json
import math

import grpc

from pdserve.engine.guided.grammar import MAX_CHOICES as MAX_GUIDE_CHOICES
from pdserve.engine.guided.grammar import check_guide
from pdserve.router.request_error import RequestError, invalid
from pdserve.router.schema_audit import unenforced
from pdserve.scheduler.sampling_params import (
    LOGIT_BIAS_RANGE,
    MAX_BAD_WORD_TOKENS,
    MAX_BAD_WORDS,
    MAX_GUIDE_CHARS,
    MAX_LOGIT_BIAS,
    Guide,
)

# Each bad word gives at most two token sequences (vLLM's rule: the word, and the word
# after a space), and SamplingParams holds at most MAX_BAD_WORDS sequences.
MAX_BAD_WORD_STRINGS = MAX_BAD_WORDS // 2
MAX_BAD_WORD_CHARS = 256
# float fields: (low, high, the words of the error); NaN fails every comparison
_FLOAT_RANGES = {
    "presence_penalty": (-2.0, 2.0, "a number in [-2, 2]"),
    "frequency_penalty": (-2.0, 2.0, "a number in [-2, 2]"),
    "min_p": (0.0, 1.0, "a number in [0, 1]"),
}
# StructuredOutput's oneof names -> Guide kinds
GUIDE_KIND = {"json_schema": "json", "json_object": "json_object", "regex": "regex",
              "grammar": "grammar", "choice": "choice"}


def control_values(request, limits, max_tokens: int) -> dict:
    """The penalties, ``min_p``, ``min_tokens``, ``logit_bias`` and the structured
    output's ``guide`` of ``request`` (set ones only), checked. The bad words' count and
    lengths are checked here too; they are tokenized later (``bad_words_token_ids``)."""
    values = _float_values(request)
    if request.HasField("min_tokens"):
        min_tokens = request.min_tokens
        if not 0 <= min_tokens <= max_tokens:
            raise invalid(f"min_tokens must be in [0, max_tokens = {max_tokens}], "
                          f"got {min_tokens}")
        values["min_tokens"] = min_tokens
    if request.logit_bias:
        values["logit_bias"] = _logit_bias(request.logit_bias, limits.vocab_size)
    check_bad_words(request.bad_words)
    if request.HasField("structured_output"):
        if request.ignore_eos:
            raise invalid("ignore_eos cannot be combined with structured_output: the answer "
                          "ends where its grammar does")
        values["guide"] = guide_of(request.structured_output)
    return values


def _float_values(request) -> dict:
    values = {}
    for name, (low, high, words) in _FLOAT_RANGES.items():
        if request.HasField(name):
            value = getattr(request, name)
            if not low <= value <= high:
                raise invalid(f"{name} must be {words}, got {value}")
            values[name] = value
    if request.HasField("repetition_penalty"):
        value = request.repetition_penalty
        if not (math.isfinite(value) and value > 0):
            raise invalid(f"repetition_penalty must be a finite number > 0 (1 is off), "
                          f"got {value}")
        values["repetition_penalty"] = value
    return values


def _logit_bias(bias, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """The entries by token id (a map's order is not the client's: sorted, so equal
    requests get equal params)."""
    if len(bias) > MAX_LOGIT_BIAS:  # before reading them one by one
        raise invalid(f"logit_bias must hold at most {MAX_LOGIT_BIAS} entries, "
                      f"got {len(bias)}")
    out = []
    for token, value in sorted(bias.items()):
        if not 0 <= token < vocab_size:
            raise invalid(f"logit_bias[{token}]: the token id is outside the vocabulary "
                          f"[0, {vocab_size})")
        if not -LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE:
            raise invalid(f"logit_bias[{token}] must be a bias in [-100, 100], got {value}")
        out.append((token, value))
    return tuple(out)


# -- bad words -----------------------------------------------------------------------------

def check_bad_words(words) -> None:
    """At most MAX_BAD_WORD_STRINGS words, each with a non-space character and at most
    MAX_BAD_WORD_CHARS characters."""
    if len(words) > MAX_BAD_WORD_STRINGS:
        raise invalid(f"bad_words must hold at most {MAX_BAD_WORD_STRINGS} words, "
                      f"got {len(words)}")
    for i, word in enumerate(words):
        if len(word) > MAX_BAD_WORD_CHARS:
            raise invalid(f"bad_words[{i}] must be at most {MAX_BAD_WORD_CHARS} characters, "
                          f"got {len(word)}")
        if not word.strip():
            raise invalid(f"bad_words[{i}] must not be empty (or only spaces)")


def bad_words_token_ids(words, tokenizer, vocab_size: int) -> tuple[tuple[int, ...], ...]:
    """Each word's token sequences (vLLM's ``SamplingParams.update_from_tokenizer``),
    duplicates dropped; each at most MAX_BAD_WORD_TOKENS ids, all in the vocabulary."""
    out: dict[tuple[int, ...], None] = {}
    for i, word in enumerate(words):
        for ids in word_token_ids(word, tokenizer):
            if not ids:
                raise invalid(f"bad_words[{i}] encodes to no tokens")
            if len(ids) > MAX_BAD_WORD_TOKENS:
                raise invalid(f"bad_words[{i}] must be at most {MAX_BAD_WORD_TOKENS} tokens, "
                              f"got {len(ids)}")
            if not all(0 <= t < vocab_size for t in ids):
                raise invalid(f"bad_words[{i}] encodes to a token outside the vocabulary "
                              f"[0, {vocab_size})")
            out[ids] = None
    return tuple(out)


def word_token_ids(word: str, tokenizer) -> list[tuple[int, ...]]:
    """vLLM's rule: the ids of ``word.lstrip()``, and those of ``" " + word.lstrip()``
    when the space makes a word token of its own (another first token, the same
    length); both without special tokens. A word is refused at the start of the answer
    and after a space alike."""
    bare = word.lstrip()
    plain = tuple(int(t) for t in tokenizer.encode(bare, add_special_tokens=False))
    spaced = tuple(int(t) for t in tokenizer.encode(" " + bare, add_special_tokens=False))
    if plain and spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
        return [plain, spaced]
    return [plain]


# -- structured output ---------------------------------------------------------------------

def guide_of(so) -> Guide:
    """The ``Guide`` of a StructuredOutput message, parsed (``check_guide``): a bad one is
    INVALID_ARGUMENT naming the field with the parser's reason, e.g.
    ``structured_output.json_schema: Unsupported type "foo"``. A JSON schema with a
    keyword the grammar cannot enforce (``router/schema_audit.py``) is refused naming it
    and its path, unless the message is ``loose``."""
    kind = so.WhichOneof("kind")
    if kind is None:
        raise invalid("structured_output must set one of json_schema, json_object, regex, "
                      "grammar or choice")
    name = f"structured_output.{kind}"
    if kind == "json_object":
        if not so.json_object:
            raise invalid(f"{name} must be true when set")
        return Guide("json_object")
    if kind == "choice":
        choices = so.choice.choices
        if not 0 < len(choices) <= MAX_GUIDE_CHOICES:  # before reading them
            raise invalid(f"{name} must hold 1..{MAX_GUIDE_CHOICES} strings, "
                          f"got {len(choices)}")
        spec = json.dumps(list(choices))
    else:
        spec = getattr(so, kind)
    if not spec:
        raise invalid(f"{name} must not be empty")
    if len(spec) > MAX_GUIDE_CHARS:
        raise invalid(f"{name} must be at most {MAX_GUIDE_CHARS} characters, got {len(spec)}")
    guide = Guide(GUIDE_KIND[kind], spec)
    problem = guide_problem(guide)
    if problem is not None:
        raise invalid(f"{name}: {problem}")
    if kind == "json_schema" and not so.loose:
        _refuse_unenforced(name, spec)
    return guide


def _refuse_unenforced(name: str, spec: str) -> None:
    findings = unenforced(json.loads(spec))
    if findings:
        more = f" (and {len(findings) - 1} more)" if len(findings) > 1 else ""
        raise invalid(f"{name}: {findings[0]} is not enforced by the grammar engine, so the "
                      f"answer could break the schema{more}; remove it, or ask without "
                      f"strict (then it only advises)")


def guide_problem(guide: Guide) -> str | None:
    """Why the guide does not parse (None: it does)."""
    try:
        return _cached_problem(guide)
    except RuntimeError as exc:  # xgrammar is not installed where the router runs
        raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                           f"structured_output: {exc}") from None


@functools.lru_cache(maxsize=256)  # clients resend the same schema; a failure is kept too
def _cached_problem(guide: Guide) -> str | None:
    try:
        check_guide(guide)
    except ValueError as exc:
        return str(exc)
    return None
