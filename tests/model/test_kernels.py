"""Slot mapping (S36, S37), the KV cache's export/import, sampling."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.model_runner import ModelRunner, RunnerRow
from pdserve.kernels import cbuild
from pdserve.kernels.kv_cache import KVCache
from pdserve.kernels.sampling import apply_top_k_top_p, sample, seeded_uniform
from pdserve.kernels.slot_mapping import (
    full_slots,
    full_slots_list,
    ring_slots,
    ring_slots_list,
)
from pdserve.scheduler.sampling_params import SamplingParams


def test_s37_worked_example():
    """300-token prompt, budget 128, state slot 2, R = 134: chunks (cached, q, seqlen_k)
    (0,128,128), (128,128,256), (256,44,300); in chunk 2 (the second) j=0 -> 396, j=6 -> 268."""
    chunks = [(0, 128, 128), (128, 128, 256), (256, 44, 300)]
    dests = [ring_slots_list(2, k, q, 134) for _, q, k in chunks]
    assert dests[1][0] == 396 and dests[1][6] == 268
    assert all(d != -1 for d in dests[0])  # q - j <= 128 <= R
    assert all(2 * 134 <= d < 3 * 134 for ds in dests for d in ds)


def test_s37_long_chunk_keeps_last_r():
    d = ring_slots_list(1, seqlen_k=300, q=300, ring_len=134)
    assert d[:166] == [-1] * 166
    assert sorted(d[166:]) == list(range(134, 268))  # each ring row exactly once


def test_slot_tensors_match_lists():
    bs, ring = 16, 64
    rows = [(0, 37, [3, 9, 4]), (21, 1, [5, 6]), (128, 90, list(range(20, 34)))]
    slots = [0, 3, 1]
    q_lens = torch.tensor([r[1] for r in rows])
    starts = torch.tensor([r[0] for r in rows])
    token_row = torch.repeat_interleave(torch.arange(len(rows)), q_lens)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)])
    pos = starts[token_row] + torch.arange(int(q_lens.sum())) - cu[token_row]
    nb = max(len(r[2]) for r in rows)
    bt = torch.tensor([r[2] + [0] * (nb - len(r[2])) for r in rows])
    want = sum((full_slots_list(t, s, q, bs) for s, q, t in rows), [])
    assert full_slots(bt, token_row, pos, bs).tolist() == want
    want_r = sum((ring_slots_list(sl, s + q, q, ring) for sl, (s, q, _) in
                  zip(slots, rows, strict=True)), [])
    got_r = ring_slots(torch.tensor(slots), starts + q_lens, q_lens, token_row, pos, ring)
    assert got_r.tolist() == want_r
    assert got_r.tolist().count(-1) == 90 - ring


def _cache(**kw):
    args = dict(num_layers=3, num_kv_heads=2, head_dim=4, num_blocks=10, block_size=4,
                layer_windows=(None, 8, None), num_state_slots=3, ring_len=8)
    args.update(kw)
    return KVCache(**args)


def test_kv_export_import_roundtrip_and_checks():
    a, b = _cache(), _cache()
    g = torch.Generator().manual_seed(0)
    for t in a.k_blocks + a.v_blocks + a.k_ring + a.v_ring:
        if t is not None:
            t.copy_(torch.randn(t.shape, generator=g))
    payload = a.export_sequence([4, 2, 7, 9], state_slot=1, num_tokens=10)  # 3 blocks
    assert payload["k_blocks"].shape == (2, 3, 4, 2, 4)
    assert payload["k_ring"].shape == (1, 8, 2, 4)
    b.check_import(payload, 10)
    b.import_sequence([1, 5, 6], state_slot=2, tensors=payload)
    assert torch.equal(b.k_blocks[2][5], a.k_blocks[2][2])
    assert torch.equal(b.v_blocks[0][6], a.v_blocks[0][7])
    assert torch.equal(b.k_ring[1][16:24], a.k_ring[1][8:16])
    assert a.layout() == b.layout()
    with pytest.raises(ValueError, match=r"'k_blocks': expected shape \(2, 4, 4, 2, 4\)"):
        b.check_import(payload, 13)
    with pytest.raises(ValueError, match="'v_ring' missing"):
        b.check_import({k: v for k, v in payload.items() if k != "v_ring"}, 10)
    with pytest.raises(ValueError, match="expected dtype"):
        b.check_import({k: v.double() for k, v in payload.items()}, 10)


def test_copy_block_and_state():
    c = _cache()
    c.k_blocks[0][3].fill_(1.5)
    c.k_ring[1][8:16].fill_(2.5)
    c.copy_block(3, 4)
    c.copy_state(1, 2)
    assert c.k_blocks[0][4].eq(1.5).all() and c.k_ring[1][16:24].eq(2.5).all()


@pytest.mark.parametrize("variant", ["llama", "mistral-swa"])
def test_handoff_between_runners_continues_identically(tiny_dirs, h, variant):
    """Prefill on one runner, export, import into another runner's different blocks and
    state slot: decoding continues exactly as on the first."""
    path = tiny_dirs[variant]
    (prompt,) = h.prompts_of([70], seed=11)
    a = ModelRunner(path, num_kv_blocks=16, num_state_slots=4)
    b = ModelRunner(path, num_kv_blocks=16, num_state_slots=4)
    assert a.model_fingerprint == b.model_fingerprint and a.dtype == b.dtype
    ta, tb = [1, 2, 3, 4, 5, 6], [9, 12, 10, 11, 13, 14]
    first = a.execute([RunnerRow(prompt, 0, ta, 1)])[0]
    b.kv_cache.import_sequence(tb, 3, a.kv_cache.export_sequence(ta, 1, len(prompt)))
    ga, gb = [first], [first]
    for i in range(8):
        pos = len(prompt) + i
        ga += a.execute([RunnerRow([ga[-1]], pos, ta, 1, output_index=i + 1)])
        gb += b.execute([RunnerRow([gb[-1]], pos, tb, 3, output_index=i + 1)])
    assert ga == gb


# ---- sampling ---------------------------------------------------------------------

def _sample_rows(logits, params, out_idx):
    n = len(params)
    return sample(
        logits,
        torch.tensor([p.temperature for p in params]),
        torch.tensor([p.top_k for p in params]),
        torch.tensor([p.top_p for p in params]),
        torch.tensor([p.seed for p in params]),
        torch.tensor(out_idx if isinstance(out_idx, list) else [out_idx] * n),
    )


def test_seeded_sampling_independent_of_batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 500, generator=g)
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, seed=s) for t, k, p, s in [
        (1.0, -1, 1.0, 7), (0.7, 50, 1.0, 7), (1.3, -1, 0.9, 123), (1.0, 5, 0.5, -4),
        (0.0, -1, 1.0, 1), (2.0, -1, 1.0, 2**40)]]
    together = _sample_rows(logits, params, [0, 1, 2, 3, 4, 5])
    alone = [int(_sample_rows(logits[i:i + 1], params[i:i + 1], [i])[0]) for i in range(6)]
    perm = [5, 2, 0, 4, 1, 3]
    shuffled = _sample_rows(logits[perm], [params[i] for i in perm], perm)
    assert together.tolist() == alone
    assert shuffled.tolist() == [alone[i] for i in perm]
    assert int(together[4]) == int(logits[4].argmax())  # temperature 0 is greedy


def test_seeded_uniform_is_uniform_and_seed_sensitive():
    u = seeded_uniform(torch.tensor([1, 2]), torch.tensor([0, 0]), 20000)
    assert 0 < u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01
    assert not torch.equal(u[0], u[1])
    u2 = seeded_uniform(torch.tensor([1]), torch.tensor([1]), 20000)
    assert not torch.equal(u[0], u2[0])


def test_sampling_follows_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(4000, 1)
    n = logits.shape[0]
    t = sample(logits, torch.ones(n), torch.full((n,), -1), torch.ones(n),
               torch.arange(n), torch.zeros(n, dtype=torch.long))
    freq = torch.bincount(t, minlength=4).float() / n
    assert (freq - logits[0].softmax(-1)).abs().max() < 0.03


def test_top_k_top_p_filters():
    x = torch.tensor([[3.0, 2.0, 1.0, 0.0], [3.0, 2.0, 1.0, 0.0]])
    y = apply_top_k_top_p(x, torch.tensor([2, -1]), torch.tensor([1.0, 0.5]))
    assert torch.isinf(y[0, 2:]).all() and torch.isfinite(y[0, :2]).all()
    assert torch.isfinite(y[1, 0]) and torch.isinf(y[1, 1:]).all()  # p(top) = 0.64 > 0.5
    n = 64
    t = sample(x[:1].repeat(n, 1), torch.ones(n), torch.full((n,), 2), torch.ones(n),
               torch.arange(n), torch.zeros(n, dtype=torch.long))
    assert set(t.tolist()) <= {0, 1}


def test_runner_seeded_generation_reproducible_across_batches(tiny_dirs, h):
    path = tiny_dirs["llama"]
    prompts = h.prompts_of([12, 30, 7], seed=21)
    sp = [SamplingParams(temperature=1.0, top_p=0.95, seed=42, max_tokens=10),
          SamplingParams(temperature=0.8, top_k=40, seed=43, max_tokens=10),
          SamplingParams(temperature=1.0, seed=None, max_tokens=10)]
    runner = ModelRunner(path, num_kv_blocks=64, num_state_slots=4)
    together = h.drive(runner, prompts, 10, budget=16, sampling=sp)
    alone0 = h.drive(ModelRunner(path, num_kv_blocks=64), prompts[:1], 10, sampling=sp[:1])
    alone1 = h.drive(ModelRunner(path, num_kv_blocks=64), prompts[1:2], 10, sampling=sp[1:2],
                     first_block=30)
    assert together[0] == alone0[0]
    assert together[1] == alone1[0]
    assert together[0] != h.drive(ModelRunner(path, num_kv_blocks=64), prompts[:1], 10,
                                  sampling=[SamplingParams(temperature=1.0, top_p=0.95,
                                                           seed=41)])[0]


@pytest.mark.parametrize("isa", cbuild.tested_isas())
def test_greedy_equals_argmax_including_ties_infinities_and_nan(isa):
    """Every build this CPU runs (AVX-512, AVX2, generic) answers torch's argmax."""
    from pdserve.kernels import sampling

    if sampling._argmax_library(isa) is None:
        pytest.skip("no C compiler: torch's argmax is the only one")

    def greedy(x):
        return sampling.greedy(x, isa)

    g = torch.Generator().manual_seed(0)
    for vocab in (1, 7, 4096, 151_936):
        logits = torch.randn(16, vocab, generator=g)
        assert torch.equal(greedy(logits), logits.argmax(-1))
    x = torch.randn(10, 50, generator=g)
    x[0, [3, 17, 40]] = 9.0  # ties: the first maximal index
    x[1, :] = float("-inf")  # nothing but -inf
    x[1, 5] = -1e30
    x[2, 11] = float("inf")
    x[3, [2, 30]] = float("inf")  # tied infinities
    x[4, :] = float("-inf")  # an all -inf row
    x[5, 8] = float("nan")  # NaN wins argmax
    x[6, :] = 0.0
    x[7, 49] = 1e-45  # a subnormal maximum, last column
    x[8, 0] = 3e38
    x[9, [20, 4]] = float("nan")  # the first NaN, after a larger value
    x[9, 1] = 50.0
    assert torch.equal(greedy(x), x.argmax(-1))
    assert torch.equal(greedy(x[:, 3:41]), x[:, 3:41].argmax(-1))  # a strided view
    wide = torch.randn(12, 4099, generator=g)  # the unrolled loop's chains and a tail
    wide[0, [3000, 700, 2000, 4098]] = 9.0  # ties in different chains and lanes
    wide[1, [4098, 4097]] = 9.0  # ties in the tail only
    wide[2, :] = float("-inf")
    wide[3, [4000, 900]] = float("nan")
    wide[4, :] = 1.0
    wide[5, 33] = float("inf")
    assert torch.equal(greedy(wide), wide.argmax(-1))
    assert greedy(wide)[:6].tolist() == [700, 4097, 0, 900, 0, 33]
    assert greedy(x).dtype == torch.long
    half = torch.randn(4, 33, generator=g).to(torch.bfloat16)  # other dtypes: argmax itself
    assert torch.equal(greedy(half), half.argmax(-1))


