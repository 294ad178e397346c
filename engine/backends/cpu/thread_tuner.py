"""How many threads a CPU decode step runs with: whichever has been faster lately."""

from __future__ import annotations

import contextlib
import time
from collections import deque

import torch

from pdserve.engine.step_inputs import RunnerRow


class ThreadTuner:
    """Runs each CPU decode step with 1 thread or with torch's current thread count,
    whichever has been faster lately for steps of that size.

    Why: on a 2-core machine shared with other work, two OpenMP threads wait at every
    barrier for a peer that the OS has descheduled. Measured under load 6-10 on 2
    cores, one thread ran the small model's decode steps about 2x faster (wall time),
    while an idle machine favours two. So: time the steps. Per size bucket, each
    choice's cost is the fastest of its last ``window`` tries (seconds per token);
    untried choices first, then the cheaper one, with every ``explore``-th step on the
    other so that a change in load is noticed. The fastest, not an average: a
    neighbour only ever adds time, and with an average one step it delayed (50 ms
    where 2 threads take 4) handed the next ``explore`` steps, and then more, to the
    slower choice; load that stays makes ``window`` tries in a row slow, and then counts.
    Only decode steps are tuned: they are many and short, so a wrong try costs one
    step's difference. Prefill steps are few and long (one is a large share of an
    offline batch): one exploratory prefill on 1 thread of an idle machine cost ~1 s
    of a 5 s run of the small model, so they always use every thread. Thread count
    does not change results (oneDNN and MKL matmuls and SDPA gave bitwise equal
    outputs for 1 and 2 threads at this model's decode and prefill shapes).
    torch's global setting is restored after each step, so other code in the process
    (e.g. transformers in a benchmark) keeps the caller's thread count.
    """

    def __init__(self, enabled: bool = True, explore: int = 24, window: int = 3):
        self.enabled = enabled
        self.explore = explore
        self.window = window
        self.tries: dict[tuple, deque] = {}  # (kind, bucket, threads) -> last s per token
        self.steps: dict[tuple, int] = {}  # (kind, bucket) -> steps seen

    def choose(self, key: tuple, max_threads: int) -> int:
        choices = (max_threads, 1) if max_threads > 1 else (1,)
        untried = [c for c in choices if key + (c,) not in self.tries]
        n = self.steps[key] = self.steps.get(key, 0) + 1
        if untried:
            return untried[0]
        best = min(choices, key=lambda c: min(self.tries[key + (c,)]))
        if n % self.explore == 0:
            return next((c for c in choices if c != best), best)
        return best

    def record(self, key: tuple, threads: int, seconds: float, tokens: int) -> None:
        tries = self.tries.setdefault(key + (threads,), deque(maxlen=self.window))
        tries.append(seconds / max(tokens, 1))

    @property
    def cost(self) -> dict[tuple, float]:
        """Each (kind, bucket, threads)'s cost: the fastest of its last tries."""
        return {k: min(v) for k, v in self.tries.items()}

    @contextlib.contextmanager
    def step(self, rows: list[RunnerRow]):
        caller = torch.get_num_threads()
        tokens = sum(len(r.token_ids) for r in rows)
        if not self.enabled or caller <= 1 or tokens != len(rows):
            yield
            return
        key = ("decode", tokens.bit_length())
        threads = self.choose(key, caller)
        torch.set_num_threads(threads)
        start = time.perf_counter()
        try:
            yield
            self.record(key, threads, time.perf_counter() - start, tokens)
        finally:
            torch.set_num_threads(caller)
