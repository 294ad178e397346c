"""The runner equals transformers: greedy tokens (fp32, token for token) and logits."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.model_runner import ModelRunner, RunnerRow

# Mixed lengths: short, crossing blocks (16), longer than the window (32), longer
# than the default ring (134).
LENGTHS = [3, 17, 40, 90, 150]
MAX_NEW = 12
LOGIT_TOL = 1e-4

_REF: dict = {}


def reference(h, path):
    key = str(path)
    if key not in _REF:
        prompts = h.prompts_of(LENGTHS)
        _REF[key] = (prompts, [h.hf_greedy(path, p, MAX_NEW) for p in prompts])
    return _REF[key]


@pytest.mark.parametrize("variant", ["llama", "mistral-swa"])
@pytest.mark.parametrize("budget,mixed", [(None, True), (7, True), (16, False), (50, True),
                                          (128, False)])
def test_greedy_matches_transformers(tiny_dirs, h, variant, budget, mixed):
    path = tiny_dirs[variant]
    prompts, want = reference(h, path)
    assert len({t for w in want for t in w}) > 10, "tiny model outputs are degenerate"
    runner = ModelRunner(path, block_size=16, num_kv_blocks=128, num_state_slots=8)
    got = h.drive(runner, prompts, MAX_NEW, budget=budget, mixed=mixed)
    assert got == want


def test_swa_ring_equal_to_window(tiny_dirs, h):
    """The smallest legal ring (R = window = 32) with chunks longer than the ring."""
    path = tiny_dirs["mistral-swa"]
    prompts, want = reference(h, path)
    runner = ModelRunner(path, num_kv_blocks=128, num_state_slots=8, ring_len=32)
    assert runner.ring_len == 32
    assert h.drive(runner, prompts, MAX_NEW, budget=45) == want


def test_swa_ring_shorter_than_window_refused(tiny_dirs):
    with pytest.raises(ValueError, match="ring_len 16 is shorter than the sliding window 32"):
        ModelRunner(tiny_dirs["mistral-swa"], num_kv_blocks=8, num_state_slots=2, ring_len=16)


@pytest.mark.parametrize("variant", ["llama", "mistral-swa"])
def test_logits_match_transformers(tiny_dirs, h, variant):
    """Logits at every chunk end and every decode step, within LOGIT_TOL (fp32)."""
    path = tiny_dirs[variant]
    hf = h.hf_model(path)
    (prompt,) = h.prompts_of([150], seed=3)
    extra = h.prompts_of([9], seed=4)[0][1:]
    full = prompt + extra
    with torch.no_grad():
        ref = hf(torch.tensor([full])).logits[0]
    runner = ModelRunner(path, num_kv_blocks=32, num_state_slots=2)
    blocks = list(range(5, 5 + 11))
    worst = 0.0
    pos = 0
    for q in [37, 37, 1, 60, 15]:  # chunk ends at 37, 74, 75, 135, 150
        lg = runner.compute_logits([RunnerRow(prompt[pos:pos + q], pos, blocks, 1)])
        pos += q
        worst = max(worst, (lg[0] - ref[pos - 1]).abs().max().item())
    for t in extra:  # decode rows
        lg = runner.compute_logits([RunnerRow([t], pos, blocks, 1)])
        pos += 1
        worst = max(worst, (lg[0] - ref[pos - 1]).abs().max().item())
    assert worst < LOGIT_TOL, worst


@pytest.mark.parametrize("variant", ["llama", "mistral-swa"])
def test_batch_of_rows_matches_single_rows(tiny_dirs, h, variant):
    """A step mixing every kind of row (fresh prompts, a continued chunk, decode rows)
    gives each row the logits it gets alone."""
    path = tiny_dirs[variant]
    prompts = h.prompts_of([60, 45, 20, 33, 70], seed=9)
    a = ModelRunner(path, num_kv_blocks=64, num_state_slots=8)
    b = ModelRunner(path, num_kv_blocks=64, num_state_slots=8)
    tables = [list(range(1 + 5 * i, 6 + 5 * i)) for i in range(5)]
    for r in (a, b):  # cached before the step: rows 2, 3 (all but one token), row 4 (10)
        r.compute_logits([RunnerRow(prompts[i][:-1], 0, tables[i], i) for i in (2, 3)] +
                         [RunnerRow(prompts[4][:10], 0, tables[4], 4)])
    rows = [
        RunnerRow(prompts[0][:50], 0, tables[0], 0),
        RunnerRow(prompts[2][-1:], 19, tables[2], 2),
        RunnerRow(prompts[4][10:], 10, tables[4], 4),
        RunnerRow(prompts[1], 0, tables[1], 1),
        RunnerRow(prompts[3][-1:], 32, tables[3], 3),
    ]
    together = a.compute_logits(rows)
    alone = torch.cat([b.compute_logits([r]) for r in rows])
    assert (together - alone).abs().max().item() < LOGIT_TOL


def test_bfloat16_runs_and_agrees_loosely(tiny_dirs, h):
    path = tiny_dirs["llama"]
    (prompt,) = h.prompts_of([40], seed=5)
    f32 = ModelRunner(path, dtype="float32", num_kv_blocks=8)
    b16 = ModelRunner(path, dtype="bfloat16", num_kv_blocks=8)
    assert b16.kv_cache.k_blocks[0].dtype == torch.bfloat16
    lf = f32.compute_logits([RunnerRow(prompt, 0, [1, 2, 3])])
    lb = b16.compute_logits([RunnerRow(prompt, 0, [1, 2, 3])])
    assert torch.isfinite(lb).all()
    assert torch.corrcoef(torch.stack([lf[0], lb[0]]))[0, 1] > 0.98


def test_bad_rows_are_refused(tiny_dirs):
    llama = ModelRunner(tiny_dirs["llama"], num_kv_blocks=8)
    with pytest.raises(ValueError, match="row 0: block_table has 2 blocks of 16, too few for "
                                         "seqlen_k 40"):
        llama.execute([RunnerRow(list(range(3, 43)), 0, [1, 2])])
    with pytest.raises(ValueError, match="row 0: token_ids is empty"):
        llama.execute([RunnerRow([], 0, [1])])
    swa = ModelRunner(tiny_dirs["mistral-swa"], num_kv_blocks=8, num_state_slots=2)
    with pytest.raises(ValueError, match=r"row 1: state_slot 2 out of range \[0, 2\)"):
        swa.execute([RunnerRow([5], 0, [1], 0), RunnerRow([5], 0, [2], 2)])
    assert llama.execute([]) == []
    assert llama.execute([RunnerRow([5, 6], 0, [1], sample=False)]) == [None]
