"""Decode steps replayed from CUDA graphs: one graph per padded batch size.

A step of ``n`` decode rows takes the graph of the smallest size >= ``n`` (sizes
``GRAPH_SIZES`` up to the rank's ``max_num_seqs``); its inputs are written into the
graph's one device buffer (``inputs.Layout`` at the largest size) by two non-blocking
copies, the graph replays (a whole step: embedding, every layer, the final norm and
the LM head: one launch), and the first ``n`` rows of its logits are the step's.
Steps with prompt rows, or more decode rows than the largest graph, run eagerly.

Graphs are captured at start (``capture``: time and memory reported). Without CUDA
(the suite on CPUs) nothing is captured and ``run`` executes the same padded step
eagerly through the same buffers, so padding and the buffers are tested there.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from pdserve.engine.backends.gpu.inputs import (
    GpuMetadata,
    Layout,
    fill,
    host_buffer,
    table_width,
)
from pdserve.engine.step_inputs import check_rows
from pdserve.kernels.gpu.attention import decode_splits

GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
log = logging.getLogger(__name__)


def graph_sizes(max_rows: int) -> list[int]:
    """The padded batch sizes captured for a rank that decodes at most ``max_rows``."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    return [s for s in GRAPH_SIZES if s < max_rows] + [max_rows]


class DecodeGraphs:
    def __init__(self, model, backend, max_rows: int):
        self.model, self.backend, self.cache = model, backend, backend.cache
        self.sizes = graph_sizes(max_rows)
        cap = self.sizes[-1]
        self.layout = Layout(rows=cap, tokens=cap, width=backend.max_blocks)
        dev = backend.device
        self.buffer = torch.zeros(self.layout.size(), dtype=torch.int32, device=dev)
        self.views = self.layout.views(self.buffer)
        self.host = host_buffer(self.layout.size(), dev)
        self.vector_len = self.layout.offsets()["tables"][0]  # the fields before the tables
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_seconds: float | None = None
        self.capture_bytes: int | None = None

    def fits(self, rows) -> bool:
        bs = self.cache.block_size
        return (len(rows) <= self.sizes[-1]
                and all(len(r.token_ids) == 1 for r in rows)
                and max(r.start_pos for r in rows) < self.layout.width * bs)

    def size_for(self, n: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, n)]

    def run(self, rows) -> torch.Tensor:
        """Logits [len(rows), V] of a decode step (``fits``)."""
        check_rows(rows, self.cache.block_size, self.cache)
        size = self.size_for(len(rows))
        self._upload(rows, size)
        entry = self.graphs.get(size)
        if entry is None:
            return self._forward(size)[:len(rows)]
        graph, logits = entry
        graph.replay()
        return logits[:len(rows)]

    def _upload(self, rows, size: int) -> None:
        width = table_width(rows, self.cache.block_size)
        views = self.layout.views(self.host)
        # this step's tables, compact: one contiguous copy of [size, width]
        views["tables"] = self.host[self.vector_len:self.vector_len + size * width].view(
            size, width)
        fill(views, rows, self.cache, padded_rows=size)
        self.buffer[:self.vector_len].copy_(self.host[:self.vector_len], non_blocking=True)
        self.views["tables"][:size, :width].copy_(views["tables"].to(
            self.buffer.device, non_blocking=True))

    def _forward(self, size: int) -> torch.Tensor:
        v = self.views
        meta = GpuMetadata(
            positions=v["positions"][:size], slots=v["slots"][:size],
            ring_slots=v["ring_slots"][:size], cu_q=v["cu_q"][:size + 1],
            seq_lens=v["seq_lens"][:size], state_slots=v["state_slots"][:size],
            tables=v["tables"][:size], max_q=1,
            splits=decode_splits(size, self.cache.num_kv_heads, self.backend.units),
            max_position=self.layout.width * self.cache.block_size - 1, num_tokens=size,
            ring_write_first=True)
        hidden = self.model(v["tokens"][:size], meta.positions, self.cache, meta)
        return self.model.compute_logits(hidden)

    def capture(self) -> None:
        """Capture every size's graph (largest first, one memory pool); without CUDA,
        nothing."""
        if self.buffer.device.type != "cuda":
            return
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        start = time.perf_counter()
        cap = self.sizes[-1]
        self._upload([], cap)  # every row padding: nothing is written to the cache
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        for size in reversed(self.sizes):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # compiles the kernels for this size
                self._forward(size)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(size)
            self.graphs[size] = (graph, logits)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        self.capture_bytes = free_before - torch.cuda.mem_get_info()[0]
        log.info("captured %d decode graphs (batch sizes %s) in %.1f s, %.0f MiB",
                 len(self.sizes), self.sizes, self.capture_seconds, self.capture_bytes / 2**20)
