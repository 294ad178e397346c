"""The C decode step (``kernels/decode_step``, via ``engine/model/decode_kernel``) against the
torch path: same hidden states to ~1e-5, same cache writes, same greedy tokens, results
independent of the thread count, and the fallback where it does not apply. The tests
taking ``isa`` run for every build this CPU can execute (an AVX-512 one runs the
AVX-512, AVX2 and generic builds of the one source)."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.model_runner import ModelRunner, RunnerRow
from pdserve.kernels import cbuild, decode_step

# The C step builds for any CPU with a C compiler.
needs_kernel = pytest.mark.skipif(
    not decode_step.available(),
    reason="the C decode step needs a C compiler (cc, gcc or $CC) to build it; none built it here")
every_isa = pytest.mark.parametrize("isa", cbuild.tested_isas())


def _pair(path, isa="auto", **kw):
    torch_path = ModelRunner(path, num_kv_blocks=64, num_state_slots=8, decode_kernel=False,
                             adaptive_threads=False, **kw)
    kernel = ModelRunner(path, num_kv_blocks=64, num_state_slots=8, adaptive_threads=False,
                         kernel_isa=isa, **kw)
    assert not torch_path.decode_kernel and kernel.decode_kernel
    assert kernel.model._kernel.step.isa == cbuild.resolve_isa(isa)
    return torch_path, kernel


@needs_kernel
@every_isa
def test_decode_kernel_equals_torch_over_uneven_rows(tiny_dirs, h, isa):
    """Rows of different lengths (so each attends to its own key count), rows that start
    decoding later (their K/V is copied into a slot first) and a row that leaves (slots
    move): hidden states within 1e-4 of the torch path at every step, and the paged
    cache written identically."""
    ref, ker = _pair(tiny_dirs["llama"], isa)
    prompts = h.prompts_of([3, 19, 40, 7], seed=3)
    tables = [list(range(1 + 8 * i, 9 + 8 * i)) for i in range(len(prompts))]
    seqs = [list(p) for p in prompts]
    for r in (ref, ker):
        r.execute([RunnerRow(p, 0, t) for p, t in zip(prompts[:3], tables, strict=False)])
    for step in range(12):
        live = [0, 1, 2] + ([3] if step >= 4 else [])
        if step == 4:  # a late prompt: its first decode step gathers its blocks
            for r in (ref, ker):
                r.execute([RunnerRow(prompts[3], 0, tables[3])])
        if step >= 8:
            live.remove(1)
        rows = [RunnerRow([seqs[i][-1]], len(seqs[i]) - 1, tables[i]) for i in live]
        a, b = h.decode_hidden(ref, rows), h.decode_hidden(ker, rows)
        assert a.shape == b.shape
        assert (a - b).abs().max() < 1e-4, step
        nxt = ref.model.compute_logits(a).argmax(-1).tolist()
        for i, t in zip(live, nxt, strict=True):
            seqs[i].append(t)
    for layer in range(ref.num_layers):
        for x, y in ((ref.kv_cache.k_blocks, ker.kv_cache.k_blocks),
                     (ref.kv_cache.v_blocks, ker.kv_cache.v_blocks)):
            assert (x[layer] - y[layer]).abs().max() < 1e-4


@needs_kernel
@every_isa
def test_decode_kernel_greedy_tokens_equal_transformers(tiny_dirs, h, isa):
    ker = ModelRunner(tiny_dirs["llama"], num_kv_blocks=64, num_state_slots=8, kernel_isa=isa)
    assert ker.decode_kernel and ker.model._kernel.step.isa == isa
    prompts = h.prompts_of([5, 23, 61], seed=21)
    got = h.drive(ker, prompts, 16, mixed=False)
    assert got == [h.hf_greedy(tiny_dirs["llama"], p, 16) for p in prompts]


@needs_kernel
def test_decode_kernel_with_biases_equals_torch(tiny_dirs, h):
    """Models with q/k/v, o and MLP biases (qwen2-style): the kernel adds them as torch does."""
    ref, ker = _pair(tiny_dirs["llama"])
    g = torch.Generator().manual_seed(5)
    for r in (ref, ker):
        for ly in r.model.model.layers:
            for mm in (ly.self_attn.qkv, ly.self_attn.o, ly.mlp.gate_up, ly.mlp.down):
                mm.bias = torch.nn.Parameter(0.05 * torch.randn(mm.out_features, generator=g),
                                             requires_grad=False)
        g.manual_seed(5)
    assert ker.model.use_decode_kernel()  # rebuilt: it binds the biases it finds
    prompts = h.prompts_of([9, 30], seed=4)
    tables = [[1, 2, 3, 4], [5, 6, 7, 8]]
    for r in (ref, ker):
        r.execute([RunnerRow(p, 0, t) for p, t in zip(prompts, tables, strict=True)])
    rows = [RunnerRow([11], 9, tables[0]), RunnerRow([12], 30, tables[1])]
    assert (h.decode_hidden(ref, rows) - h.decode_hidden(ker, rows)).abs().max() < 1e-4


@needs_kernel
@every_isa
def test_decode_kernel_results_do_not_depend_on_the_thread_count(tiny_dirs, h, isa):
    """Each output element is computed by one thread in a fixed order, so 1 and 2
    threads give bitwise equal states (ThreadTuner's choice cannot change a token)."""
    runners = [ModelRunner(tiny_dirs["llama"], num_kv_blocks=64, num_state_slots=8,
                           adaptive_threads=False, kernel_isa=isa) for _ in range(2)]
    prompts = h.prompts_of([6, 33, 17], seed=8)
    tables = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    caller = torch.get_num_threads()
    outs = []
    try:
        for r, threads in zip(runners, (1, 2), strict=True):
            torch.set_num_threads(threads)
            r.execute([RunnerRow(p, 0, t) for p, t in zip(prompts, tables, strict=True)])
            rows = [RunnerRow([7], len(p), t) for p, t in zip(prompts, tables, strict=True)]
            outs.append(h.decode_hidden(r, rows))
    finally:
        torch.set_num_threads(caller)
    assert torch.equal(outs[0], outs[1])


def test_decode_kernel_off_where_it_does_not_apply(tiny_dirs, h):
    """bf16 models keep the torch path; so does a runner (or ``LLM``) asked not to use
    it, which still gives transformers' greedy tokens."""
    bf16 = ModelRunner(tiny_dirs["llama"], num_kv_blocks=64, num_state_slots=8,
                       dtype="bfloat16")
    assert not bf16.decode_kernel
    off = ModelRunner(tiny_dirs["llama"], num_kv_blocks=64, num_state_slots=8,
                      decode_kernel=False)
    assert not off.decode_kernel
    (p,) = h.prompts_of([12], seed=2)
    assert h.drive(off, [p], 8) == [h.hf_greedy(tiny_dirs["llama"], p, 8)]
    from pdserve import LLM

    assert not LLM(str(tiny_dirs["llama"]), decode_kernel=False).engines[0].runner.decode_kernel
    assert LLM(str(tiny_dirs["llama"])).engines[0].runner.decode_kernel == decode_step.available()


def test_decode_step_refuses_what_it_cannot_run():
    dims = decode_step.StepDims(hidden=100, q_heads=4, kv_heads=2, head_dim=64,
                                intermediate=128, layers=1, eps=1e-6, scale=0.125)
    assert not dims.supported()  # hidden not a multiple of 16
    assert not decode_step.StepDims(256, 4, 2, 48, 128, 1, 1e-6, 0.1).supported()
    assert not decode_step.StepDims(256, 6, 4, 64, 128, 1, 1e-6, 0.1).supported()
    assert decode_step.StepDims(256, 4, 2, 64, 128, 1, 1e-6, 0.1).supported()
    with pytest.raises(ValueError, match="fp32"):
        decode_step._ptr(torch.zeros(4, dtype=torch.float64))


@needs_kernel
@every_isa
def test_decode_kernel_logits_equal_torch(tiny_dirs, h, isa):
    """With the LM head inside the C step (``decode_logits``): logits within 1e-4 of the
    torch path's, and the same argmax."""
    ref, ker = _pair(tiny_dirs["llama"], isa)
    assert ker.model._kernel.has_logits
    prompts = h.prompts_of([4, 26, 13], seed=6)
    tables = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    for r in (ref, ker):
        r.execute([RunnerRow(p, 0, t) for p, t in zip(prompts, tables, strict=True)])
    rows = [RunnerRow([3 + i], len(p), t)
            for i, (p, t) in enumerate(zip(prompts, tables, strict=True))]
    a, b = ref.compute_logits(rows), ker.compute_logits(rows)
    assert a.shape == b.shape == (3, ref.vocab_size) and b.dtype == torch.float32
    assert (a - b).abs().max() < 1e-4
    assert torch.equal(a.argmax(-1), b.argmax(-1))


@needs_kernel
@every_isa
def test_decode_step_greedy_tokens_are_its_logits_argmax_and_the_runner_takes_them(
        tiny_dirs, h, isa, monkeypatch):
    """``greedy=True``: each row's argmax of the step's own logits, from the same call;
    a step whose rows are all plain greedy takes its tokens from there (the sampler's
    argmax is not called) and they equal the torch path's."""
    from pdserve.engine import model_runner

    ref, ker = _pair(tiny_dirs["llama"], isa)
    prompts = h.prompts_of([5, 19, 33], seed=8)
    tables = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    for r in (ref, ker):
        r.execute([RunnerRow(p, 0, t) for p, t in zip(prompts, tables, strict=True)])
    rows = [RunnerRow([7 + i], len(p), t)
            for i, (p, t) in enumerate(zip(prompts, tables, strict=True))]
    tokens, positions, meta, _ = ker.prepare(rows)
    k = ker.model._kernel
    out = k.run(tokens, positions, ker.kv_cache, meta, logits=True, greedy=True)
    assert out.greedy.dtype == torch.int64 and torch.equal(out.greedy, out.logits.argmax(-1))
    expected = ref.execute(rows)  # (execute below writes the same K/V again)

    def no_sampler_argmax(logits, isa=None):
        raise AssertionError("the step's greedy tokens were not taken")

    monkeypatch.setattr(model_runner, "greedy", no_sampler_argmax)
    assert ker.execute(rows) == expected


def _reshaped_heads(src, dst, heads: int, kv_heads: int, head_dim: int):
    """The tiny model's weights read as other head shapes (same q/k/v matrix sizes): a
    valid model with another head size, for the kernel's other attention code paths."""
    import json
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    assert heads * head_dim == cfg["num_attention_heads"] * cfg["head_dim"]
    assert kv_heads * head_dim == cfg["num_key_value_heads"] * cfg["head_dim"]
    cfg.update(num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@needs_kernel
@every_isa
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(2, 1, 128), (8, 4, 32)])
@pytest.mark.parametrize("rows", [1, 8, 9, 17])
def test_decode_kernel_head_sizes_and_row_counts(tiny_dirs, h, tmp_path, heads, kv_heads,
                                                 head_dim, rows, isa):
    """Head sizes 128 and 32 (the 64 of the built-in models has its own test above) and
    row counts around the kernel's blocks of 4 and 8 rows: hidden states equal the torch
    path's."""
    path = _reshaped_heads(tiny_dirs["llama"], tmp_path / "m", heads, kv_heads, head_dim)
    ref, ker = _pair(path, isa)
    prompts = h.prompts_of([3 + 2 * i for i in range(rows)], seed=rows)
    tables = [[1 + 3 * i, 2 + 3 * i, 3 + 3 * i] for i in range(rows)]
    for r in (ref, ker):
        r.execute([RunnerRow(p, 0, t) for p, t in zip(prompts, tables, strict=True)])
    decode = [RunnerRow([9], len(p), t) for p, t in zip(prompts, tables, strict=True)]
    a, b = h.decode_hidden(ref, decode), h.decode_hidden(ker, decode)
    assert a.shape == (rows, 256)
    assert (a - b).abs().max() < 1e-4


