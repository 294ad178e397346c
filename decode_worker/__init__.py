"""Decode-pool workers: thin Ray actor bodies around a COMPLETION engine rank."""

from pdserve.decode_worker.actor import DecodeRank

__all__ = ["DecodeRank"]
