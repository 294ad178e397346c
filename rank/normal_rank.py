"""NORMAL engine ranks (`--mode normal`): one pool does both phases, the step-kind votes
deciding each step; the offline engine's way, behind the same rank body as the prefill
(prefill_worker/) and decode (decode_worker/) roles."""

from __future__ import annotations

from pdserve.engine.outputs import StepOutputs
from pdserve.rank.engine_rank import EngineRank, add_timings
from pdserve.rank.messages import TokenReport


class NormalRank(EngineRank):
    """Does both phases; the `normal` pool."""

    pool_name = "normal"
    engine_type = "normal"

    def _add_timings(self, out: StepOutputs, entries: list[TokenReport]) -> None:
        add_timings(out, entries, {})
