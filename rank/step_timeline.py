"""A rank's recent engine steps, for timelines: a bounded ring of plain tuples.

The engine loop appends one tuple per step (no per-token work); KV imports on a
decode rank append one each. Times are wall-clock `time.time()` seconds, so records
of ranks on one host line up; across hosts they are as good as the hosts' clocks.
"""

from __future__ import annotations

import collections
import itertools

from pdserve.engine.outputs import StepOutputs

FIELDS = ("seq", "pool", "rank", "kind", "start", "end", "num_tokens", "num_rows",
          "num_handoffs", "handoff_start", "handoff_end")
KINDS = ("prompt", "decode", "empty_prompt", "empty", "import")
DEFAULT_MAXLEN = 16384


def step_kind(out: StepOutputs) -> str:
    """The engine's kind, with steps that computed nothing named `empty` (a rank idle
    while a peer decodes) or `empty_prompt` (idle while a peer prefills)."""
    kind = out.kind
    if out.num_scheduled_tokens:
        return kind
    return "empty_prompt" if kind == "empty_prompt" else "empty"


class StepTimeline:
    def __init__(self, maxlen: int = DEFAULT_MAXLEN) -> None:
        self._ring: collections.deque[tuple] = collections.deque(maxlen=maxlen)
        self._seq = itertools.count(1)  # next() is atomic: imports append from other threads

    def step(self, pool: str, rank: int, out: StepOutputs, end: float,
             handoff_start: float = 0.0, handoff_end: float = 0.0) -> None:
        self._ring.append((next(self._seq), pool, rank, step_kind(out), end - out.duration_s,
                           end, out.num_scheduled_tokens, out.num_rows, len(out.handoffs),
                           handoff_start, handoff_end))

    def imported(self, pool: str, rank: int, start: float, end: float) -> None:
        self._ring.append((next(self._seq), pool, rank, "import", start, end, 0, 1, 1, start, end))

    def since(self, since: float = 0.0, since_seq: int = 0) -> list[dict]:
        """Records that ended after unix time `since` and come after `since_seq`."""
        records = list(self._ring)  # one C-level copy: safe against concurrent appends
        return [dict(zip(FIELDS, r, strict=True)) for r in records
                if r[0] > since_seq and r[5] > since]
