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
_ID_BYTES = array("q").itemsize  # a token id is hashed as an int64
# Never updated itself: copying it is cheaper than a new hasher given its digest size.
_EMPTY_HASHER = blake2b(digest_size=DIGEST_BYTES)


def chain_hashes(token_ids: list[int], block_size: int, num_blocks: int,
                 previous: list[bytes] | None = None) -> list[bytes]:
    """Hashes of the first ``num_blocks`` full blocks of ``token_ids``; ``previous``
    holds hashes already known for its first blocks (they are kept, not recomputed).
    Block i's hash is BLAKE2b(hash of block i - 1 + its token ids as int64 bytes)."""
    hashes = list(previous or ())
    parent = hashes[-1] if hashes else _ROOT + block_size.to_bytes(4, "little")
    first = len(hashes)
    # The new blocks' ids converted at once; each block is a slice of those bytes.
    data = array("q", token_ids[first * block_size:num_blocks * block_size]).tobytes()
    width = block_size * _ID_BYTES
    for start in range(0, (num_blocks - first) * width, width):
        hasher = _EMPTY_HASHER.copy()
        hasher.update(parent)
        hasher.update(data[start:start + width])
        parent = hasher.digest()
        hashes.append(parent)
    return hashes


def cacheable_blocks(num_tokens: int, block_size: int) -> int:
    """Full blocks of a prompt that a new request may take from the cache: never the
    one holding its last token, whose logits the request must compute itself."""
    return max(0, num_tokens - 1) // block_size
