"""The GPU backend (``engine/backends/gpu``) against the CPU backend, step by step,
through the runner: fresh prompts, chunked prefill beside decode rows, a prefix-cache
hit, a fork's copied block, decode steps padded to a graph's size, on both built-in
variants (full attention; sliding window: every layer a ring). Here on CPUs under
Triton's interpreter (the graphs' buffers and padding, run eagerly); on a GPU, captured
and replayed."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.backends.gpu.graphs import graph_sizes
from pdserve.engine.backends.gpu.inputs import Layout, fill
from pdserve.engine.model.tiny import make_tiny_model
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.step_inputs import RunnerRow


@pytest.fixture(scope="module", params=["llama", "mistral-swa"])
def runners(request, tmp_path_factory, device):
    path = make_tiny_model(tmp_path_factory.mktemp(request.param) / "m", request.param)
    common = dict(block_size=16, num_kv_blocks=40, num_state_slots=9, seed=0)
    cpu = ModelRunner(path, backend="cpu", **common)
    gpu = ModelRunner(path, device=device, backend="gpu", max_num_seqs=6, **common)
    return cpu, gpu


def _same(cpu, gpu, rows, atol=2e-5):
    want = cpu.compute_logits(rows)
    got = gpu.compute_logits(rows).cpu()
    torch.testing.assert_close(got, want, atol=atol, rtol=1e-4)
    return want.argmax(-1).tolist()


def test_steps_equal_the_cpu_backend(runners):
    cpu, gpu = runners
    a = list(range(10, 47))  # 37 tokens: 3 blocks
    b = list(range(60, 68))
    # fresh prompts; then a chunk over cached blocks beside a decode row
    nxt = _same(cpu, gpu, [RunnerRow(a[:20], 0, [1, 2, 3], 1), RunnerRow(b, 0, [4], 2)])
    nxt = _same(cpu, gpu, [RunnerRow(a[20:], 20, [1, 2, 3], 1),
                           RunnerRow([nxt[1]], 8, [4], 2)])
    lengths = {1: 37, 2: 9}
    tables = {1: [1, 2, 3], 2: [4]}
    tokens = {1: nxt[0], 2: 7}
    for step in range(4):  # decode: 2 rows, padded to a graph of 2; then 3 rows (4)
        rows = [RunnerRow([tokens[s]], lengths[s], tables[s], s) for s in sorted(tokens)]
        out = _same(cpu, gpu, rows)
        for s, t in zip(sorted(tokens), out, strict=True):
            tokens[s], lengths[s] = t, lengths[s] + 1
        if step == 1:  # a third request: a prompt then decode
            _same(cpu, gpu, [RunnerRow(b[:5], 0, [5], 3)])
            tokens[3], lengths[3], tables[3] = 11, 5, [5]


def test_prefix_hit_and_fork_equal_a_cold_run(runners):
    """A prompt whose first block is another request's (a prefix-cache hit: only the
    rest is computed), and a fork whose partial block was copied, equal cold runs."""
    cpu, gpu = runners
    prompt = list(range(100, 140))
    cold = _same(cpu, gpu, [RunnerRow(prompt, 0, [6, 7, 8], 4)])
    if cpu.kv_cache.ring_layers:  # a ring model reuses state slots, not blocks
        gpu.kv_cache.copy_state(4, 5)
        cpu.kv_cache.copy_state(4, 5)
    hit = _same(cpu, gpu, [RunnerRow(prompt[16:], 16, [6, 9, 10], 5)])
    assert hit == cold
    for r in (cpu, gpu):  # a fork: block 8 (positions 32..39) copied to block 11
        r.kv_cache.copy_block(8, 11)
        if r.kv_cache.ring_layers:
            r.kv_cache.copy_state(4, 6)
    forked = _same(cpu, gpu, [RunnerRow([cold[0]], 40, [6, 7, 11], 6)])
    again = _same(cpu, gpu, [RunnerRow([cold[0]], 40, [6, 7, 8], 4)])
    assert forked == again


def test_graph_sizes():
    assert graph_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert graph_sizes(6) == [1, 2, 4, 6]
    assert graph_sizes(1) == [1]
    with pytest.raises(ValueError, match="max_rows"):
        graph_sizes(0)


def test_padding_rows_write_nothing_and_see_one_key(runners):
    cpu, _ = runners
    layout = Layout(rows=4, tokens=4, width=3)
    host = torch.full((layout.size(),), 99, dtype=torch.int32)
    views = layout.views(host)
    fill(views, [RunnerRow([5], 20, [3, 7], 2)], cpu.kv_cache, padded_rows=4)
    assert views["cu_q"].tolist() == [0, 1, 2, 3, 4]
    assert views["seq_lens"].tolist() == [21, 1, 1, 1]
    assert views["slots"].tolist()[1:] == [-1, -1, -1]
    assert views["ring_slots"].tolist()[1:] == [-1, -1, -1]
    assert views["tables"][1:, 0].tolist() == [0, 0, 0]
    if cpu.kv_cache.full_layers:
        assert views["slots"][0] == 7 * 16 + 4
        assert views["tables"][0, :2].tolist() == [3, 7]
    else:
        assert views["ring_slots"][0] == 2 * cpu.kv_cache.ring_len + 20
