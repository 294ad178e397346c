"""Per-request sampling settings: plain data, validated, shared by every layer."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

MAX_LOGPROBS = 20  # the most top-k alternatives a request may ask for
MAX_CHOICES = 256  # the most completions (n) of one prompt any layer carries
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
LOGIT_BIAS_RANGE = 100.0  # OpenAI's bound on each bias
MAX_BAD_WORDS = 64  # bad words, each at most MAX_BAD_WORD_TOKENS tokens
MAX_BAD_WORD_TOKENS = 32
MAX_GUIDE_CHARS = 1 << 16  # a schema, regex or grammar
GUIDE_KINDS = ("json", "json_object", "regex", "grammar", "choice")


@dataclass(frozen=True)
class Guide:
    """A structured-output constraint: ``kind`` names what ``spec`` holds.

    json: a JSON schema (text); json_object: any JSON object (spec empty); regex: a
    regular expression; grammar: an EBNF grammar (xgrammar's / GBNF syntax, rule
    ``root``); choice: a JSON list of the allowed strings. Plain data: the grammar
    engine (engine/guided/grammar.py) compiles it where tokens are sampled."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GUIDE_KINDS:
            raise ValueError(f"guide.kind must be one of {', '.join(GUIDE_KINDS)}, "
                             f"got {self.kind!r}")
        if not isinstance(self.spec, str) or len(self.spec) > MAX_GUIDE_CHARS:
            raise ValueError(f"guide.spec must be a string of at most {MAX_GUIDE_CHARS} "
                             f"characters")
        if self.kind != "json_object" and not self.spec:
            raise ValueError(f"guide.spec must not be empty for kind {self.kind!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are chosen and when it stops.

    temperature 0 is greedy. top_k -1 (or 0) and top_p 1.0 disable those filters.
    A seed makes the request's samples reproducible whatever batch it shares.
    logprobs None: no log-probabilities; k in 0..20: each generated token's
    log-probability and the k most likely tokens' (see ``ModelRunner``: raw logprobs,
    before temperature / top-k / top-p and the controls below).

    The controls, with vLLM's semantics (engine/logits_controls.py applies them, in
    this order, before temperature): ``logit_bias`` (token id, bias in [-100, 100])
    added to the logits; ``bad_words_token_ids`` (each word's token ids: its last
    token is refused where the answer ends with the others); ``min_tokens``: EOS and
    ``stop_token_ids`` refused until the answer has that many tokens;
    ``repetition_penalty`` (> 0; 1 is off) divides positive and multiplies negative
    logits of tokens seen in the prompt or the answer; ``frequency_penalty`` and
    ``presence_penalty`` (in [-2, 2]) subtract per occurrence / once for tokens in the
    answer. ``min_p`` (in [0, 1]) drops tokens whose probability, after temperature,
    is below min_p times the most likely one's. ``guide`` constrains the answer to a
    grammar (structured output); with a guide, EOS comes only where the grammar may end.

    ``prior_output_tokens``: how many tokens at the end of the prompt are the answer
    so far: a moved request's (the router's, never a client's). The answer, which
    the penalties, ``min_tokens``, the bad words and the guide read, starts there.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    min_p: float = 0.0
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    guide: Guide | None = None
    prior_output_tokens: int = 0

    def __post_init__(self) -> None:
        # Lists (and a payload's dicts) are accepted for convenience and frozen so the
        # params stay hashable.
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))
        object.__setattr__(self, "bad_words_token_ids",
                           tuple(tuple(int(t) for t in w) for w in self.bad_words_token_ids))
        if isinstance(self.guide, dict):
            object.__setattr__(self, "guide", Guide(**self.guide))
        self.validate()

    def validate(self, max_tokens_limit: int | None = None) -> None:
        """Raise ValueError naming the first bad field."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if max_tokens_limit is not None and self.max_tokens > max_tokens_limit:
            raise ValueError(f"max_tokens must be <= {max_tokens_limit}, got {self.max_tokens}")
        if not 0 <= self.temperature < float("inf"):  # also refuses NaN
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:  # also refuses NaN
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 0, got {self.top_k}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.logprobs is not None and (
                isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], "
                             f"got {self.logprobs!r}")
        self._validate_controls()

    def _validate_controls(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:  # also refuses NaN
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not 0.0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be a finite number > 0, "
                             f"got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        self._validate_token_lists()
        if self.guide is not None and not isinstance(self.guide, Guide):
            raise ValueError(f"guide must be a Guide or None, got {type(self.guide).__name__}")
        if self.guide is not None and self.ignore_eos:
            raise ValueError("ignore_eos cannot be combined with structured output: the "
                             "answer ends where its grammar does")
        if not isinstance(self.prior_output_tokens, int) or self.prior_output_tokens < 0:
            raise ValueError(f"prior_output_tokens must be an integer >= 0, "
                             f"got {self.prior_output_tokens!r}")

    def _validate_token_lists(self) -> None:
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias must hold at most {MAX_LOGIT_BIAS} entries, "
                             f"got {len(self.logit_bias)}")
        for token, bias in self.logit_bias:
            if token < 0 or not -LOGIT_BIAS_RANGE <= bias <= LOGIT_BIAS_RANGE:
                raise ValueError(f"logit_bias[{token}] must map a token id >= 0 to a bias in "
                                 f"[-100, 100], got {bias}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens + self.prior_output_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens, got {self.min_tokens} > "
                             f"{self.max_tokens}")
        if len(self.bad_words_token_ids) > MAX_BAD_WORDS or any(
                not 0 < len(w) <= MAX_BAD_WORD_TOKENS or min(w) < 0
                for w in self.bad_words_token_ids):
            raise ValueError(f"bad_words must hold at most {MAX_BAD_WORDS} words of 1.."
                             f"{MAX_BAD_WORD_TOKENS} tokens each")

    def for_choice(self, index: int) -> SamplingParams:
        """Choice ``index`` (0-based) of a request for n completions: the same settings,
        with seed + index when seeded, so the choices differ and each is reproducible
        (choice 0 keeps the request's seed). Unseeded choices each draw fresh randomness;
        greedy ones are all the same."""
        if index == 0 or self.seed is None:
            return self
        return replace(self, seed=self.seed + index)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_controls(self) -> bool:
        """Whether any logits control applies (the penalties, bias, min_tokens, bad
        words or a guide): rows without pay nothing for them."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0 or bool(self.logit_bias)
                or self.min_tokens > 0 or bool(self.bad_words_token_ids)
                or self.guide is not None)
