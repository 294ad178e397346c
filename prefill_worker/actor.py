"""Prefill ranks: PROMPT engines that hand each prefilled request off as a KV payload."""

from __future__ import annotations

from pdserve.rank.engine_rank import EngineRank


class PrefillRank(EngineRank):
    """Schedules prompts (chunked per the spec), samples the first token, exports KV."""

    pool_name = "prefill"
    engine_type = "prompt"
