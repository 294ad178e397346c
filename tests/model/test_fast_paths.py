"""The runner's fast paths equal its general paths: fused matmuls, the contiguous
decode K/V (vs gathering blocks), the all-greedy sampler, the decode-only prepare."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.model.llama import MatMul
from pdserve.engine.model_runner import ModelRunner, RunnerRow
from pdserve.kernels import cbuild
from pdserve.kernels.sampling import sample
from pdserve.scheduler.sampling_params import SamplingParams

TOL = 1e-5


def test_fused_matmul_equals_separate_linears():
    torch.manual_seed(0)
    parts = [nn.Linear(32, 24, bias=True), nn.Linear(32, 8, bias=True), nn.Linear(32, 8)]
    x = torch.randn(5, 32)
    fused = MatMul.fuse(parts)
    want = torch.cat([m(x) for m in parts], dim=-1)
    assert (fused.in_features, fused.out_features) == (32, 40)
    assert fused.transposed is not None  # small, 40 outputs (not panels): W.T for decode rows
    assert torch.equal(fused.transposed, fused.weight.t())
    assert (fused(x) - want).abs().max().item() < 1e-5
    assert (fused(x[:1]) - want[:1]).abs().max().item() < 1e-5  # any row count
    nobias = MatMul.fuse([nn.Linear(32, 16, bias=False)])
    assert nobias.bias is None


def _kernel_off_reason(name: str) -> str:
    """Why the C kernel ``name`` is off on this machine (it builds for any CPU)."""
    return f"{name} needs a C compiler (cc, gcc or $CC) to build it; none built it here"


# Weight shape [out, in] -> the decode layout MatMul picks, with skinny_gemm built (any
# CPU with a C compiler) and without it (no compiler, or a build that failed).
# TRANSPOSED_MAX_NUMEL is 1.5M elements; 1600 * 1024 and 1601 * 1024 are above it.
LAYOUTS_BY_FEATURES = {
    (1600, 1024): ("panels", "packed"),      # out % 32 == 0; else too large for W.T
    (1024, 1024): ("panels", "transposed"),  # out % 32 == 0; else small enough for W.T
    (40, 32): ("transposed", "transposed"),  # out not a multiple of 32, small
    (1601, 1024): ("packed", "packed"),      # out not a multiple of 32, large
}


@pytest.mark.parametrize("features", ["skinny_gemm built", "no skinny_gemm (torch layouts)"])
def test_matmul_decode_layouts_by_rule_all_equal_linear(features, monkeypatch):
    """Panels (skinny_gemm) when out is a multiple of 32 and the kernel is built; else
    W.T up to TRANSPOSED_MAX_NUMEL elements, oneDNN-packed above (switched to W.T for
    compiled graphs). Every layout equals F.linear at decode and prefill row counts.

    Both are checked where the machine allows: "built" needs the kernel (skipped,
    naming what is missing, without it); "no skinny_gemm" turns the kernel off
    (``skinny_gemm.available``, the check MatMul makes, answers False as it does
    without a compiler), so one machine checks both rules."""
    from pdserve.engine.model.llama import _onednn_packing_available, linear
    from pdserve.kernels import skinny_gemm

    with_kernel = features == "skinny_gemm built"
    if with_kernel and not skinny_gemm.available():
        pytest.skip(_kernel_off_reason("skinny_gemm"))
    if not with_kernel:
        monkeypatch.setattr(skinny_gemm, "available", lambda isa=None: False)
    torch.manual_seed(0)
    for (n, k), (on_avx512, without_avx512) in LAYOUTS_BY_FEATURES.items():
        kind = on_avx512 if with_kernel else without_avx512
        if kind == "packed" and not _onednn_packing_available():
            kind = "transposed"  # no oneDNN packing in this torch build: W.T serves
        w, b = torch.randn(n, k) / 32, torch.randn(n)
        mm = MatMul(w, b)
        layout = {"panels": mm.panels, "transposed": mm.transposed, "packed": mm.packed}
        assert [key for key, v in layout.items() if v is not None] == [kind], (n, k, features)
        for rows in (1, 5, 16, 200):
            x = torch.randn(rows, k)
            assert (mm(x) - F.linear(x, w, b)).abs().max() < 1e-4, (kind, rows)
            assert (linear(x, mm.decode_operand(), b) - F.linear(x, w, b)).abs().max() < 1e-4 \
                or mm.packed is not None  # a packed weight is not a graph operand
        if mm.packed is not None:
            mm.use_transposed()
            assert mm.packed is None and mm.decode_operand().shape == (n, k)


@pytest.mark.parametrize("isa", cbuild.tested_isas())
def test_skinny_gemm_kernel_matches_linear_at_ragged_shapes(isa):
    """Every build this CPU runs (an AVX-512 one runs all three) and the emulated ones:
    ragged row, column and K counts around each ISA's register block equal F.linear."""
    from pdserve.kernels import skinny_gemm

    if not skinny_gemm.available(isa):
        pytest.skip(_kernel_off_reason("skinny_gemm"))
    mm = functools.partial(skinny_gemm.matmul, isa=isa)
    g = torch.Generator().manual_seed(1)
    for m, n, k in [(1, 32, 1), (3, 4, 5), (5, 20, 9), (7, 48, 33), (8, 96, 64),
                    (9, 200, 70), (33, 4096, 256)]:
        w, x, b = (torch.randn(n, k, generator=g), torch.randn(m, k, generator=g),
                   torch.randn(n, generator=g))
        panels = skinny_gemm.pack(w)
        assert panels.shape == (-(-n // 32) * 2, k, 16)
        assert (mm(x, panels, n, b) - F.linear(x, w, b)).abs().max() < 1e-4
        assert (mm(x, panels, n) - x @ w.T).abs().max() < 1e-4
    if isa == cbuild.host_isa():  # the operator compiled graphs call runs the host's
        op = torch.ops.pdserve.skinny_matmul(x, panels, n, None)
        assert torch.equal(op, skinny_gemm.matmul(x, panels, n))
    # Each output is one thread's in-order sum: the thread count cannot change a bit
    # (ThreadTuner relies on it).
    before = torch.get_num_threads()
    try:
        w, x = torch.randn(1280, 768, generator=g), torch.randn(16, 768, generator=g)
        torch.set_num_threads(1)
        one = mm(x, skinny_gemm.pack(w), 1280)
        torch.set_num_threads(2)
        assert torch.equal(one, mm(x, skinny_gemm.pack(w), 1280))
    finally:
        torch.set_num_threads(before)
    assert skinny_gemm.matmul(torch.empty(0, 8), skinny_gemm.pack(torch.ones(32, 8)), 32).shape == (0, 32)
    with pytest.raises(ValueError, match="does not fit"):
        skinny_gemm.matmul(torch.randn(2, 9), skinny_gemm.pack(torch.ones(32, 8)), 32)
    with pytest.raises(ValueError, match="does not fit"):
        skinny_gemm.matmul(torch.randn(2, 8).bfloat16(), skinny_gemm.pack(torch.ones(32, 8)), 32)


def _pair(path, kernel=False):
    """A runner with the decode K/V copy (torch path), or with ``kernel`` the C decode
    step (which reads the paged cache and skips the copy), against a torch runner whose
    copy is disabled (always gathers)."""
    fast = ModelRunner(path, num_kv_blocks=64, num_state_slots=8, decode_kernel=kernel)
    slow = ModelRunner(path, num_kv_blocks=64, num_state_slots=8, decode_kernel=False)
    slow.backend.decode_kv.max_bytes = 0
    return fast, slow


def _same(fast, slow, rows):
    a, b = fast.compute_logits(rows), slow.compute_logits(rows)
    assert (a - b).abs().max().item() < TOL
    return a


@pytest.mark.parametrize("kernel", [False, True])
def test_decode_copy_equals_gather_when_rows_come_and_go(tiny_dirs, h, kernel):
    """Rows reorder, skip a step, come back, join mid-run, share a step with a prefill
    chunk; forked siblings share every block of their slot key; a block copy (fork
    copy-on-write) invalidates the copy. ``kernel``: the same through the C decode
    step (paged reads) where it applies."""
    from pdserve.kernels import decode_step

    if kernel and not decode_step.available():
        pytest.skip(_kernel_off_reason("the C decode step"))
    fast, slow = _pair(tiny_dirs["llama"], kernel)
    assert fast.backend.decode_kv.max_bytes > 0
    p = h.prompts_of([20, 15, 33, 40], seed=11)
    t = {0: [1, 2], 1: [3, 4], 2: [5, 6, 7], 3: [8, 9, 10], 4: [3, 11]}  # 4: fork of 1
    pos = {0: 20, 1: 15, 2: 33}
    _same(fast, slow, [RunnerRow(p[i], 0, t[i]) for i in range(3)])

    def dec(i, token=7):
        row = RunnerRow([token], pos[i], t[i])
        pos[i] += 1
        return row

    for order in ([0, 1, 2], [2, 0], [1, 0, 2], [0, 2, 1]):
        _same(fast, slow, [dec(i) for i in order])
    # The copy is in use on the torch path; the C step keeps none.
    assert len(fast.backend.decode_kv.keys) == (0 if kernel else 3) and not slow.backend.decode_kv.keys
    # Row 1 now has 15 + 3 = 18 positions; a prefill chunk shares a step with decodes.
    _same(fast, slow, [RunnerRow(p[3][:30], 0, t[3]), dec(0), dec(2)])
    _same(fast, slow, [RunnerRow(p[3][30:], 30, t[3]), dec(1), dec(0)])
    # Fork: row 4 = row 1's first block (full, shared) + its own second block.
    for r in (fast, slow):
        r.kv_cache.copy_block(4, 11)
    pos[4] = pos[1]
    _same(fast, slow, [dec(1, 9), dec(4, 12), dec(0)])
    _same(fast, slow, [dec(4, 13), dec(1, 14), dec(2)])


def test_forked_siblings_with_identical_keys(tiny_dirs, h):
    """Two rows whose blocks covering 0 .. len-1 are the same (a fork at a block
    boundary): only one may continue the shared slot, the other gathers."""
    fast, slow = _pair(tiny_dirs["llama"])
    (p,) = h.prompts_of([15], seed=12)
    _same(fast, slow, [RunnerRow(p, 0, [1])])
    _same(fast, slow, [RunnerRow([5], 15, [1])])  # slot key: ((1,), 16)
    _same(fast, slow, [RunnerRow([6], 16, [1, 2]), RunnerRow([9], 16, [1, 3])])
    _same(fast, slow, [RunnerRow([7], 17, [1, 2]), RunnerRow([8], 17, [1, 3])])


def test_runner_greedy_matches_with_and_without_decode_copy(tiny_dirs, h):
    fast, slow = _pair(tiny_dirs["llama"])
    prompts = h.prompts_of([3, 17, 40, 90], seed=13)
    assert h.drive(fast, prompts, 20, budget=50) == h.drive(slow, prompts, 20, budget=50)


def test_greedy_fast_path_equals_general_sampler(tiny_dirs):
    runner = ModelRunner(tiny_dirs["llama"], num_kv_blocks=8)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(7, 4096, generator=g)
    rows = [RunnerRow([1], 0, [1], sampling=SamplingParams(temperature=0.0), output_index=i)
            for i in range(6)]
    state = runner._gen.get_state()
    fast = runner._sample(logits[:6], rows)
    n = len(rows)
    general = sample(logits[:6], torch.zeros(n), torch.zeros(n, dtype=torch.long),
                     torch.ones(n), torch.zeros(n, dtype=torch.long), torch.arange(n))
    assert torch.equal(fast, general)
    # An unseeded draw after greedy rows is the one it gets in the same step as them (a
    # mixed batch draws one seed per row): seeds owed by greedy steps are drawn first.
    drawn = RunnerRow([1], 0, [1], sampling=SamplingParams(temperature=1.0), output_index=6)
    after_greedy = runner._sample(logits[6:], [drawn])
    runner._gen.set_state(state)
    runner._owed_draws = 0
    mixed = runner._sample(logits, [*rows, drawn])
    assert int(after_greedy[0]) == int(mixed[6])
    # A long greedy run settles its owed draws in bounded calls, the same values again.
    runner._gen.set_state(state)
    runner._owed_draws = 0
    for _ in range(5000):
        runner._sample(logits[:1], rows[:1])
    assert runner._owed_draws < 4096
    one_by_one = torch.Generator().manual_seed(0)
    one_by_one.set_state(state)
    for _ in range(5000):
        torch.randint(-(2**62), 2**62, (1,), generator=one_by_one)
    expected = torch.randint(-(2**62), 2**62, (1,), generator=one_by_one)
    assert torch.equal(runner._fresh_seeds(1), expected)


def test_thread_tuner_tries_both_then_keeps_the_faster_and_explores():
    from pdserve.engine.backends.cpu.thread_tuner import ThreadTuner

    tuner = ThreadTuner(explore=4)
    key = ("decode", 5)
    picks = []
    for _ in range(9):
        t = tuner.choose(key, 2)
        picks.append(t)
        tuner.record(key, t, 0.010 if t == 1 else 0.030, 16)  # 1 thread is faster
    assert picks[:2] == [2, 1]  # the caller's setting first, then 1
    assert picks[2:] == [1, 2, 1, 1, 1, 2, 1]  # every 4th step tries the other
    assert ThreadTuner().choose(key, 1) == 1


def test_thread_tuner_is_not_locked_out_by_one_slow_step_but_follows_lasting_load():
    """A choice costs the fastest of its last 3 tries: one step a neighbour delayed
    does not hand the next `explore` steps to the slower choice; three slow tries do."""
    from pdserve.engine.backends.cpu.thread_tuner import ThreadTuner

    tuner = ThreadTuner(explore=100)
    key = ("decode", 1)

    def step(two_threads_s):
        t = tuner.choose(key, 2)
        tuner.record(key, t, 0.007 if t == 1 else two_threads_s, 1)
        return t

    assert [step(0.004) for _ in range(4)] == [2, 1, 2, 2]  # 2 threads: 4 ms against 7
    assert step(0.050) == 2  # a neighbour delays one step ...
    assert [step(0.004) for _ in range(3)] == [2, 2, 2]  # ... and 2 threads stay the choice
    assert [step(0.020) for _ in range(3)] == [2, 2, 2]  # load that stays: three slow tries
    assert step(0.020) == 1  # ... and 1 thread takes over


def test_thread_tuner_restores_the_callers_thread_count(tiny_dirs):
    before = torch.get_num_threads()
    runner = ModelRunner(tiny_dirs["llama"], num_kv_blocks=8)
    for _ in range(3):
        runner.execute([RunnerRow([5, 6, 7], 0, [1])])
        assert torch.get_num_threads() == before


def test_thread_tuner_runs_prefill_steps_on_every_thread(monkeypatch):
    """A prefill step is never an exploratory 1-thread try (one costs seconds)."""
    from pdserve.engine.backends.cpu.thread_tuner import ThreadTuner

    seen = []
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(torch, "set_num_threads", seen.append)
    tuner = ThreadTuner(explore=2)
    prefill = [RunnerRow(list(range(64)), 0, [1])]
    decode = [RunnerRow([1], 5, [1]) for _ in range(4)]
    for _ in range(6):
        with tuner.step(prefill):
            pass
    assert seen == [] and not tuner.cost  # untouched: the caller's 2 threads
    for _ in range(2):
        with tuner.step(decode):
            pass
    assert seen == [2, 2, 1, 2]  # decode: tries 2, then 1, restoring 2 after each


def test_last_layer_runs_only_the_sampled_rows_and_matches_the_full_step(tiny_dirs):
    """execute() trims the last layer to the rows that sample; their logits equal the
    untrimmed computation (compute_logits) and the cache is written the same."""
    rows = [RunnerRow(list(range(3, 40)), 0, [1, 2, 3]), RunnerRow(list(range(9, 30)), 0, [4, 5]),
            RunnerRow(list(range(50, 60)), 0, [6], sample=False)]
    a = ModelRunner(tiny_dirs["llama"], num_kv_blocks=8)
    b = ModelRunner(tiny_dirs["llama"], num_kv_blocks=8)
    tokens = a.execute(rows)
    full = b.compute_logits(rows)
    assert tokens[:2] == full[:2].argmax(-1).tolist() and tokens[2] is None
    assert torch.equal(a.kv_cache.k_blocks[-1], b.kv_cache.k_blocks[-1])
    assert torch.equal(a.kv_cache.v_blocks[-1], b.kv_cache.v_blocks[-1])
    def forward(r, keep=None):
        tokens, positions, meta, _ = r.prepare(rows)
        return r.model(tokens, positions, r.kv_cache, meta, keep)

    trimmed = forward(a, keep=torch.tensor([36]))
    assert trimmed.shape[0] == 1
    assert (trimmed - forward(b)[36:37]).abs().max() < 1e-5


def test_rope_table_and_in_place_rotation_equal_the_reference():
    from pdserve.kernels.rope import (
        RopeTable,
        apply_rope,
        apply_rope_signed,
        inv_frequencies,
        rope_cos_sin,
        rotate_half,
    )

    inv = inv_frequencies(64, 10000.0)
    table = RopeTable(inv, initial=8)
    pos = torch.tensor([0, 3, 7, 8, 40, 1000])  # past the initial size: the table grows
    cos, sin = table.cos_sin(pos, torch.float32, max_position=1000)
    want_cos, want_sin = rope_cos_sin(pos, inv, torch.float32)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    x = torch.randn(6, 5, 64)[:, 1:4]  # a strided view, as q|k heads of a qkv output are
    want = x * cos[:, None] + rotate_half(x) * sin[:, None]
    assert torch.equal(apply_rope(x, cos, sin), want)
    _, sin_signed = table.cos_sin(pos, torch.float32, max_position=1000, signed=True)
    assert torch.equal(apply_rope_signed(x, cos, sin_signed), want)


@pytest.mark.slow
def test_compiled_decode_equals_eager_token_for_token(tiny_dirs, h):
    """``ModelRunner(compile=True)``: decode steps through the torch.compile'd dense
    blocks give the eager runner's greedy tokens (rows of several lengths, so decode
    batches shrink and mix with prefill chunks), and its logits agree closely."""
    # Both without the C decode step, which would take the decode steps otherwise, and
    # on a fixed thread count: dynamo guards on it, so the thread tuner's 1 / N threads
    # compile every graph twice (60 s of this test on 2 cores instead of 10; the thread
    # count does not change results, see ThreadTuner).
    eager = ModelRunner(tiny_dirs["llama"], num_kv_blocks=64, num_state_slots=8,
                        decode_kernel=False, adaptive_threads=False)
    compiled = ModelRunner(tiny_dirs["llama"], num_kv_blocks=64, num_state_slots=8,
                           compile=True, decode_kernel=False, adaptive_threads=False)
    prompts = h.prompts_of([3, 17, 40, 90], seed=14)
    assert h.drive(compiled, prompts, 12, budget=50) == h.drive(eager, prompts, 12, budget=50)
    assert (h.drive(compiled, prompts, 9, budget=64, mixed=False, first_block=30)
            == h.drive(eager, prompts, 9, budget=64, mixed=False, first_block=30))
    for layer in range(eager.num_layers):  # the compiled step wrote the paged cache in place
        for a, b in ((eager.kv_cache.k_blocks, compiled.kv_cache.k_blocks),
                     (eager.kv_cache.v_blocks, compiled.kv_cache.v_blocks)):
            assert (a[layer] - b[layer]).abs().max() < 1e-4
    (p,) = h.prompts_of([21], seed=15)
    for r in (eager, compiled):
        r.compute_logits([RunnerRow(p, 0, [60, 61])])
    rows = [RunnerRow([5], 21, [60, 61])]
    assert (eager.compute_logits(rows) - compiled.compute_logits(rows)).abs().max() < 1e-4


def test_skinny_gemm_builds_into_the_cache_and_falls_back_without_a_compiler(tmp_path):
    """A fresh cache gets the built library; with no usable compiler the kernel is off
    (a logged warning) and MatMul keeps a torch layout, with the same results."""
    import os
    import subprocess
    import sys

    from pdserve.kernels import skinny_gemm

    probe = ("import torch; from pdserve.kernels import skinny_gemm as s, decode_step as d; "
             "from pdserve.engine.model.llama import MatMul; w = torch.randn(64, 32); "
             "x = torch.randn(3, 32); m = MatMul(w, None); "
             "assert (m(x) - x @ w.T).abs().max() < 1e-4; "
             "print(s.available(), m.panels is not None, d.available())")

    def run(**env):
        out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, **env},
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        return out.stdout.split(), out.stderr

    (avail, panels, step), _ = run(XDG_CACHE_HOME=str(tmp_path / "fresh"))
    built = sorted(p.name.split("-")[0] for p in (tmp_path / "fresh" / "pdserve").glob("*.so"))
    assert (avail, panels, step) == ((str(skinny_gemm.available()),) * 3)
    assert built == (["decode_step", "skinny_gemm"] if skinny_gemm.available() else [])
    (avail, panels, step), err = run(XDG_CACHE_HOME=str(tmp_path / "nocc"), CC="/nonexistent/cc")
    assert (avail, panels, step) == ("False", "False", "False")
    assert "skinny_gemm off" in err and "nonexistent" in err