@pytest.mark.parametrize("num_blocks", [3, 300])  # 300: > 1 MiB, the streaming-store path
def test_kv_block_copies_equal_torch_and_refuse_bad_ids(num_blocks):
    from pdserve.kernels import kv_cache as kvc

    if kvc._copy_kernels() is None:
        pytest.skip("no C compiler: the torch path is the only one")
    cache = kvc.KVCache(2, 2, 64, num_blocks * 2 + 1, 16)
    g = torch.Generator().manual_seed(3)
    for layer in (*cache.k_blocks, *cache.v_blocks):
        layer.copy_(torch.randn(layer.shape, generator=g))
    ids = torch.randperm(num_blocks * 2, generator=g)[:num_blocks].add(1).tolist()
    out = cache.export_sequence(ids, 0, num_blocks * 16)
    for n, i in enumerate(cache.full_layers):
        assert torch.equal(out["k_blocks"][n], cache.k_blocks[i][ids])
        assert torch.equal(out["v_blocks"][n], cache.v_blocks[i][ids])
    other = kvc.KVCache(2, 2, 64, num_blocks * 2 + 1, 16)
    dest = list(reversed(range(1, num_blocks + 1)))
    other.import_sequence(dest, 0, out)
    for n, i in enumerate(other.full_layers):
        assert torch.equal(other.k_blocks[i][dest], out["k_blocks"][n])
        assert torch.equal(other.v_blocks[i][0], torch.zeros_like(other.v_blocks[i][0]))
    with pytest.raises(IndexError):
        other.write_blocks([0] * (num_blocks - 1) + [num_blocks * 2 + 1],
                           out["k_blocks"], out["v_blocks"])


