"""Where each attempt an engine holds is, so that one lookup finds it.

An attempt is registered when it arrives (``add_request``, ``import_prefilled``) and
forgotten when it ends or leaves (its outputs' last step, a hand-off). In between it is
in exactly one place, and only the part named by that place holds it:

1. ``GRAMMAR``: parked until its grammar is compiled (``GuidedRequests``), out of the
   scheduler;
2. ``FORK``: a further choice of a prompt (n > 1) not forked yet; ``seq`` is the
   sequence it will fork from;
3. ``IMPORT``: a prefilled payload's lead or fork, queued until blocks are free;
   ``payload`` is the queued payload;
4. ``SCHEDULER``: a sequence the scheduler holds (waiting, running, prompted, or ending
   this step);
5. ``ENDED``: reported as aborted at the next step, having never started.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pdserve.scheduler.sequence import Sequence


class Place(enum.Enum):
    GRAMMAR = "waiting for its grammar"
    FORK = "a choice not forked yet"
    IMPORT = "a payload waiting for room"
    SCHEDULER = "in the scheduler"
    ENDED = "ended before it started"


@dataclass(slots=True)
class Held:
    place: Place
    seq: Sequence | None = None  # its own (GRAMMAR, SCHEDULER) or its parent's (FORK)
    payload: Any = None  # the queued KVPayload (IMPORT)


class Attempts:
    """The attempts of one engine, each with its place."""

    def __init__(self) -> None:
        self._held: dict[str, Held] = {}

    def check_new(self, attempts: list[str]) -> None:
        """ValueError unless the attempts are non-empty, distinct and not held here."""
        if len(set(attempts)) != len(attempts):
            raise ValueError(f"attempts of one prompt's choices repeat: {attempts}")
        for attempt in attempts:
            if not attempt:
                raise ValueError("attempt must not be empty")
            if attempt in self._held:
                raise ValueError(f"attempt {attempt!r} is already in flight")

    def put(self, attempt: str, place: Place, seq: Sequence | None = None,
            payload: Any = None) -> None:
        self._held[attempt] = Held(place, seq, payload)

    def get(self, attempt: str) -> Held | None:
        return self._held.get(attempt)

    def forget(self, attempt: str) -> None:
        self._held.pop(attempt, None)

    def __contains__(self, attempt: object) -> bool:
        return attempt in self._held

    def __iter__(self) -> Iterator[str]:
        return iter(self._held)

    def __len__(self) -> int:
        return len(self._held)
