"""The cyclic garbage collector, paused while a simulation runs.

A large run keeps millions of container entries alive for its whole length (every
rank's block pool: free lists, reference counts and block names of thousands of ids;
the workload's arrival times; every live request's sequence). Each full collection walks
all of them again, and at 1,000 ranks that walk was two thirds of a run's wall time.
The simulator's per-request objects form no reference cycles (they are freed by
reference counting; ``tests/simulator/test_collector.py`` checks a run leaves no
cyclic garbage), so pausing the collector changes nothing but the time.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """Disable the cyclic collector inside the block; restore its state after (nested
    uses leave it off until the outermost one ends)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
