"""The weights a decode step sweeps live in one arena on 2 MiB pages (kernels/huge_pages.py):
copies bit for bit, aligned, bounded; on huge pages where Linux gives them; and a loaded
model's matmuls all read from the arena with unchanged results."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from pdserve.kernels.huge_pages import ALIGN, HUGE_PAGE, Arena


def test_take_copies_each_tensor_bit_for_bit_into_aligned_views():
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(3, 5, generator=g), torch.randint(0, 255, (77,), dtype=torch.uint8),
               torch.randn(0), torch.randn(16, 4, generator=g).half()]
    arena = Arena(sum(Arena.footprint(t) for t in tensors))
    views = [arena.take(t) for t in tensors]
    for t, v in zip(tensors, views, strict=True):
        assert v.shape == t.shape and v.dtype == t.dtype and v.is_contiguous()
        assert torch.equal(v, t) and (v.data_ptr() != t.data_ptr() or not t.numel())
        assert v.data_ptr() % ALIGN == 0
    assert views[0].data_ptr() % HUGE_PAGE == 0  # the arena starts on a huge page
    assert arena.used == arena.nbytes == 64 + 128 + 0 + 128
    tensors[0].zero_()
    assert views[0].abs().sum() > 0  # a copy, not the caller's memory
    with pytest.raises(ValueError, match="arena full: 320 of 320 bytes used, 64 more"):
        arena.take(torch.ones(1))
    with pytest.raises(ValueError, match="size must be >= 0"):
        Arena(-1)


def _huge_kib(address: int) -> int:
    """AnonHugePages of the mapping that holds ``address`` (Linux's smaps)."""
    at = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            at = int(m[1], 16) <= address < int(m[2], 16)
        elif at and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def _thp_mode() -> str | None:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not path.exists():
        return None
    m = re.search(r"\[(\w+)\]", path.read_text())
    return m[1] if m else None


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"),
                    reason="needs Linux with transparent huge pages (madvise or always)")
def test_an_arena_is_on_huge_pages_where_linux_has_them():
    """In Linux's default ``madvise`` mode, memory gets 2 MiB pages only when it asks
    before it is touched: the arena does; a plain tensor of the same size does not
    (checked where the mode is ``madvise``)."""
    t = torch.randn(3 * HUGE_PAGE // 4)  # 6 MiB
    arena = Arena(Arena.footprint(t))
    v = arena.take(t)
    assert arena.advised
    assert _huge_kib(v.data_ptr()) >= 2048
    if _thp_mode() == "madvise":
        assert _huge_kib(t.data_ptr()) == 0


def test_a_loaded_model_reads_every_matmul_from_one_arena(tiny_model_dir):
    """fp32 panels (a folder model) and quantized records (``int8`` at load) are moved
    into one arena at load; moving them again changes no result."""
    from pdserve.engine.model.llama import MatMul
    from pdserve.engine.model.quantized_weights import QuantEmbedding
    from pdserve.engine.model_runner import ModelRunner, RunnerRow

    ids, table = list(range(5, 45)), list(range(1, 8))
    for quantization in ("none", "int8"):
        runner = ModelRunner(tiny_model_dir, block_size=8, num_kv_blocks=16, num_state_slots=2,
                             ring_len=8, quantization=quantization)
        model = runner.model
        swept = [m.swept() for m in model.modules() if isinstance(m, MatMul)]
        assert swept and all(t is not None for t in swept)
        first = min(t.data_ptr() for t in swept)
        assert first % HUGE_PAGE == 0
        end = max(t.data_ptr() + t.numel() * t.element_size() for t in swept)
        assert end - first <= sum(Arena.footprint(t) for t in swept)  # side by side
        before = runner.compute_logits([RunnerRow(ids, 0, table, 1)])[0]
        moved = model.gather_swept_weights()
        model.use_decode_kernel(model.decode_kernel_on)  # its pointers, rebuilt
        assert all(m.swept().data_ptr() >= moved._memory.data_ptr()
                   for m in model.modules() if isinstance(m, MatMul))
        embed = model.model.embed_tokens
        if isinstance(embed, QuantEmbedding):  # a tied table reads the head's new records
            assert embed.quant is model.logits_proj.quant
        after = runner.compute_logits([RunnerRow(ids, 0, table, 1)])[0]
        assert torch.equal(before, after)
