"""Test doubles: an engine factory whose model runs raise on chosen steps, and one
whose engines resolve their settings apart from their pool's.

Passed as ``RouterConfig.engine_factory`` (it is shipped to the rank actors), so tests
inject faults into real ranks without an environment variable or a code path of
the production engine. A run is a step that computes something (empty steps never
fail); ``fail_runs`` counts them per rank from 1. ``lose_reports_of_runs`` makes a run
succeed but drop its outputs, as if its step report were lost.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from typing import Any

from pdserve.rank.engine_rank import default_engine_factory


class InjectedFault(RuntimeError):
    """Raised inside a step by FaultyEngineFactory's engines."""


@dataclass(frozen=True)
class FaultyEngineFactory:
    fail_runs: frozenset[int] = field(default_factory=frozenset)  # runs that raise, per rank
    rate: float = 0.0             # ... or each run with this probability (seeded per process)
    seed: int = 0
    engine_types: tuple[str, ...] = ("prompt", "completion", "normal")
    lose_reports_of_runs: frozenset[int] = field(default_factory=frozenset)

    def __call__(self, config: dict, communicator: Any) -> Any:
        engine = default_engine_factory(config, communicator)
        if config.get("engine_type") not in self.engine_types:
            return engine
        execute = engine._execute
        rng = random.Random(hash((self.seed, os.getpid())))
        runs = 0

        def faulty_execute(sched_out):
            nonlocal runs
            if not sched_out.is_empty:
                runs += 1
                if runs in self.fail_runs or (self.rate and rng.random() < self.rate):
                    raise InjectedFault(f"injected fault in run {runs}")
            return execute(sched_out)

        engine._execute = faulty_execute
        if self.lose_reports_of_runs:
            step = engine.step

            def lossy_step():
                before = runs
                out = step()
                if runs != before and runs in self.lose_reports_of_runs:
                    out.outputs = []
                return out

            engine.step = lossy_step
        return engine


@dataclass(frozen=True)
class SkewedEngineFactory:
    """Engines of ``engine_types`` built with ``settings`` over their pool's: ranks that
    resolve their settings apart from the other pool's, as a pool on GPUs would beside
    one on CPUs (``settings``: (name, value) pairs, so that the factory stays hashable)."""

    settings: tuple[tuple[str, Any], ...]
    engine_types: tuple[str, ...] = ("prompt",)

    def __call__(self, config: dict, communicator: Any) -> Any:
        if config.get("engine_type") in self.engine_types:
            config = {**config, **dict(self.settings)}
        return default_engine_factory(config, communicator)