def _table(kind: str, n: int, pool: int, g: torch.Generator) -> list[int]:
    """``n`` distinct block ids in ``[1, pool]``: shuffled (runs of one), ascending runs
    with gaps (as a lightly used pool hands out), one ascending run, or descending."""
    if kind == "shuffled":
        return torch.randperm(pool, generator=g)[:n].add(1).tolist()
    if kind == "runs":
        ids, start = [], 1
        while len(ids) < n:
            length = int(torch.randint(1, 9, (1,), generator=g))
            ids += range(start, start + length)
            start += length + int(torch.randint(0, 3, (1,), generator=g))
        ids = ids[:n]
        # runs in a shuffled order, as blocks freed by several requests come back
        cut = n // 2
        return ids[cut:] + ids[:cut]
    if kind == "ascending":
        return list(range(pool - n + 1, pool + 1))
    return list(range(n, 0, -1))  # descending: a reversed free list


@pytest.mark.parametrize("isa", cbuild.tested_isas())
@pytest.mark.parametrize("kind", ["shuffled", "runs", "ascending", "descending"])
@pytest.mark.parametrize("num_blocks,block_size,heads,dim", [
    (5, 16, 2, 64), (40, 16, 1, 8),  # below 1 MiB a layer: memcpy per run
    (300, 16, 2, 64), (450, 16, 1, 40),  # >= 1 MiB: streamed (8 KiB and 2560-byte rows)
    (20000, 5, 1, 3)])  # >= 1 MiB of 60-byte rows (not whole lines): memcpy per run
