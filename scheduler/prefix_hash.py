"""Block hashes for prefix caching: what names a full block's KV, on a rank and in the router.

Block i of a history holds positions [i * block_size, (i + 1) * block_size). Its hash
chains the hash of block i - 1 with its own token ids, so equal hashes mean equal
histories up to and including the block, and so equal KV (a rank serves one model in
one dtype: its cache is its own, and the router only compares hashes to find which
rank holds a prefix). BLAKE2b with a 128-bit digest: a collision would serve another
prompt's KV, so no 64-bit hash. Torch-free: the router computes the same hashes.
"""

from __future__ import annotations

from array import array
from hashlib import blake2b

DIGEST_BYTES = 16
_ROOT = b"pdserve-prefix-v1"


def chain_hashes(token_ids: list[int], block_size: int, num_blocks: int,
                 previous: list[bytes] | None = None) -> list[bytes]:
    """Hashes of the first ``num_blocks`` full blocks of ``token_ids``; ``previous``
    holds hashes already known for its first blocks (they are kept, not recomputed)."""
    hashes = list(previous or ())
    parent = hashes[-1] if hashes else _ROOT + block_size.to_bytes(4, "little")
    for i in range(len(hashes), num_blocks):
        block = array("q", token_ids[i * block_size:(i + 1) * block_size]).tobytes()
        parent = blake2b(parent + block, digest_size=DIGEST_BYTES).digest()
        hashes.append(parent)
    return hashes


def cacheable_blocks(num_tokens: int, block_size: int) -> int:
    """Full blocks of a prompt that a new request may take from the cache: never the
    one holding its last token, whose logits the request must compute itself."""
    return max(0, num_tokens - 1) // block_size
