"""Runs an engine rank's steps on a thread of its own, in lockstep with its pool.

Each turn every rank of the pool votes whether any rank has work (one MIN
all-reduce). If one has, every rank steps (a rank with nothing to do takes an
empty step, which the engine counts); if none has, every rank parks on its own
wake event. Parking is a plain wait, not a spin: new work on any rank must wake
the pool, which is the caller's job (`wake()` on every peer), and a parked rank
re-votes at least every `park_timeout_s` so a lost wake costs latency, not a hang.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from pdserve.engine.engine import LLMEngine
from pdserve.engine.outputs import StepOutputs
from pdserve.scheduler.votes import Communicator

log = logging.getLogger(__name__)


class EngineLoop:
    def __init__(self, engine: LLMEngine, on_step: Callable[[StepOutputs], None],
                 communicator: Communicator | None = None, park_timeout_s: float = 0.5,
                 on_error: Callable[[BaseException], None] | None = None) -> None:
        self.engine = engine
        self.on_step = on_step
        self.on_error = on_error
        self.communicator = communicator
        self.park_timeout_s = park_timeout_s
        self.lock = threading.Lock()  # the engine is single-threaded: mutate it under this
        self.num_parks = 0
        self.error: BaseException | None = None
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run `fn(engine)` between steps and wake the loop (add, abort, import)."""
        with self.lock:
            result = fn(self.engine)
        self._wake.set()
        return result

    def wake(self) -> None:
        self._wake.set()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopped.set()
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def _pool_has_work(self) -> bool:
        with self.lock:
            local = self.engine.has_work()
        if self.communicator is None or self.communicator.world_size == 1:
            return local
        return self.communicator.all_reduce_min(0 if local else 1) == 0

    def turn(self) -> StepOutputs | None:
        """One lockstep turn: the pool votes, then every rank steps, or none does (None)."""
        if not self._pool_has_work():
            return None
        with self.lock:
            outputs = self.engine.step()
        self.on_step(outputs)
        return outputs

    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                self._wake.clear()
                if self.turn() is None:
                    self.num_parks += 1
                    self._wake.wait(self.park_timeout_s)
        except BaseException as exc:  # reported, never swallowed: peers must learn of it
            self.error = exc
            log.exception("engine loop of rank %d failed", self.engine.rank)
            if self.on_error is not None:
                self.on_error(exc)