def test_kv_block_copies_equal_torch_for_every_build_and_table(monkeypatch, isa, kind,
                                                               num_blocks, block_size,
                                                               heads, dim):
    """Every build (store width), both copy paths (streaming stores with prefetch; one
    memcpy per run of consecutive ids), tables with and without runs: the same bytes as
    torch's indexing, and nothing written outside the table."""
    from pdserve.kernels import kv_cache as kvc

    lib = kvc._copy_kernels(isa)
    if lib is None:
        pytest.skip("no C compiler: the torch path is the only one")
    monkeypatch.setattr(kvc, "_copy_kernels", lambda isa_=None: lib)
    g = torch.Generator().manual_seed(num_blocks)
    pool = 2 * num_blocks + 3
    cache = kvc.KVCache(3, heads, dim, pool + 1, block_size)
    for layer in (*cache.k_blocks, *cache.v_blocks):
        layer.copy_(torch.randn(layer.shape, generator=g))
    ids = _table(kind, num_blocks, pool, g)
    out = cache.export_sequence(ids, 0, num_blocks * block_size)
    for n, i in enumerate(cache.full_layers):
        assert torch.equal(out["k_blocks"][n], cache.k_blocks[i][ids])
        assert torch.equal(out["v_blocks"][n], cache.v_blocks[i][ids])
    # into a payload's tensor section at an offset that only SSE2's stores (or memcpy) take
    flat = torch.empty(out["k_blocks"].numel() + 4)
    unaligned = flat[4:].view(out["k_blocks"].shape)
    assert unaligned.data_ptr() % 64 == 16
    kvc._gather_into(cache._kernel_pools, unaligned,
                     [cache.k_blocks[i] for i in cache.full_layers], ids)
    assert torch.equal(unaligned, out["k_blocks"])

    _check_import(out, kind, pool, block_size, seed=7)


