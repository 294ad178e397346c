"""Per-request sampling settings: plain data, validated, shared by every layer."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

MAX_LOGPROBS = 20  # the most top-k alternatives a request may ask for
MAX_CHOICES = 256  # the most completions (n) of one prompt any layer carries


@dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are chosen and when it stops.

    temperature 0 is greedy. top_k -1 (or 0) and top_p 1.0 disable those filters.
    A seed makes the request's samples reproducible whatever batch it shares.
    logprobs None: no log-probabilities; k in 0..20: each generated token's
    log-probability and the k most likely tokens' (see ``ModelRunner``: raw logprobs,
    before temperature / top-k / top-p).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and frozen so the params stay hashable.
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
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
