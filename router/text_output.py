"""A request's streamed text: incremental detokenization and stop strings.

Stop strings are matched on the detokenized text, so a match may span several tokens
(and start inside one). While some stop string could still begin in the last
``longest - 1`` characters, those characters are held back; the text a client receives
is never taken back. On a match the output ends before it (or after it, with
``include_stop_str_in_output``), and the tokens reported are those up to the one that
completed the match. Both fronts (gRPC, HTTP) stream through this, so they agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.model.tokenizer import IncrementalDetokenizer  # tokenizers only


@dataclass
class TextDelta:
    token_ids: list[int]   # tokens to report (all pushed, or up to the stop)
    text: str              # text that may go to the client now
    stopped: bool = False  # a stop string matched: the request is done
    stop_str: str | None = None


@dataclass
class TextOutput:
    """Feed it each event's tokens with ``push``; ``flush`` at the end."""

    tokenizer: object
    prompt_token_ids: list[int]
    stop: tuple[str, ...] = ()
    include_stop: bool = False
    text: str = ""      # all text decoded so far (held-back part included)
    sent: int = 0       # characters of ``text`` given out
    _detok: object = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._detok = IncrementalDetokenizer(self.tokenizer, self.prompt_token_ids)
        self._hold = max((len(s) for s in self.stop), default=1) - 1

    def push(self, token_ids: list[int]) -> TextDelta:
        kept: list[int] = []
        for t in token_ids:
            kept.append(t)
            before = len(self.text)
            self.text += self._detok.push(t)
            hit = self._find_stop(before)
            if hit is not None:
                return self._stop_at(*hit, kept)
        return TextDelta(kept, self._release(len(self.text) - self._hold))

    def flush(self) -> TextDelta:
        """The rest of the text once the request finished (no more tokens)."""
        before = len(self.text)
        self.text += self._detok.flush()
        hit = self._find_stop(before)
        if hit is not None:
            return self._stop_at(*hit, [])
        return TextDelta([], self._release(len(self.text)))

    def _find_stop(self, before: int) -> tuple[int, str] | None:
        """The earliest match that the text added after ``before`` completed."""
        if not self.stop:
            return None
        best: tuple[int, str] | None = None
        for s in self.stop:
            # a match completed now ends after `before`: it starts after before - len(s)
            start = self.text.find(s, max(self.sent, before - len(s) + 1))
            if start != -1 and (best is None or start < best[0]):
                best = (start, s)
        return best

    def _stop_at(self, start: int, stop_str: str, kept: list[int]) -> TextDelta:
        end = start + len(stop_str) if self.include_stop else start
        text = self._release(end)
        self.text = self.text[:end]
        return TextDelta(kept, text, stopped=True, stop_str=stop_str)

    def _release(self, upto: int) -> str:
        upto = max(upto, self.sent)
        out = self.text[self.sent:upto]
        self.sent = upto
        return out
