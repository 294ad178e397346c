"""A COMPLETION engine's KV streamed ahead of its request's hand-off (a partial import).

A PROMPT engine that streams a prompt's KV (``stream_kv``) sends the full blocks each
prompt chunk completes as a payload of kind "chunk" while the rest computes. Here each
chunk is written into blocks reserved for its attempt (``stream_of``), in order; the
hand-off's payload then leaves those blocks out and takes them over
(``take_prefix``). Blocks nobody continued are released (``expired``, ``drop``).
"""

from __future__ import annotations

import time
from collections.abc import Container, Iterator

from pdserve.engine.errors import NoCapacityError
from pdserve.engine.kv.payload import KVPayload, KVPayloadError
from pdserve.engine.model_runner import ModelRunner
from pdserve.scheduler.prefix_hash import chain_hashes
from pdserve.scheduler.scheduler import Scheduler


class PartialImport:
    """KV streamed ahead of a request's hand-off: blocks reserved and written here."""

    __slots__ = ("block_ids", "token_ids", "block_hashes", "updated")

    def __init__(self) -> None:
        self.block_ids: list[int] = []
        self.token_ids: list[int] = []  # the tokens of those blocks
        # their prefix-cache hashes, made as the chunks come (prefix caching on): the
        # hand-off's import then hashes only its own blocks, on the second token's path
        self.block_hashes: list[bytes] = []
        self.updated = time.monotonic()


class PartialImports:
    """The partial imports of one engine, by the streamed attempt (``stream_of``)."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, block_size: int) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.block_size = block_size
        self._by_stream: dict[str, PartialImport] = {}

    def __len__(self) -> int:
        return len(self._by_stream)

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_stream)

    def add_chunk(self, chunk: KVPayload, in_flight: Container[str]) -> None:
        """Write a streamed chunk into blocks reserved for its attempt; it must start
        where the chunks before it ended, and its attempt not be ``in_flight`` yet."""
        partial = self._by_stream.get(chunk.stream_of)
        have = len(partial.block_ids) if partial is not None else 0
        if chunk.skipped_blocks != have:
            raise KVPayloadError(f"KV chunk {chunk.attempt!r} starts at block "
                                 f"{chunk.skipped_blocks}, but {have} blocks of "
                                 f"{chunk.stream_of!r} arrived before it")
        if partial is not None and chunk.token_ids[:have * self.block_size] \
                != partial.token_ids:
            raise KVPayloadError(f"KV chunk {chunk.attempt!r}: its tokens differ from the "
                                 "chunks before it")
        if chunk.stream_of in in_flight:
            raise KVPayloadError(f"request {chunk.stream_of!r} is already here: no more chunks")
        self.runner.check_kv_import(chunk.tensors, chunk.num_prompt_tokens, have)
        block_ids = self._write(chunk, chunk.num_prompt_tokens // self.block_size - have)
        if partial is None:
            partial = self._by_stream[chunk.stream_of] = PartialImport()
        partial.block_ids += block_ids
        partial.token_ids = list(chunk.token_ids)
        if self.scheduler.caching:
            partial.block_hashes = chain_hashes(partial.token_ids, self.block_size,
                                                len(partial.block_ids), partial.block_hashes)
        partial.updated = time.monotonic()

    def _write(self, chunk: KVPayload, num_blocks: int) -> list[int]:
        block_ids = self.scheduler.reserve_blocks(num_blocks)
        if block_ids is None:
            raise NoCapacityError(f"no room for {num_blocks} blocks of streamed KV of "
                                  f"{chunk.stream_of!r}")
        try:
            self.runner.write_kv_blocks(block_ids, chunk.tensors["k_blocks"],
                                        chunk.tensors["v_blocks"])
        except Exception:
            self.scheduler.release_blocks(block_ids)
            raise
        return block_ids

    def take_prefix(self, payload: KVPayload, prompt: list[int]) -> list[int] | None:
        """The blocks of the prefix ``payload`` left out, if its streamed chunks hold all
        of them (the rest of them released, their hashes handed to the payload); None
        otherwise, a partial import too short to serve being dropped."""
        skipped = payload.skipped_blocks
        partial = self._by_stream.get(payload.stream_of) if payload.stream_of else None
        if partial is not None and len(partial.block_ids) >= skipped:
            if prompt[:len(partial.token_ids)] != partial.token_ids:
                raise KVPayloadError(f"request {payload.attempt!r}: its prompt differs from "
                                     f"the tokens its streamed KV chunks carried")
            del self._by_stream[payload.stream_of]
            self.scheduler.release_blocks(partial.block_ids[skipped:])
            payload.cached_block_hashes = partial.block_hashes[:skipped]
            return partial.block_ids[:skipped]
        if partial is not None:  # short of what the payload left out: of no use now
            self.drop(payload.stream_of)
        return None

    def drop(self, stream_of: str) -> bool:
        partial = self._by_stream.pop(stream_of, None)
        if partial is not None:
            self.scheduler.release_blocks(partial.block_ids)
        return partial is not None

    def expired(self, max_age_s: float) -> list[str]:
        """The attempts whose chunks nobody continued for ``max_age_s`` seconds."""
        cutoff = time.monotonic() - max_age_s
        return [k for k, p in self._by_stream.items() if p.updated < cutoff]
