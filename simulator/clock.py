"""Virtual time: a heap of timed callbacks run in time order (no asyncio, no wall clock).

Events at the same instant run in the order they were scheduled (a sequence number
breaks ties), so a run is a pure function of its inputs.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self._events: list[tuple[float, int, Callable, tuple]] = []
        self._order = itertools.count()
        self.num_events = 0

    def at(self, when: float, fn: Callable, *args) -> None:
        """Run ``fn(*args)`` at virtual time ``when`` (never before now)."""
        heapq.heappush(self._events, (max(when, self.now), next(self._order), fn, args))

    def run(self, until: float = float("inf"), on_tick: Callable[[float], None] | None = None,
            tick_s: float = 60.0) -> None:
        """Run events in order until none is left (or the next one is past ``until``);
        ``on_tick(now)`` every ``tick_s`` of virtual time (progress reports)."""
        events, pop = self._events, heapq.heappop
        next_tick = tick_s
        while events and events[0][0] <= until:
            when, _, fn, args = pop(events)
            self.now = when
            if on_tick is not None and when >= next_tick:
                on_tick(when)
                next_tick = (when // tick_s + 1) * tick_s
            self.num_events += 1
            fn(*args)

    def __len__(self) -> int:
        return len(self._events)
