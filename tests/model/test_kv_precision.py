"""A 16-bit KV cache (``EngineSettings.kv_precision``): the C decode step reads and writes
fp16 keys and values as the torch path does (paged blocks and sliding-window rings, on
every build this CPU runs), every path attends to the values the cache holds, a budget
holds twice the blocks, and ``auto`` picks fp16 only where activations are rounded."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.model_runner import ModelRunner, RunnerRow, kv_dtype
from pdserve.kernels import cbuild, decode_step

needs_kernel = pytest.mark.skipif(not decode_step.available(),
                                  reason="the C decode step needs a C compiler")


def _written_alike(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Two fp16 stores written by two paths: their fp32 sums differ in the last bits
    (more in deeper layers and on the generic build), which moves a rounding by a step or
    two of the largest values (measured: 0.002-0.004 at 8.7) and almost no entry else
    (mean 3e-6); a misplaced or misconverted write would be off by far more."""
    a, b = a.float(), b.float()
    diff = (a - b).abs()
    return diff.max().item() <= 1e-3 * max(1.0, a.abs().max().item()) and \
        diff.mean().item() < 1e-5


@needs_kernel
@pytest.mark.parametrize("isa", cbuild.tested_isas())
@pytest.mark.parametrize("model", ["llama", "mistral-swa"])
def test_fp16_cache_decode_kernel_equals_the_torch_path(tiny_dirs, h, isa, model):
    """Rows past a sliding window (the mistral's rings wrap) and uneven paged rows:
    hidden states of the C step within 1e-3 of torch's over the same fp16 cache, and
    the cache written alike (``_written_alike``)."""
    path = tiny_dirs[model]
    kw = dict(num_kv_blocks=64, num_state_slots=8, adaptive_threads=False, kv_precision="fp16")
    ref = ModelRunner(path, decode_kernel=False, **kw)
    ker = ModelRunner(path, kernel_isa=isa, **kw)
    assert ker.decode_kernel and ref.kv_cache.dtype == ker.kv_cache.dtype == torch.float16
    prompts = h.prompts_of([5, 30, 41], seed=7)
    tables = [list(range(1 + 8 * i, 9 + 8 * i)) for i in range(3)]
    for r in (ref, ker):
        r.execute([RunnerRow(p, 0, t, state_slot=i + 1)
                   for i, (p, t) in enumerate(zip(prompts, tables, strict=True))])
    seqs = [list(p) for p in prompts]
    for step in range(24):
        rows = [RunnerRow([s[-1]], len(s) - 1, t, state_slot=i + 1)
                for i, (s, t) in enumerate(zip(seqs, tables, strict=True))]
        outs = [h.decode_hidden(r, rows) for r in (ref, ker)]
        # fp32's 1e-4 is not enough: a key rounded a step apart (``_written_alike``)
        # moves the hidden state by ~1e-4 of its size (measured: 3e-4 at most)
        assert (outs[0] - outs[1]).abs().max() < 1e-3 * max(1.0, outs[0].abs().max()), step
        for s, tok in zip(seqs, ref.model.compute_logits(outs[0]).argmax(-1).tolist(),
                          strict=True):
            s.append(tok)
    c, d = ref.kv_cache, ker.kv_cache
    stores = [(c.k_blocks[i], d.k_blocks[i]) for i in c.full_layers] + \
        [(c.v_blocks[i], d.v_blocks[i]) for i in c.full_layers] + \
        [(c.k_ring[i], d.k_ring[i]) for i in c.ring_layers] + \
        [(c.v_ring[i], d.v_ring[i]) for i in c.ring_layers]
    assert all(a.dtype == b.dtype == torch.float16 for a, b in stores)
    assert all(_written_alike(a, b) for a, b in stores)


def test_every_path_attends_to_the_keys_the_cache_holds(tiny_dirs, h):
    """A prompt in one chunk (its keys fresh from the step) and in two (the second
    reads the first's from the cache) give the same logits over an fp16 cache; the
    fp32 cache's differ from them, so the rounding is real."""
    path = tiny_dirs["llama"]
    prompt = h.prompts_of([40], seed=5)[0]
    table = list(range(1, 9))

    def logits(precision, cut):
        r = ModelRunner(path, num_kv_blocks=16, num_state_slots=2, kv_precision=precision)
        if cut:
            r.compute_logits([RunnerRow(prompt[:cut], 0, table, 1)])
        return r.compute_logits([RunnerRow(prompt[cut:], cut, table, 1)])[0]

    whole, chunked = logits("fp16", 0), logits("fp16", 24)
    assert (whole - chunked).abs().max() < 1e-5 * max(1.0, whole.abs().max().item())
    exact = logits("fp32", 0)
    assert (whole - exact).abs().max() > 1e-5