@needs_kernel
def test_decode_step_refuses_indices_outside_the_caches(tiny_dirs, h):
    """A token outside the vocabulary, a block id, table or position outside the cache
    (a planning bug) raises before anything is written, instead of reading or writing
    out of bounds; the runner still works afterwards."""
    ker = ModelRunner(tiny_dirs["llama"], num_kv_blocks=64, num_state_slots=8)
    (p,) = h.prompts_of([10], seed=1)
    ker.execute([RunnerRow(p, 0, [1, 2])])
    tokens, positions, meta, _ = ker.prepare([RunnerRow([4], 10, [1, 2])])
    k, cache = ker.model._kernel, ker.kv_cache
    cos, sin = ker.model.rope.tables(torch.float32, 16)
    stores = k.stores(cache)
    table = meta.groups[0].block_tables
    assert table.tolist() == [[1]]
    vocab = ker.model.cfg.vocab_size
    bad_cases = {
        "block id": (tokens, torch.tensor([[64]]), positions, 11),
        "negative block": (tokens, torch.tensor([[-1]]), positions, 11),
        "past the table": (tokens, table, torch.tensor([16]), 17),
        "past max_len": (tokens, table, positions, 10),
        "negative position": (tokens, table, torch.tensor([-1]), 11),
        "token past the vocabulary": (torch.tensor([vocab]), table, positions, 11),
        "negative token": (torch.tensor([-1]), table, positions, 11),
    }
    before = [t.clone() for t in cache.k_blocks]
    for name, (tok, tb, pos, max_len) in bad_cases.items():
        with pytest.raises(IndexError, match="row 0"):
            k.step.run(tok, pos, max_len, stores, cos, sin, tb)
        assert all(torch.equal(a, b) for a, b in zip(cache.k_blocks, before, strict=True)), name
    with pytest.raises(ValueError, match="rope tables"):
        k.step.run(tokens, positions, 11, stores, cos[:10], sin[:10], table)
    with pytest.raises(ValueError, match="block tables are needed"):
        k.step.run(tokens, positions, 11, stores, cos, sin, None)
    hidden = k.step.run(tokens, positions, 11, stores, cos, sin, table).hidden
    assert hidden.shape == (1, 256) and torch.isfinite(hidden).all()
    # Sliding-window layers: a state slot outside the rings.
    swa = ModelRunner(tiny_dirs["mistral-swa"], num_kv_blocks=64, num_state_slots=8)
    ring = swa.kv_cache
    before = [t.clone() for t in ring.k_ring]
    with pytest.raises(IndexError, match="state slot 8"):
        swa.model._kernel.step.run(tokens, positions, 11, swa.model._kernel.stores(ring), cos,
                                   sin, None, torch.tensor([8]))
    assert all(torch.equal(a, b) for a, b in zip(ring.k_ring, before, strict=True))


