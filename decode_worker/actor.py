"""Decode ranks (COMPLETION engines).

A request's life on a decode rank (after the common steps in rank/engine_rank.py):

1. Its prefilled KV arrives through the rank's KV endpoint, which ever calls
   ``import_prefilled`` (a resolved Ray argument, a pushed gRPC stream, a mapped
   shared-memory segment, a received device tensor); the payload is checked whole and
   queued under the engine lock between steps. A refusal says why (``FailureKind``: no
   room, a prefix the cache lost, a bad payload) so the router knows whether to try
   another rank.
2. On one node the endpoint also listens for imports asked without a Ray call
   (``listen_for_wakes``: the router's local asks, a prefill rank's direct hand-off).
3. The first decode step after an import reports how long the payload waited
   (``decode_queue_s``) beside the token.
"""

from __future__ import annotations

import time
from typing import Any

from pdserve.engine.outputs import StepOutputs
from pdserve.kv_transfer.base import CACHE_MISS, CAPACITY, PAYLOAD, FailureKind
from pdserve.rank.engine_rank import EngineRank, add_timings
from pdserve.rank.group_member import error_text
from pdserve.rank.messages import AttemptKey, ImportResult, TokenReport


def refused_kind(exc: BaseException) -> FailureKind:
    """Why the engine refused an import, by the type it raised: no room (CAPACITY), a
    left-out prefix its cache lost (CACHE_MISS), else the payload itself (PAYLOAD)."""
    # lazy: engine.engine imports torch (the router imports this module); a rank has it
    from pdserve.engine.engine import CacheMissError, NoCapacityError

    if isinstance(exc, NoCapacityError):
        return CAPACITY
    if isinstance(exc, CacheMissError):
        return CACHE_MISS
    return PAYLOAD


class DecodeRank(EngineRank):
    """Imports prefilled KV payloads and decodes them; one rank of the decode pool."""

    pool_name = "decode"
    engine_type = "completion"

    def __init__(self, engine_config: dict, **kwargs) -> None:
        super().__init__(engine_config, **kwargs)
        self._imported_at: dict[str, float] = {}  # attempt -> monotonic time taken
        self.wake_address = self.endpoint.listen_for_wakes()

    def import_prefilled(self, payload: Any, *, borrowed: bool = False,
                         skip_blocks: int = 0) -> ImportResult:
        """The receive side of every transport: check the payload whole, then queue it
        (see ``LLMEngine.import_prefilled`` for ``borrowed`` and ``skip_blocks``)."""
        start = time.time()
        try:
            attempt = self._call(lambda eng: eng.import_prefilled(
                payload, borrowed=borrowed, skip_blocks=skip_blocks))
        except Exception as exc:
            return ImportResult(False, kind=refused_kind(exc), error=error_text(exc))
        self._imported_at[attempt] = time.monotonic()
        self.timeline.imported(self.pool_name, self.rank, start, time.time())
        nbytes = len(payload)
        if skip_blocks:  # the prefix it left out was never read
            nbytes = max(0, nbytes - skip_blocks * self.engine.kv_capacity().bytes_per_block)
        return ImportResult(True, attempt=attempt, nbytes=nbytes)

    def prepare_grammar(self, guide: Any) -> None:
        """Start compiling a structured-output guide whose request is being prefilled,
        so that its import finds the grammar ready (the router's hint; no answer)."""
        self.engine.guided.book.request(guide)

    def abort(self, attempt: AttemptKey) -> bool:
        self._imported_at.pop(attempt, None)
        return super().abort(attempt)

    def _add_timings(self, out: StepOutputs, entries: list[TokenReport]) -> None:
        if self._imported_at:
            add_timings(out, entries, self._imported_at)
