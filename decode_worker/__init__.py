"""Decode-pool workers: thin Ray actor bodies around a COMPLETION engine rank."""

from pdserve.decode_worker.actor import DecodeRank, NormalRank

__all__ = ["DecodeRank", "NormalRank"]
