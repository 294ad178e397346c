"""Decode ranks (COMPLETION engines) and, for `--mode normal`, NORMAL engine ranks."""

from __future__ import annotations

from pdserve.rank.engine_rank import EngineRank


class DecodeRank(EngineRank):
    """Imports prefilled KV payloads and decodes them; one rank of the decode pool."""

    pool_name = "decode"
    engine_type = "completion"


class NormalRank(EngineRank):
    """Does both phases (the step-kind votes decide each step); the `normal` pool."""

    pool_name = "normal"
    engine_type = "normal"
