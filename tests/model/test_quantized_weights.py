"""Quantized weights computed in place (kernels/quant_panels.py, engine/model/quantized_weights.py):
the int8 matmul against the dequantized weight on every ISA build this CPU runs, a GGUF
file's blocks read without dequantizing equal to its dequantized tensors bit for bit, and
the real model's decode steps on its Q4_1 / Q8_0 blocks against the same steps on the
dequantized fp32 weights (logits, and greedy tokens wherever fp32 has no near tie)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.kernels import cbuild, quant_panels, skinny_gemm
from pdserve.kernels.quant_panels import QuantPanels, QuantRows

ISAS = list(cbuild.tested_isas())  # every build this CPU runs, and the emulated ones


def _rows(n: int, k: int, offsets: bool, seed: int = 0) -> QuantRows:
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8) if not offsets \
        else torch.randint(0, 16, (n, k), generator=g, dtype=torch.int8)
    scales = (torch.rand(n, k // 32, generator=g) * 0.02).half().float()  # fp16 values
    offs = (-torch.rand(n, k // 32, generator=g) * 0.1).half().float() if offsets else None
    return QuantRows(values, scales, offs, 32)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("offsets", [False, True])
def test_int8_matmul_equals_the_dequantized_weight(isa, offsets):
    rows = _rows(200, 576, offsets)  # 200 outputs: the last panel pair half empty
    panels = QuantPanels.pack(rows)
    w = rows.dequantize()
    bias = torch.randn(200)
    for m in (1, 5, 16, 40):  # one row, part of a block, whole blocks, several groups
        x = torch.randn(m, 576, generator=torch.Generator().manual_seed(m))
        got = quant_panels.matmul(x, panels, bias, isa=isa)
        want = (x.double() @ w.double().T + bias.double()).float()
        assert got.shape == (m, 200)
        assert (got - want).abs().max().item() < 1e-5 * max(1.0, want.abs().max().item())
        fp32 = skinny_gemm.matmul(x, skinny_gemm.pack(w), 200, bias)
        assert (got - fp32).abs().max().item() < 1e-4


@pytest.mark.parametrize("isa", ISAS)
def test_bf16_matmul_equals_the_rounded_weight(isa):
    """bf16 values (``round_bf16``: unit scales per 64 here, K = 576) through the one-row,
    few-rows and 8-row kernels: the products of the bf16 weights, to fp32 rounding; the
    records unpack to the very bf16 values."""
    from pdserve.engine.model.quantized_weights import round_bf16

    w = torch.randn(200, 576, generator=torch.Generator().manual_seed(16))
    rows = round_bf16(w)
    panels = QuantPanels.pack(rows)
    assert (panels.bits, panels.block_k, panels.scale_bytes) == (16, 64, 2)
    assert torch.equal(panels.unpack().values.view(torch.int16), rows.values.view(torch.int16))
    ref = rows.dequantize()
    assert torch.equal(ref, w.to(torch.bfloat16).float())
    with pytest.raises(ValueError, match="unit scales, no offsets"):
        QuantPanels.pack(QuantRows(rows.values, rows.scales * 2, None, rows.block_k))
    for m in (1, 3, 5, 16, 40):
        x = torch.randn(m, 576, generator=torch.Generator().manual_seed(m))
        want = (x.double() @ ref.double().T).float()
        got = quant_panels.matmul(x, panels, isa=isa)
        assert (got - want).abs().max().item() < 1e-5 * max(1.0, want.abs().max().item())


@pytest.mark.parametrize("offsets", [False, True])
@pytest.mark.parametrize("block_k", [16, 32])
def test_panels_unpack_to_the_rows_they_were_packed_from(offsets, block_k):
    g = torch.Generator().manual_seed(block_k)
    values = torch.randint(0, 16, (70, 64), generator=g, dtype=torch.int8) if offsets \
        else torch.randint(-127, 128, (70, 64), generator=g, dtype=torch.int8)
    scales = torch.rand(70, 64 // block_k, generator=g).half().float()
    offs = -scales * 8 if offsets else None
    rows = QuantRows(values, scales, offs, block_k)
    panels = QuantPanels.pack(rows)
    assert panels.bits == (4 if offsets else 8) and panels.has_offsets == offsets
    # one record per (pair, block, panel): fp16 scales (+ offsets), then the values
    record = 32 * (2 if offsets else 1) + 16 * block_k * panels.bits // 8
    assert tuple(panels.records.shape) == (3, 64 // block_k, 2, record)
    back = panels.unpack()
    assert torch.equal(back.values, values) and torch.equal(back.scales, scales)
    assert (back.offsets is None) == (not offsets)
    if offsets:
        assert torch.equal(back.offsets, offs)


@pytest.mark.parametrize("isa", ISAS)
def test_scales_fp16_cannot_hold_are_kept_fp32_and_computed_alike(isa):
    """0.1 is no fp16 value and 1e6 is past fp16's range (a K-quant's products of two
    scales are no fp16 values either): those records hold fp32; the matmul is exact."""
    g = torch.Generator().manual_seed(3)
    for scale, offsets in ((0.1, False), (1e6, False), (0.1, True)):
        values = torch.randint(0, 16, (40, 64), generator=g, dtype=torch.int8)
        offs = torch.full((40, 2), -0.3) if offsets else None
        rows = QuantRows(values, torch.full((40, 2), scale), offs, 32)
        panels = QuantPanels.pack(rows)
        assert panels.scale_bytes == 4 and panels.bits == 4
        assert torch.equal(panels.unpack().scales, rows.scales)
        w = rows.dequantize()
        for m in (1, 9):
            x = torch.randn(m, 64, generator=g)
            want = (x.double() @ w.double().T).float()
            got = quant_panels.matmul(x, panels, isa=isa)
            assert (got - want).abs().max().item() < 1e-5 * max(1.0, want.abs().max().item())
    with pytest.raises(ValueError, match="finite"):
        QuantPanels.pack(QuantRows(torch.ones(32, 32, dtype=torch.int8),
                                   torch.full((32, 1), float("inf")), None, 32))


def test_quant_rows_check_their_shapes():
    with pytest.raises(ValueError, match="block_k"):
        QuantRows(torch.zeros(4, 40, dtype=torch.int8), torch.zeros(4, 1), None, 32)
    with pytest.raises(ValueError, match="scales"):
        QuantRows(torch.zeros(4, 64, dtype=torch.int8), torch.zeros(4, 3), None, 32)
    with pytest.raises(ValueError, match="one K"):
        QuantRows.cat([_rows(32, 64, False), _rows(32, 96, False)])
    both = QuantRows.cat([_rows(32, 64, False), _rows(64, 64, True, seed=1)])
    assert both.shape == (96, 64) and both.offsets is not None
    assert torch.equal(both.offsets[:32], torch.zeros(32, 2))  # the symmetric part
    # a Q4_K part (a scale per 32) beside a Q6_K one (per 16): the finer blocks
    fine = _rows(16, 64, False, seed=2).with_block_k(16)
    mixed = QuantRows.cat([_rows(32, 64, True, seed=3), fine])
    assert mixed.block_k == 16 and mixed.shape == (48, 64)
    assert torch.equal(mixed.dequantize()[:32], _rows(32, 64, True, seed=3).dequantize())


def test_gguf_blocks_read_in_place_equal_the_dequantized_tensor(real_model_path):
    """Q4_1 (with llama.cpp's Q/K row order undone) and Q8_0 (the tied embedding)."""
    from pdserve.engine.model.gguf_file import GGUFModel

    g = GGUFModel.open(real_model_path)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.7.mlp.down_proj.weight", "model.embed_tokens.weight"):
        values, scales, offsets, bk = g.quantized(name)
        rows = QuantRows(torch.from_numpy(values), torch.from_numpy(scales),
                         None if offsets is None else torch.from_numpy(offsets), bk)
        assert torch.equal(rows.dequantize(), torch.from_numpy(g.tensor(name))), name
    assert g.quantized("model.norm.weight") is None  # F32: not a block type


def _k_quant_blocks(qtype: str, n: int, k: int) -> np.ndarray:
    """Random K-quant super-blocks (any bits are valid values and sub-block scales),
    their fp16 scale fields set to small positive values."""
    import gguf

    size = gguf.constants.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][1]
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, (n * k // 256, size), dtype=np.uint8)
    fields = (0, 2) if qtype == "Q4_K" else (208,)  # d, dmin / d
    for at in fields:
        blocks[:, at:at + 2] = rng.uniform(1e-3, 2e-2, (len(blocks), 1)).astype(
            np.float16).view(np.uint8)
    return blocks.reshape(n, -1)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
def test_each_block_type_reads_back_bit_for_bit(tmp_path, qtype):
    """The values and scales read in place dequantize to gguf's own dequantization bit
    for bit, and the C matmul on them equals the dequantized weight."""
    import gguf

    from pdserve.engine.model.gguf_file import GGUFModel

    n, k = 64, 512 if qtype.endswith("_K") else 96
    x = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32)
    t = gguf.GGMLQuantizationType[qtype]
    path = tmp_path / "one.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)  # what the name map needs
    q = _k_quant_blocks(qtype, n, k) if qtype.endswith("_K") else gguf.quants.quantize(x, t)
    w.add_tensor("output.weight", q, raw_shape=q.shape, raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    g = GGUFModel(path, gguf.GGUFReader(str(path)))
    values, scales, offsets, bk = g.quantized("lm_head.weight")
    assert (offsets is not None) == (qtype not in ("Q8_0", "Q6_K"))
    assert bk == (16 if qtype == "Q6_K" else 32)
    rows = QuantRows(torch.from_numpy(values), torch.from_numpy(scales),
                     None if offsets is None else torch.from_numpy(offsets), bk)
    want = torch.from_numpy(gguf.quants.dequantize(q, t).reshape(n, k))
    assert torch.equal(rows.dequantize(), want)
    panels = QuantPanels.pack(rows)
    assert panels.scale_bytes == (4 if qtype.endswith("_K") else 2)
    assert panels.bits == (8 if qtype in ("Q8_0", "Q6_K") else 4)
    xs = torch.randn(3, k, generator=torch.Generator().manual_seed(4))
    got, exact = quant_panels.matmul(xs, panels), (xs.double() @ want.double().T).float()
    assert (got - exact).abs().max().item() < 1e-5 * max(1.0, exact.abs().max().item())


def test_quantized_decode_steps_match_the_fp32_weights(real_model_path, real_chat_prompts):
    """The C decode step on the file's Q4_1 / Q8_0 blocks against the same step in torch
    on the dequantized fp32 weights (``quantization="none"``): the same weights, so
    logits differ only by rounding, and greedy tokens are equal wherever fp32's top two
    are not a near tie."""
    from pdserve.engine.model.llama import MatMul
    from pdserve.engine.model_runner import ModelRunner, RunnerRow

    def runner(quantization):
        return ModelRunner(real_model_path, block_size=16, num_kv_blocks=16, num_state_slots=2,
                           ring_len=16, quantization=quantization,
                           activation_precision="fp32")

    quantized, fp32 = runner("auto"), runner("none")
    mats = [m for m in quantized.model.modules() if isinstance(m, MatMul)]
    assert all(m.quant is not None for m in mats)  # every matmul of the Q4_1 file
    # Q4_1: half a byte a value, an fp16 scale and offset per 32 (0.625 of fp32's 4 bytes);
    # the Q8_0 head 1.0625: 0.179 of fp32's bytes in all, llama.cpp's own sizes
    fp32_bytes = sum(4 * m.out_features * m.in_features for m in mats)
    assert quantized.model.matmul_weight_bytes() == sum(m.quant.nbytes() for m in mats) \
        < 0.18 * fp32_bytes
    assert fp32.model.use_decode_kernel(False) is False  # torch, F.linear on fp32

    def decode_logits(r, ids: list[int]) -> torch.Tensor:
        table = list(range(1, 1 + -(-len(ids) // r.block_size)))
        r.compute_logits([RunnerRow(ids[:-1], 0, table, 1)])  # the prompt's KV
        return r.compute_logits([RunnerRow(ids[-1:], len(ids) - 1, table, 1)])[0]

    for p in real_chat_prompts:
        q, f = decode_logits(quantized, p[:40]), decode_logits(fp32, p[:40])
        assert (q - f).abs().max().item() < 2e-3 * f.abs().max().item()
        top2 = f.topk(2).values
        if (top2[0] - top2[1]).item() > 1e-3:  # no near tie: the same argmax
            assert q.argmax().item() == f.argmax().item()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bits,offsets,fp32_scales", [(4, True, False), (4, False, False),
                                                      (8, False, False), (8, True, True),
                                                      (16, False, False)])
def test_gathered_columns_are_the_dequantized_rows_bit_for_bit(isa, bits, offsets, fp32_scales):
    g = torch.Generator().manual_seed(bits + 2 * offsets)
    n, k = 100, 64
    values = torch.randint(0, 16, (n, k), generator=g).to(torch.int8) if bits == 4 else \
        torch.randint(-128, 128, (n, k), generator=g).to(torch.int8) if bits == 8 else \
        torch.randn(n, k, generator=g).to(torch.bfloat16)

    def per_block():
        t = torch.randn(n, k // 32, generator=g)
        return t if fp32_scales else t.half().float()

    scales = torch.ones(n, k // 32) if bits == 16 else per_block()  # bf16: the weight itself
    rows = QuantRows(values, scales, per_block() if offsets else None, 32)
    panels = QuantPanels.pack(rows)
    assert (panels.bits, panels.scale_bytes) == (bits, 4 if fp32_scales else 2)
    ids = torch.tensor([[0, 99], [37, 16]])
    assert torch.equal(quant_panels.gather_columns(panels, ids, isa), rows.dequantize()[ids])
    for bad in (-1, n):
        with pytest.raises(IndexError, match=r"token ids must lie in \[0, 100\)"):
            quant_panels.gather_columns(panels, torch.tensor([3, bad]), isa)


def test_a_quantized_model_holds_each_weight_once_at_its_quantized_size(real_model_path):
    """The records serve every product (decode rows and prompts of any length) and the
    tied embedding reads the LM head's: no fp32 copy of a quantized matmul is left, and a
    long prompt (past the decode kernels' 128 rows) gives the fp32 weights' logits to
    rounding. A compiled decode graph multiplies fp32 weights, so ``compile`` keeps them."""
    from pdserve.engine.model.llama import MatMul, load_model
    from pdserve.engine.model.quantized_weights import QuantEmbedding
    from pdserve.engine.model_runner import ModelRunner, RunnerRow

    def runner(quantization):
        return ModelRunner(real_model_path, block_size=16, num_kv_blocks=24, num_state_slots=2,
                           quantization=quantization, activation_precision="fp32")

    quantized, fp32 = runner("auto"), runner("none")
    model = quantized.model
    mats = [m for m in model.modules() if isinstance(m, MatMul)]
    assert all(m.weight is None and m.panels is None and m.quant is not None for m in mats)
    assert isinstance(model.model.embed_tokens, QuantEmbedding)
    assert model.model.embed_tokens.quant is model.logits_proj.quant  # one copy, in the arena
    fp32_table = fp32.model.model.embed_tokens.weight
    ids = torch.tensor([0, 1, 17, 4242, fp32_table.shape[0] - 1])
    assert torch.equal(model.model.embed_tokens(ids), fp32_table[ids])  # bit for bit
    with pytest.raises(IndexError, match="token ids must lie in"):
        model.model.embed_tokens(torch.tensor([fp32_table.shape[0]]))
    left = sum(p.numel() * p.element_size() for p in model.parameters())
    assert left < 0.01 * model.matmul_weight_bytes()  # the norms' weights only

    prompt = [(i * 7919) % 40000 + 100 for i in range(300)]
    table = list(range(1, 21))
    q, f = (r.compute_logits([RunnerRow(prompt, 0, table, 1)])[0] for r in (quantized, fp32))
    assert (q - f).abs().max().item() < 2e-3 * f.abs().max().item()

    _, kept = load_model(real_model_path, keep_fp32=True)
    assert all(m.weight is not None and m.quant is not None
               for m in kept.modules() if isinstance(m, MatMul))
    assert not isinstance(kept.model.embed_tokens, QuantEmbedding)


def test_int8_quantization_rounds_each_block_to_its_nearest_step():
    from pdserve.engine.model.quantized_weights import quantize_int8

    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(5))
    w[3, :32] = 0.0  # an all-zero block
    rows = quantize_int8(w)
    assert rows.values.dtype == torch.int8 and rows.offsets is None
    assert int(rows.values.abs().max()) == 127
    step = rows.scales.repeat_interleave(32, dim=1)
    assert ((rows.dequantize() - w).abs() <= step / 2 + 1e-7).all()
    assert torch.equal(rows.scales.half().float(), rows.scales)  # fp16 values, for the records
    assert torch.equal(rows.dequantize()[3, :32], torch.zeros(32))


def test_int8_for_a_folder_model_is_one_set_of_weights_on_every_path(tiny_model_dir):
    """--quantization int8 on a Hugging Face folder: every matmul quantized at load, its
    fp32 weight dropped; the decode kernel and the torch path (attention in torch, the
    matmuls on the same int8 panels) agree to rounding; "none" keeps fp32."""
    from pdserve.engine.model.llama import MatMul
    from pdserve.engine.model_runner import ModelRunner, RunnerRow

    def runner(quantization):
        return ModelRunner(tiny_model_dir, block_size=8, num_kv_blocks=16, num_state_slots=2,
                           ring_len=8, quantization=quantization)

    ids = list(range(5, 45))
    table = list(range(1, 8))

    def logits(r):
        r.compute_logits([RunnerRow(ids[:-1], 0, table, 1)])
        return r.compute_logits([RunnerRow(ids[-1:], len(ids) - 1, table, 1)])[0]

    q, plain = runner("int8"), runner("none")
    mats = [m for m in q.model.modules() if isinstance(m, MatMul)]
    assert mats and all(m.quant is not None and m.quant.bits == 8 and m.panels is None
                        and m.weight is None for m in mats)  # the panels replace fp32
    assert all(m.quant is None for m in plain.model.modules() if isinstance(m, MatMul))
    kernel = logits(q)
    q.model.use_decode_kernel(False)  # the same step through torch on the fp32 copy
    torch_path = logits(q)
    assert (kernel - torch_path).abs().max().item() < 1e-4 * max(1.0, kernel.abs().max().item())
    diff = (kernel - logits(plain)).abs().max().item()
    assert 0 < diff < 0.05 * logits(plain).abs().max().item()  # quantized, but close


def test_bf16_holds_a_folder_models_matmuls_at_half_their_bytes_exactly_rounded(
        tiny_model_dir, tmp_path):
    """--quantization bf16: every matmul rounded to bf16 at load (2 bytes a weight, fp32
    activations): the same logits, to rounding, as fp32 weights holding those bf16 values
    (a bf16 checkpoint loses nothing), through the C decode step and prompts alike."""
    import shutil

    from safetensors.torch import load_file, save_file

    from pdserve.engine.model.llama import MatMul
    from pdserve.engine.model_runner import ModelRunner, RunnerRow

    rounded = tmp_path / "bf16-values"
    shutil.copytree(tiny_model_dir, rounded)
    for f in rounded.glob("*.safetensors"):
        save_file({k: v.to(torch.bfloat16).float() if "_proj." in k or k.startswith("lm_head")
                   else v for k, v in load_file(str(f)).items()},
                  str(f), metadata={"format": "pt"})  # the matmuls' weights

    def runner(path, quantization):
        return ModelRunner(path, block_size=8, num_kv_blocks=16, num_state_slots=2,
                           ring_len=8, quantization=quantization)

    bf16, fp32 = runner(tiny_model_dir, "bf16"), runner(rounded, "none")
    mats = [m for m in bf16.model.modules() if isinstance(m, MatMul)]
    assert mats and all(m.quant is not None and m.quant.bits == 16 and m.weight is None
                        for m in mats)
    fp32_bytes = sum(4 * m.out_features * m.in_features for m in mats)
    assert bf16.model.matmul_weight_bytes() < 0.52 * fp32_bytes
    ids = list(range(5, 45))
    table = list(range(1, 8))
    for r in (bf16, fp32):
        r.compute_logits([RunnerRow(ids[:-1], 0, table, 1)])
    prompt_last = [r.compute_logits([RunnerRow(ids[-2:-1], len(ids) - 2, table, 1)])[0]
                   for r in (bf16, fp32)]  # rewrites one position: the same KV
    decode = [r.compute_logits([RunnerRow(ids[-1:], len(ids) - 1, table, 1)])[0]
              for r in (bf16, fp32)]
    assert bf16.decode_kernel
    for a, b in (prompt_last, decode):
        assert (a - b).abs().max().item() < 1e-4 * max(1.0, b.abs().max().item())


def test_quantization_setting_is_checked():
    from pdserve.engine.config import EngineSettings

    with pytest.raises(ValueError, match="^quantization must be one of auto, int8, bf16, none"):
        EngineSettings(quantization="int4")


def test_perplexity_through_the_quantized_decode_step_is_the_fp32_figure(real_model_path):
    """bench perplexity's figures: the scored half of each chunk one single-row decode
    step at a time (the C step on the file's Q4_1 / Q8_0 blocks), and one forward pass
    per chunk on the same records, against one forward pass on the weights dequantized to
    fp32: the issue's bound is 0.2%; the same weights differ only by rounding, so the
    figures agree far closer."""
    from pdserve.bench import perplexity as ppl
    from pdserve.engine.model.tokenizer import Tokenizer

    ids = Tokenizer.from_model(real_model_path).encode(ppl.reference_text()[:4000],
                                                       add_special_tokens=False)
    chunks = ppl.chunks(ids, 96, 2)
    runner = ppl.pdserve_runner(real_model_path, chunks, activation_precision="fp32")
    assert runner.model.matmul_quantized() and runner.decode_kernel
    fp32 = ppl.pdserve_runner(real_model_path, chunks, quantization="none")
    assert not fp32.model.matmul_quantized()
    reference = ppl.pdserve_perplexity(real_model_path, chunks, runner=fp32)
    forward = ppl.pdserve_perplexity(real_model_path, chunks, runner=runner)
    stepped = ppl.pdserve_perplexity(real_model_path, chunks, decode_steps=True, runner=runner)
    assert 1.0 < reference < 100.0
    assert abs(forward / reference - 1) < 2e-4
    assert abs(stepped / reference - 1) < 2e-4