def _check_import(out: dict, kind: str, pool: int, block_size: int, seed: int,
                  copy_threads: int = 1) -> None:
    """Import ``out`` (3 layers) into a fresh cache along a ``kind`` table: every row
    where torch's indexing puts it, nothing written outside the table."""
    from pdserve.kernels import kv_cache as kvc

    _, num_blocks, _, heads, dim = out["k_blocks"].shape
    other = kvc.KVCache(3, heads, dim, pool + 1, block_size, copy_threads=copy_threads)
    dest = _table(kind, num_blocks, pool, torch.Generator().manual_seed(seed))
    other.import_sequence(dest, 0, out)
    untouched = sorted(set(range(pool + 1)) - set(dest))
    for n, i in enumerate(other.full_layers):
        assert torch.equal(other.k_blocks[i][dest], out["k_blocks"][n])
        assert torch.equal(other.v_blocks[i][dest], out["v_blocks"][n])
        assert not other.k_blocks[i][untouched].any()


@pytest.mark.parametrize("threads", [2, 3, 7])
@pytest.mark.parametrize("kind", ["shuffled", "runs"])
@pytest.mark.parametrize("num_blocks,heads,dim", [
    (300, 2, 64),  # 3 layers x 300 rows: shares that start and end inside a layer
    (20, 2, 64)])  # below THREAD_MIN_BYTES a thread: fewer threads than asked
def test_kv_block_copies_with_threads_equal_torch(threads, kind, num_blocks, heads, dim):
    """Copies split over threads (kv_copy_threads): every row once, where torch's
    indexing puts it, whatever share of which layer each thread took."""
    from pdserve.kernels import kv_cache as kvc

    if kvc._copy_kernels() is None:
        pytest.skip("no C compiler: the torch path is the only one")
    g = torch.Generator().manual_seed(threads)
    pool = 2 * num_blocks + 3
    cache = kvc.KVCache(3, heads, dim, pool + 1, 16, copy_threads=threads)
    for layer in (*cache.k_blocks, *cache.v_blocks):
        layer.copy_(torch.randn(layer.shape, generator=g))
    ids = _table(kind, num_blocks, pool, g)
    out = cache.export_sequence(ids, 0, num_blocks * 16)
    for n, i in enumerate(cache.full_layers):
        assert torch.equal(out["k_blocks"][n], cache.k_blocks[i][ids])
        assert torch.equal(out["v_blocks"][n], cache.v_blocks[i][ids])
    _check_import(out, kind, pool, 16, seed=11, copy_threads=threads)
    with pytest.raises(ValueError, match="copy_threads"):
        kvc.KVCache(3, heads, dim, pool + 1, 16, copy_threads=0)


def test_an_engines_kv_copy_threads_reach_its_cache_and_bad_counts_are_refused(tiny_dirs):
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.model_runner import ModelRunner

    for bad in (0, 65):
        with pytest.raises(ValueError, match="kv_copy_threads must be"):
            EngineConfig(model_dir=str(tiny_dirs["llama"]), kv_copy_threads=bad)
    config = EngineConfig(model_dir=str(tiny_dirs["llama"]), num_kv_blocks=16, kv_copy_threads=3)
    assert ModelRunner.from_engine_config(config).kv_cache.copy_threads == 3
    assert EngineConfig(model_dir=str(tiny_dirs["llama"])).kv_copy_threads == 2


def test_kv_block_copies_check_every_id_before_copying_any():
    from pdserve.kernels import kv_cache as kvc

    if kvc._copy_kernels() is None:
        pytest.skip("no C compiler: the torch path is the only one")
    cache = kvc.KVCache(2, 2, 64, 20, 16)
    k = torch.ones(2, 3, 16, 2, 64)
    for bad in ([1, 2, 20], [-1, 2, 3]):
        with pytest.raises(IndexError):
            cache.write_blocks(bad, k, k)
        assert not any(layer.any() for layer in cache.k_blocks)  # nothing copied
    with pytest.raises(IndexError):
        cache.export_sequence([3, 25], 0, 32)
