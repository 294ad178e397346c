"""Prefill ranks: PROMPT engines that hand each prefilled request off as a KV payload.

A prompt's life on a prefill rank (after the common steps in rank/engine_rank.py):

1. The engine writes each finished prompt's KV (and, for a streamed prompt, each chunk
   ahead of it) straight into a buffer the rank's KV endpoint lends (``payload_buffer``:
   shared memory on ``ray``, a device tensor on ``device``).
2. ``_export_step`` exports those payloads through the endpoint and turns them into the
   step report's ``HandoffTicket``s and ``KVChunkTicket``s; a streamed prompt whose
   decode rank the router named is handed to that rank directly
   (``RankEndpoint.hand_off_directly``), its ticket carrying where the answer comes.
3. The payload stays on the endpoint until the router releases it (``release_kv``).
"""

from __future__ import annotations

import time

from pdserve.engine.outputs import HandOff, StepOutputs
from pdserve.rank.engine_rank import EngineRank, prefill_timings
from pdserve.rank.messages import HandoffTicket, KVChunkTicket


class PrefillRank(EngineRank):
    """Schedules prompts (chunked per the spec), samples the first token, exports KV."""

    pool_name = "prefill"
    engine_type = "prompt"

    def __init__(self, engine_config: dict, **kwargs) -> None:
        super().__init__(engine_config, **kwargs)
        if hasattr(self.engine, "payload_buffer"):
            self.engine.payload_buffer = self.endpoint.payload_buffer

    def _staging_bytes(self) -> int:
        """Shared memory this rank may keep for payloads on their way: what its KV cache
        holds, plus room for the payloads' headers (8 bytes a token id: a long prompt's
        streamed chunks each carry the ids so far) and segments' rounding (at most an
        eighth); payloads beyond that go through the object store. Only what is used is
        ever allocated."""
        kv = self.engine.kv_capacity().total_bytes
        return kv + kv // 4 + (16 << 20)

    def _export_step(self, out: StepOutputs) -> tuple[list[HandoffTicket], list[KVChunkTicket]]:
        kv_chunks = [KVChunkTicket.of(c, self.endpoint.export(c.key, c.payload))
                     for c in out.kv_chunks]
        return [self._export(h) for h in out.handoffs], kv_chunks

    def _export(self, handoff: HandOff) -> HandoffTicket:
        locator = self.endpoint.export(handoff.attempt, handoff.payload)
        timings = prefill_timings(handoff)
        if timings is not None:
            timings.kv_export_s = max(0.0, time.monotonic() - handoff.first_token_time)
            timings.kv_ready_wall = time.time() - timings.kv_export_s
        return HandoffTicket.of(handoff, locator, timings, direct_import=(
            self.endpoint.hand_off_directly(handoff.stream_of, locator)))