def test_a_budget_holds_twice_the_fp16_blocks(tiny_dirs):
    path = tiny_dirs["llama"]
    n = {p: ModelRunner(path, num_state_slots=2, kv_cache_bytes=4 << 20, kv_precision=p)
         for p in ("fp32", "fp16")}
    assert n["fp16"].kv_cache.bytes_per_block() * 2 == n["fp32"].kv_cache.bytes_per_block()
    assert n["fp16"].num_kv_blocks == 2 * n["fp32"].num_kv_blocks


def test_auto_is_fp16_only_where_activations_are_rounded(tiny_dirs):
    """``auto`` follows the activations: int8 rows of x, a 16-bit cache; fp32 rows
    (a float checkpoint, or ``activation_precision="fp32"``), the model's dtype. A GPU's
    cache holds the model's dtype, and asking it for another is refused by name."""
    path = tiny_dirs["llama"]

    def cache(**kw):
        return ModelRunner(path, num_kv_blocks=16, num_state_slots=2, **kw).kv_cache.dtype

    assert cache() == torch.float32  # a float checkpoint
    assert cache(quantization="int8", activation_precision="int8") == torch.float16
    assert cache(quantization="int8", activation_precision="fp32") == torch.float32
    assert cache(quantization="int8", activation_precision="int8",
                 kv_precision="fp32") == torch.float32
    model = ModelRunner(path, num_kv_blocks=16, num_state_slots=2).model
    cuda = torch.device("cuda")
    assert kv_dtype("auto", model, torch.bfloat16, cuda) == torch.bfloat16
    with pytest.raises(ValueError, match="kv_precision 'fp16' applies to CPU engines"):
        kv_dtype("fp16", model, torch.bfloat16, cuda)


def test_a_hand_off_carries_the_cache_dtype_and_a_mismatch_is_refused_by_name(tiny_dirs):
    """An fp16 prefill engine's payload is fp16: an fp16 decode engine imports it and
    finishes the request with the tokens a normal fp16 engine gives; an fp32 one refuses
    it, naming the field, before anything is allocated."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.kv.payload import KVPayload, KVPayloadError
    from pdserve.scheduler.sampling_params import SamplingParams

    path = tiny_dirs["llama"]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = list(range(7, 40))

    def engine(kind, precision):
        return LLMEngine(EngineConfig(model_dir=path, engine_type=kind, block_size=4,
                                      num_kv_blocks=64, max_num_seqs=4,
                                      kv_precision=precision))

    def drain(eng):
        tokens, handoffs = [], []
        while eng.has_work():
            step = eng.step()
            tokens += [t for o in step.outputs for t in o.new_token_ids]
            handoffs += step.handoffs
        return tokens, handoffs

    normal = engine("normal", "fp16")
    normal.add_request("r", prompt, params)
    want = drain(normal)[0]
    prefill = engine("prompt", "fp16")
    prefill.add_request("r", prompt, params)
    first, handoffs = drain(prefill)
    payload = KVPayload.from_bytes(handoffs[0].payload)
    assert payload.dtype == "float16"
    assert payload.tensors["k_blocks"].dtype == torch.float16
    refusing = engine("completion", "fp32")
    with pytest.raises(KVPayloadError, match="dtype mismatch: payload has 'float16', "
                                             "this engine 'float32'"):
        refusing.import_prefilled(handoffs[0].payload)
    assert not refusing.has_work()
    decode = engine("completion", "fp16")
    decode.import_prefilled(handoffs[0].payload)
    assert first == [] and [handoffs[0].first_token_id] + drain(decode)[0] == want


def test_kv_precision_is_checked_and_reaches_every_pool_from_serve(tiny_dirs):
    from pdserve.cli import build_parser
    from pdserve.engine.config import EngineSettings
    from pdserve.router.serve_command import serve_config

    assert EngineSettings().kv_precision == "auto"
    with pytest.raises(ValueError, match="^kv_precision must be one of auto, fp32, fp16"):
        EngineSettings(kv_precision="fp8")
    args = build_parser().parse_args(["serve", "--model", str(tiny_dirs["llama"]),
                                      "--kv-precision", "fp16"])
    config = serve_config(args)
    assert {p.engine.kv_precision for p in (config.prefill, config.decode,
                                            config.normal)} == {"fp16"}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-precision", "fp8"])