@needs_kernel
@every_isa
def test_decode_kernel_long_context_equals_transformers(tiny_dirs, h, isa):
    """Rows of ~1000-1900 positions (the decode K/V grows several times; attention runs
    over long key ranges): greedy tokens equal transformers'."""
    ker = ModelRunner(tiny_dirs["llama"], num_kv_blocks=300, num_state_slots=8, kernel_isa=isa)
    prompts = h.prompts_of([1900, 1031], seed=12)
    assert h.drive(ker, prompts, 6, mixed=False) == [
        h.hf_greedy(tiny_dirs["llama"], p, 6) for p in prompts]


@needs_kernel
@every_isa
@pytest.mark.parametrize("model", ["llama", "window-300"])
def test_decode_kernel_splits_few_long_rows_across_threads(tiny_dirs, h, isa, model, tmp_path):
    """A step of at most 4 rows cuts each row's positions into parts of 128, attended by
    any thread and merged: rows of ~600, ~300 and ~40 positions (5, 3 and 1 parts; paged
    layers, and ring layers whose 300-position window is cut too) give the torch path's
    hidden states, alone and together, and the same bits on 1 thread as on 2."""
    import json
    import shutil

    path = tiny_dirs["llama"]
    if model == "window-300":
        path = tmp_path / "swa300"
        shutil.copytree(tiny_dirs["mistral-swa"], path)
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, "sliding_window": 300}))
    kw = dict(num_kv_blocks=160, num_state_slots=8, adaptive_threads=False)
    ref = ModelRunner(path, decode_kernel=False, **kw)
    ker = ModelRunner(path, kernel_isa=isa, **kw)
    assert ker.decode_kernel and not ref.decode_kernel
    prompts = h.prompts_of([600, 300, 40], seed=40)
    per = -(-700 // ref.block_size)
    tables = [list(range(1 + per * i, 1 + per * (i + 1))) for i in range(3)]
    for r in (ref, ker):
        r.execute([RunnerRow(p, 0, t, state_slot=i + 1)
                   for i, (p, t) in enumerate(zip(prompts, tables, strict=True))])
    seqs = [list(p) for p in prompts]
    caller = torch.get_num_threads()
    try:
        for step in range(4):
            pick = [0] if step % 2 == 0 else [0, 1, 2]  # a lone long row, then all three
            rows = [RunnerRow([seqs[i][-1]], len(seqs[i]) - 1, tables[i], state_slot=i + 1)
                    for i in pick]
            a = h.decode_hidden(ref, rows)
            torch.set_num_threads(1)
            one = h.decode_hidden(ker, rows)
            torch.set_num_threads(2)
            two = h.decode_hidden(ker, rows)  # rewrites the same K/V: the same inputs
            assert torch.equal(one, two), step
            assert (a - two).abs().max() < 1e-4, step
            for i, tok in zip(pick, ref.model.compute_logits(a).argmax(-1).tolist(), strict=True):
                seqs[i].append(tok)
    finally:
        torch.set_num_threads(caller)


@needs_kernel
@every_isa
@pytest.mark.parametrize("drafted,length", [(3, 300), (9, 100)])
def test_decode_kernel_rows_of_one_sequence_attend_as_a_group(tiny_dirs, h, isa, drafted,
                                                              length):
    """A speculative step's rows (one sequence's next positions, one block table) read
    each key and value once for the group (at most 8 rows a group: 9 drafted tokens make
    groups of 8 and 2): the same bits as the same rows out of order, where no row
    continues the one before it and each attends alone (both split into parts of 128
    positions: at most 4 groups; or neither: one part a row); the same bits on 1 thread
    as on 2; the torch path's hidden states."""
    kw = dict(num_kv_blocks=96, num_state_slots=8, adaptive_threads=False)
    ref = ModelRunner(tiny_dirs["llama"], decode_kernel=False, **kw)
    ker = ModelRunner(tiny_dirs["llama"], kernel_isa=isa, **kw)
    prompt = h.prompts_of([length], seed=9)[0]
    table = list(range(1, 1 + -(-(len(prompt) + drafted) // ref.block_size)))
    for r in (ref, ker):
        r.execute([RunnerRow(prompt[:-1], 0, table)])
    tokens = [prompt[-1], *h.prompts_of([drafted], seed=10)[0]]
    rows = [RunnerRow([t], len(prompt) - 1 + i, table) for i, t in enumerate(tokens)]
    order = list(range(len(rows)))[::-2] + list(range(len(rows)))[-2::-2]  # no row follows its predecessor
    caller = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = h.decode_hidden(ker, rows)
        torch.set_num_threads(2)
        grouped = h.decode_hidden(ker, rows)
        apart = h.decode_hidden(ker, [rows[i] for i in order])
    finally:
        torch.set_num_threads(caller)
    assert torch.equal(one, grouped)
    assert torch.equal(apart, grouped[order])
    assert (h.decode_hidden(ref, rows) - grouped).abs().max() < 1e-4


@needs_kernel
@every_isa
def test_decode_kernel_sliding_window_equals_torch_and_transformers(tiny_dirs, h, isa):
    """Sliding-window layers (the tiny mistral-swa, window 32): rows decode well past
    the window, so each reads the last 32 positions of its ring, wrapping at the ring's
    end; hidden states equal the torch path's and greedy tokens transformers'."""
    path = tiny_dirs["mistral-swa"]
    ref, ker = _pair(path, isa)
    prompts = h.prompts_of([5, 30, 70], seed=31)
    tables = [list(range(1 + 8 * i, 9 + 8 * i)) for i in range(3)]
    for r in (ref, ker):
        r.execute([RunnerRow(p, 0, t, state_slot=i + 1)
                   for i, (p, t) in enumerate(zip(prompts, tables, strict=True))])
    seqs = [list(p) for p in prompts]
    for step in range(40):
        rows = [RunnerRow([s[-1]], len(s) - 1, t, state_slot=i + 1)
                for i, (s, t) in enumerate(zip(seqs, tables, strict=True))]
        a, b = h.decode_hidden(ref, rows), h.decode_hidden(ker, rows)
        assert (a - b).abs().max() < 1e-4, step
        for s, tok in zip(seqs, ref.model.compute_logits(a).argmax(-1).tolist(), strict=True):
            s.append(tok)
    for layer in ref.kv_cache.ring_layers:  # the rings were written alike
        assert (ref.kv_cache.k_ring[layer] - ker.kv_cache.k_ring[layer]).abs().max() < 1e-4
    ker2 = ModelRunner(path, num_kv_blocks=64, num_state_slots=8)
    assert ker2.decode_kernel
    long = h.prompts_of([45, 12], seed=32)
    assert h.drive(ker2, long, 30, mixed=False) == [h.hf_greedy(path, p, 30) for p in long]


def test_kernel_isa_the_cpu_cannot_run_is_refused_naming_what_it_runs(tiny_dirs, monkeypatch):
    """An ISA outside cbuild.ISAS, or one this CPU lacks (here: a CPU reporting AVX2
    only), is refused when the runner starts, with a message naming the choices."""
    from pdserve.engine.config import EngineConfig

    with pytest.raises(ValueError, match="kernel_isa must be one of auto, avx512, avx2, generic"):
        EngineConfig(model_dir=str(tiny_dirs["llama"]), kernel_isa="sse9")
    monkeypatch.setattr(cbuild, "_cpu_flags", lambda: frozenset({"avx2", "fma", "f16c", "sse2"}))
    assert cbuild.runnable_isas() == ("avx2", "generic") and cbuild.host_isa() == "avx2"
    with pytest.raises(ValueError, match="'avx512' cannot run on this CPU .it runs avx2, generic"):
        ModelRunner(tiny_dirs["llama"], num_kv_blocks=16, num_state_slots=8, kernel_isa="avx512")
    monkeypatch.setattr(cbuild, "_cpu_flags", lambda: frozenset({"avx2", "sse2"}))  # no FMA
    assert cbuild.runnable_isas() == ("generic",)
