"""The one collective the step-kind votes need (S9, S10)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class Communicator(Protocol):
    rank: int
    world_size: int

    def all_reduce_min(self, value: int) -> int:
        """Minimum of `value` over every rank of the data-parallel group."""
        ...


class SingleRankCommunicator:
    rank = 0
    world_size = 1

    def all_reduce_min(self, value: int) -> int:
        return value
