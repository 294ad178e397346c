"""Prefill-pool workers: thin Ray actor bodies around a PROMPT engine rank."""

from pdserve.prefill_worker.actor import PrefillRank

__all__ = ["PrefillRank"]
