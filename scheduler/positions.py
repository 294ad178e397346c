"""Query positions and sliding-window ring destinations of a scheduled row (S36, S37).

Pure Python so the kernels can mirror it and tests can check both against each other.
"""

from __future__ import annotations

DEFAULT_RING_LEN = 134


def query_positions(seqlen_k: int, q: int) -> range:
    return range(seqlen_k - q, seqlen_k)


def ring_destinations(seqlen_k: int, q: int, state_slot: int, ring_len: int = DEFAULT_RING_LEN) -> list[int]:
    """Ring row of each query j of a chunk; -1 for queries the ring cannot keep
    (only the last ring_len positions of a chunk longer than the ring survive)."""
    base = state_slot * ring_len
    start = seqlen_k - q
    return [base + (start + j) % ring_len if q - j <= ring_len else -1 for j in range(q)]
