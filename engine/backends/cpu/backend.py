"""The CPU backend: what only a CPU run needs, behind the seam.

- a decode step runs as one C call (``engine/model/decode_kernel``, ``kernels/decode_step``)
  where the model and CPU allow: it reads the paged cache through the block tables;
- otherwise decode rows attend over contiguous copies of their K/V
  (``kernels/decode_kv``: on a CPU a gather costs more than the attention), and prompt
  rows through the torch reference (``kernels/attention``);
- the thread tuner picks each step's thread count (``thread_tuner.py`` beside this file).

The matmul layouts (panels, packed, quantized records) stay with the weights
(``engine/model.MatMul``): they are chosen once at load.
"""

from __future__ import annotations

from pdserve.engine.backends.base import (
    AttentionBackend,
    LayerOps,
    ReferenceAttention,
    StepInputs,
    StepLogits,
)
from pdserve.engine.backends.cpu.thread_tuner import ThreadTuner
from pdserve.engine.step_inputs import check_rows, decode_inputs, general_inputs
from pdserve.kernels.decode_kv import DecodeKV
from pdserve.kernels.kv_cache import KVCache


class CpuBackend(AttentionBackend):
    name = "cpu"
    ops = LayerOps()

    def __init__(self, model, cache: KVCache, kv_budget_bytes: int, adaptive_threads: bool):
        self.model = model
        self.cache = cache
        # Contiguous K/V of decode rows, capped at the cache's own budget.
        self.decode_kv = DecodeKV(cache, max_bytes=kv_budget_bytes)
        self.threads = ThreadTuner(enabled=adaptive_threads)

    def step_scope(self, rows):
        """The context a whole step (sampling included) runs in: its thread count."""
        return self.threads.step(rows)

    def prepare(self, rows) -> StepInputs:
        cache = self.cache
        check_rows(rows, cache.block_size, cache)
        decode_rows = [i for i, r in enumerate(rows) if len(r.token_ids) == 1]
        all_decode = len(decode_rows) == len(rows)
        kernel_step = all_decode and self.model.decode_kernel_on
        if kernel_step:
            # The C step reads the paged cache through the block tables (and the rings
            # through the state slots): no contiguous copy to plan, and the copy's slots
            # are stale from now on.
            self.decode_kv.forget()
            plan = None
        else:
            # Every other step plans the contiguous decode K/V (a step without decode
            # rows drops all slots: see DecodeKV's safety rules).
            plan = self.decode_kv.plan([rows[i].block_table for i in decode_rows],
                                       [rows[i].start_pos for i in decode_rows])
        args = (rows, plan, cache.device, cache.block_size, cache)
        if kernel_step or (all_decode and not cache.ring_layers):
            tokens, positions, meta, last = decode_inputs(*args)
        else:
            tokens, positions, meta, last = general_inputs(*args)
        meta.decode_kv, meta.decode_plan = self.decode_kv, plan
        meta.max_position = max(r.start_pos + len(r.token_ids) for r in rows) - 1
        return tokens, positions, meta, last

    forward = staticmethod(ReferenceAttention.forward)  # decode rows: meta.decode_kv

    def run(self, model, rows, want: list[int], greedy: bool = False) -> StepLogits:
        tokens, positions, meta, last = self.prepare(rows)
        if len(want) == tokens.shape[0]:  # a decode step: every token is kept
            return StepLogits(*model.decode_logits(tokens, positions, self.cache, meta, greedy))
        keep = last[want] if want else last[:1]  # no 0-row matmuls
        hidden = model(tokens, positions, self.cache, meta, keep)
        return StepLogits(model.compute_logits(hidden) if want else None)
