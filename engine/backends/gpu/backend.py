"""The GPU backend: pages read in place, fused layer ops, decode steps from CUDA graphs.

Request lifecycle of one step:

1. ``prepare``: the rows become one pinned int32 buffer (``inputs.py``), copied to the
   device without blocking; the metadata is views of it plus host-side bounds.
2. ``run``: a decode step whose rows fit a captured graph replays it
   (``graphs.py``); any other step runs the model eagerly.
3. ``forward`` (per layer): the step's K/V written to their pages
   (``layer_ops.write_kv``), then ``kernels/gpu/attention.paged_attention`` over the
   block tables. Sliding-window layers write their ring first and read it in place when
   every row is a decode row; a step with prompt rows runs their rings through the
   torch reference (``kernels/attention``), which reads before it writes (spec S37).
4. The runner samples from the logits: reading the tokens is the step's one host sync.
"""

from __future__ import annotations

import torch

from pdserve.engine.backends.base import AttentionBackend, StepInputs, StepLogits
from pdserve.engine.backends.gpu.graphs import DecodeGraphs
from pdserve.engine.backends.gpu.inputs import (
    GpuMetadata,
    Layout,
    fill,
    host_buffer,
    table_width,
)
from pdserve.engine.backends.gpu.ops import FusedOps
from pdserve.engine.step_inputs import check_rows, general_inputs
from pdserve.kernels.attention import attention_step
from pdserve.kernels.gpu import layer_ops
from pdserve.kernels.gpu.attention import decode_splits, paged_attention


class GpuBackend(AttentionBackend):
    name = "gpu"

    def __init__(self, model, cache, max_rows: int, graphs: bool = True):
        self.cache = cache
        self.device = cache.device
        cfg = model.cfg
        self.ops = FusedOps(*model.rope.tables(cache.dtype, cfg.max_position_embeddings))
        on_cuda = self.device.type == "cuda"
        self.units = (torch.cuda.get_device_properties(self.device).multi_processor_count
                      if on_cuda else 8)
        self.max_blocks = -(-cfg.max_position_embeddings // cache.block_size)
        self.graphs = DecodeGraphs(model, self, max_rows) if graphs else None

    def start(self) -> None:
        if self.graphs is not None:
            self.graphs.capture()

    # ---- metadata -------------------------------------------------------------
    def prepare(self, rows) -> StepInputs:
        cache = self.cache
        check_rows(rows, cache.block_size, cache)
        t = sum(len(r.token_ids) for r in rows)
        layout = Layout(rows=len(rows), tokens=t, width=table_width(rows, cache.block_size))
        host = host_buffer(layout.size(), self.device)
        fill(layout.views(host), rows, cache)
        dev = layout.views(host.to(self.device, non_blocking=True))
        meta = self.metadata(dev, rows, t)
        return dev["tokens"], dev["positions"], meta, dev["last"]

    def metadata(self, dev: dict[str, torch.Tensor], rows, num_tokens: int) -> GpuMetadata:
        """``dev``: the fields' device views (``Layout.views``)."""
        max_q = max(len(r.token_ids) for r in rows)
        decode = max_q == 1
        meta = GpuMetadata(
            positions=dev["positions"], slots=dev["slots"], ring_slots=dev["ring_slots"],
            cu_q=dev["cu_q"], seq_lens=dev["seq_lens"], state_slots=dev["state_slots"],
            tables=dev["tables"], max_q=max_q,
            splits=decode_splits(len(rows), self.cache.num_kv_heads, self.units) if decode else 1,
            max_position=max(r.start_pos + len(r.token_ids) for r in rows) - 1,
            num_tokens=num_tokens, ring_write_first=decode)
        if self.cache.ring_layers and not decode:
            ref = general_inputs(rows, None, self.device, self.cache.block_size, self.cache)[2]
            ref.max_position = meta.max_position
            meta.reference = ref
        return meta

    # ---- one layer --------------------------------------------------------------
    def forward(self, layer, q, k, v, cache, meta: GpuMetadata, scale):
        window = cache.layer_windows[layer]
        if window is not None and not meta.ring_write_first:
            return attention_step(q, k, v, layer, cache, meta.reference, scale)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if window is None:
            kc, vc = cache.k_blocks[layer], cache.v_blocks[layer]
            layer_ops.write_kv(k, v, kc, vc, meta.slots)
            return paged_attention(q, kc, vc, out, meta.cu_q, meta.seq_lens, meta.max_q, scale,
                                   tables=meta.tables, num_splits=meta.splits)
        kc, vc = cache.k_ring[layer], cache.v_ring[layer]
        layer_ops.write_kv(k, v, kc, vc, meta.ring_slots)
        return paged_attention(q, kc, vc, out, meta.cu_q, meta.seq_lens, meta.max_q, scale,
                               slots=meta.state_slots, ring_len=cache.ring_len, window=window,
                               num_splits=meta.splits)

    # ---- the step ---------------------------------------------------------------
    def run(self, model, rows, want: list[int], greedy: bool = False) -> StepLogits:
        """fp32 logits at the last token of each row in ``want``: a decode step that
        fits a captured graph replays it, any other runs eagerly (``greedy``: the
        sampler takes the argmax itself)."""
        return StepLogits(self._logits(model, rows, want))

    def _logits(self, model, rows, want: list[int]) -> torch.Tensor | None:
        if self.graphs is not None and len(want) == len(rows) and self.graphs.fits(rows):
            return self.graphs.run(rows)
        tokens, positions, meta, last = self.prepare(rows)
        if not want:
            model(tokens, positions, self.cache, meta, last[:1])
            return None
        if len(want) == meta.cu_q.shape[0] - 1:
            keep = None if meta.max_q == 1 else last
        else:
            keep = last.index_select(0, torch.tensor(want).to(last.device, non_blocking=True))
        return model.compute_logits(model(tokens, positions, self.cache, meta, keep))
