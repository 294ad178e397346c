"""int8 activations against integer weight blocks (kernels/dot_block.h, the "dots" layout of
kernels/quant_panels.py, EngineSettings.activation_precision): every build this CPU runs
multiplies exactly the quantized rows a plain torch reference makes (a step per tile of
the weights: 8 values for nibbles, 4 for int8 values; a unit per 32 times an integer
sub-scale, rounded to nearest even) by the weight; every block format packs and
unpacks; the decode step and the prompt path give a row the same result whatever rides
with it; the setting picks the layout per weight; and on the real model the perplexity
stays within a stated bound of fp32 activations' while the greedy answers hold."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.kernels import cbuild, quant_panels, skinny_gemm
from pdserve.kernels.quant_panels import QuantPanels, QuantRows

ISAS = list(cbuild.tested_isas())
X_UNIT, SUBSCALE_MAX = 32, 4095  # dot_block.h's units and sub-scales


def _x_block(bits: int) -> int:
    """x's values per step: one tile of the weights, dot_block.h's tile_k (a tile of
    nibbles holds 8 k, one of int8 values 4)."""
    return 8 if bits == 4 else 4


def _quantized_x(x: torch.Tensor, block: int) -> torch.Tensor:
    """The reference: x [M, K] as its int8 rows dequantized. Per X_UNIT values a unit
    u = top / (127 * 4095) (top: their largest magnitude); per `block` a sub-scale
    s = ceil(amax * (4095 / top)), at most 4095, the step d = u * s and
    q = round(x * (1 / d)), ties to even; all in fp32 as the kernel computes them."""
    m, k = x.shape
    blocks = x.view(m, k // X_UNIT, X_UNIT // block, block)
    amax = blocks.abs().amax(-1, keepdim=True)
    top = amax.amax(-2, keepdim=True)
    u = top / (127.0 * SUBSCALE_MAX)
    per = torch.where(top > 0, torch.tensor(float(SUBSCALE_MAX)) / top, torch.zeros_like(top))
    s = torch.ceil(amax * per).clamp(max=SUBSCALE_MAX)
    d = u * s
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv)
    assert q.abs().max() <= 127
    return (q.double() * d.double()).view(m, k)


# name -> (values' range, block_k, offsets, fp16 scales): each GGUF block type's shape
FORMATS = {
    "Q4_1": ((0, 16), 32, "min", True),
    "Q4_0": ((0, 16), 32, "-8s", True),
    "Q8_0": ((-128, 128), 32, None, True),
    "Q4_K": ((0, 16), 32, "min", False),
    "Q6_K": ((-32, 32), 16, None, False),
}


def _rows(fmt: str, n: int, k: int, seed: int = 0) -> QuantRows:
    (lo, hi), bk, offsets, half = FORMATS[fmt]
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(lo, hi, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, k // bk, generator=g) * 0.02 + 1e-4
    scales = scales.half().float() if half else scales + 1e-7  # fp32: fp16 cannot hold them
    offs = None
    if offsets == "min":
        offs = -torch.rand(n, k // bk, generator=g) * 0.1
        offs = offs.half().float() if half else offs
    elif offsets == "-8s":
        offs = -8 * scales
    return QuantRows(values, scales, offs, bk)


def _reference(x: torch.Tensor, rows: QuantRows, bits: int) -> torch.Tensor:
    """sum over k of x's quantized value times the weight's (packed `bits` wide): fp64."""
    return _quantized_x(x, _x_block(bits)) @ rows.dequantize().double().T


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_int8_rows_times_each_block_format_are_the_quantized_products(isa, fmt):
    rows = _rows(fmt, 200, 256)  # 200: a partial last panel pair
    dots = QuantPanels.pack(rows, dots=True)
    plain = QuantPanels.pack(rows)
    assert dots.dots and (dots.bits, dots.scale_bytes) == (plain.bits, plain.scale_bytes)
    assert dots.nbytes() == plain.nbytes()  # the same bytes, another order
    g = torch.Generator().manual_seed(1)
    for m in (1, 2, 3, 5, 9, 33):  # one row, the row groups, their remainders
        x = torch.randn(m, 256, generator=g)
        x[0, :8] = 0.0  # an all-zero block of x: scale 0
        x[-1, 8:16] *= 1e3  # a block whose largest value dwarfs the others
        got = quant_panels.matmul(x, dots, isa=isa).double()
        ref = _reference(x, rows, dots.bits)
        assert (got - ref).abs().max() <= 2e-6 * ref.abs().max(), (isa, fmt, m)
        # and within int8's rounding of the fp32 activations' product
        exact = quant_panels.matmul(x, plain, isa=isa).double()
        assert (got - exact).abs().max() < 0.05 * exact.abs().max()


@pytest.mark.parametrize("isa", ISAS)
def test_each_build_says_which_integer_dot_product_it_uses(isa):
    dot = skinny_gemm._library(isa).simd_dot().decode()
    want = {"generic": "plain", "avx2": "maddubs", "avx512-emulated": "maddubs",
            "avx512vnni-emulated": "vnni"}.get(isa)
    if isa == "avx512":
        want = "vnni" if "avx512_vnni" in cbuild._cpu_flags() else "maddubs"
    assert dot == want


@pytest.mark.skipif("avx512" not in cbuild.runnable_isas(), reason="needs an AVX-512 CPU")
def test_an_emulated_build_is_the_avx512_build_bit_for_bit():
    """The emulated AVX-512 build this CPU's own avx512 build stands for (the same way of
    the integer dot: VNNI's or vpmaddubsw's) gives its results bit for bit, int8 and fp32
    rows, every block format and row group: avx512_emulated.h's intrinsics are the
    instructions'."""
    twin = "avx512vnni-emulated" if "avx512_vnni" in cbuild._cpu_flags() else "avx512-emulated"
    assert skinny_gemm._library(twin).simd_dot() == skinny_gemm._library("avx512").simd_dot()
    g = torch.Generator().manual_seed(2)
    for fmt in FORMATS:
        rows = _rows(fmt, 200, 256)
        for dots in (True, False):
            panels = QuantPanels.pack(rows, dots=dots)
            for m in (1, 2, 3, 5, 33):
                x = torch.randn(m, 256, generator=g)
                assert torch.equal(quant_panels.matmul(x, panels, isa="avx512"),
                                   quant_panels.matmul(x, panels, isa=twin)), (fmt, dots, m)


def test_tests_emulate_the_avx512_paths_the_cpu_does_not_take(monkeypatch):
    """AVX2 only: both emulated builds; AVX-512 with VNNI: the vpmaddubsw one; without
    VNNI: the VNNI one; no AVX2 (what they are compiled for): none. Never served."""
    from pdserve.engine.config import KERNEL_ISAS

    avx2, avx512 = {"avx2", "fma", "f16c"}, {"avx512f", "avx512bw", "avx512vl"}
    for flags, emulated in ((avx2, ("avx512-emulated", "avx512vnni-emulated")),
                            (avx2 | avx512, ("avx512vnni-emulated",)),
                            (avx2 | avx512 | {"avx512_vnni"}, ("avx512-emulated",)),
                            ({"sse2"}, ())):
        monkeypatch.setattr(cbuild, "_cpu_flags", lambda f=frozenset(flags): f)
        assert cbuild.tested_isas() == cbuild.runnable_isas() + emulated
    assert not set(cbuild.EMULATED) & set(KERNEL_ISAS)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_dots_panels_unpack_and_gather_the_rows_they_were_packed_from(fmt):
    rows = _rows(fmt, 70, 128, seed=3)
    dots = QuantPanels.pack(rows, dots=True)
    back = dots.unpack()
    assert torch.equal(back.values, rows.values) and torch.equal(back.scales, rows.scales)
    ids = torch.tensor([0, 15, 16, 31, 32, 69])
    assert torch.equal(quant_panels.gather_columns(dots, ids),
                       rows.dequantize()[ids])  # an embedding lookup in the dots layout


def test_weights_that_cannot_meet_int8_rows_are_refused_by_name():
    bf16 = QuantRows(torch.randn(32, 64).to(torch.bfloat16), torch.ones(32, 1), None, 64)
    assert not quant_panels.dots_fit(bf16)
    with pytest.raises(ValueError, match="int8 activations need integer values"):
        QuantPanels.pack(bf16, dots=True)
    coarse = QuantRows(torch.zeros(32, 64, dtype=torch.int8), torch.ones(32, 8), None, 8)
    with pytest.raises(ValueError, match="block_k 16 or 32"):
        QuantPanels.pack(coarse, dots=True)


def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    """One row alone, in a group, in a remainder, in a prompt of many: bit for bit the
    same (integer sums, then the same float steps per row), so a prompt's last row and
    a decode step agree, and speculation's rows equal plain decoding's."""
    rows = _rows("Q4_1", 96, 576)
    dots = QuantPanels.pack(rows, dots=True)
    x = torch.randn(37, 576, generator=torch.Generator().manual_seed(2))
    together = quant_panels.matmul(x, dots)
    for i in (0, 3, 36):
        assert torch.equal(quant_panels.matmul(x[i:i + 1], dots)[0], together[i])
    assert torch.equal(quant_panels.matmul(x[4:7], dots), together[4:7])


def test_activation_precision_is_checked_and_reaches_serve(tiny_model_dir):
    from pdserve.cli import build_parser
    from pdserve.engine.config import EngineSettings
    from pdserve.router.serve_command import serve_config

    with pytest.raises(ValueError, match="^activation_precision must be one of auto, fp32, int8"):
        EngineSettings(activation_precision="int4")
    assert EngineSettings().activation_precision == "auto"
    args = build_parser().parse_args(["serve", "--model", tiny_model_dir,
                                      "--activation-precision", "fp32"])
    config = serve_config(args)
    assert {p.engine.activation_precision for p in (config.prefill, config.decode,
                                                    config.normal)} == {"fp32"}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--activation-precision", "int4"])


@pytest.mark.parametrize("precision,file_dots,at_load_dots", [
    ("auto", True, False), ("int8", True, True), ("fp32", False, False)])
def test_the_setting_picks_int8_rows_per_weight(real_model_path, tiny_model_dir, precision,
                                                file_dots, at_load_dots):
    """auto: int8 rows for a GGUF file's blocks (the file's author chose quantization)
    but the attention's q|k|v, fp32 for a float checkpoint's weights quantized at load;
    int8: all; fp32: none."""
    from pdserve.engine.model.llama import load_model

    _, gguf = load_model(real_model_path, activations=precision)
    _, folder = load_model(tiny_model_dir, quantization="int8", activations=precision)
    for model, want in ((gguf, file_dots), (folder, at_load_dots)):
        qkv = {layer.self_attn.qkv.quant.dots for layer in model.model.layers}
        rest = {m.quant.dots for layer in model.model.layers
                for m in (layer.self_attn.o, layer.mlp.gate_up, layer.mlp.down)}
        assert rest == {want}
        assert qkv == {want and precision == "int8"}
    assert gguf.logits_proj.quant.dots == file_dots  # the Q8_0 LM head


@pytest.fixture(scope="module")
def runners(real_model_path):
    from pdserve.engine.model_runner import ModelRunner

    return {p: ModelRunner(real_model_path, block_size=16, num_kv_blocks=40, num_state_slots=2,
                           activation_precision=p) for p in ("fp32", "auto", "int8")}


def test_each_decode_steps_logits_stay_within_the_stated_tolerance(runners, real_chat_prompts):
    """The stated per-step bound (docs/models.md): a decode step's logits within 0.4
    (auto) / 0.7 (int8) rms of fp32 activations' over an fp32 cache, none more than 1.5
    off (measured on these prompts, with the fp16 cache both pick: 0.28 / 0.54 at most,
    0.57 / 1.07; the mean rms 0.089 / 0.146), and the records the same."""
    from pdserve.engine.model_runner import RunnerRow

    def decode_logits(r, ids):
        table = list(range(1, 1 + -(-len(ids) // r.block_size)))
        r.compute_logits([RunnerRow(ids[:-1], 0, table, 1)])
        return r.compute_logits([RunnerRow(ids[-1:], len(ids) - 1, table, 1)])[0]

    assert runners["auto"].model.matmul_weight_bytes() == runners["fp32"].model.matmul_weight_bytes()
    for precision, bound in (("auto", 0.4), ("int8", 0.7)):
        for prompt in real_chat_prompts:
            exact = decode_logits(runners["fp32"], prompt[:40])
            got = decode_logits(runners[precision], prompt[:40])
            diff = got - exact
            assert diff.pow(2).mean().sqrt() < bound and diff.abs().max() < 1.5, precision
            assert not torch.equal(got, exact)  # int8 rows did run


def test_a_decode_steps_int8_results_do_not_depend_on_the_thread_count(runners,
                                                                      real_chat_prompts):
    """The C step's int8 rows at 1 and 2 threads, bit for bit: one row (its SiLU * up
    and that row's quantization split by units among the threads) and three (rows by
    thread)."""
    from pdserve.engine.model_runner import RunnerRow

    r = runners["int8"]
    k = r.model._kernel
    prompts = [p[:20 + 7 * i] for i, p in enumerate(real_chat_prompts[:3])]
    tables = [[1 + 5 * i, 2 + 5 * i, 3 + 5 * i, 4 + 5 * i] for i in range(3)]
    r.compute_logits([RunnerRow(p[:-1], 0, t, 1) for p, t in zip(prompts, tables, strict=True)])
    rows = [RunnerRow(p[-1:], len(p) - 1, t, 1) for p, t in zip(prompts, tables, strict=True)]
    before = torch.get_num_threads()
    try:
        for step in (rows[:1], rows):
            tokens, positions, meta, _ = r.prepare(step)
            outs = []
            for threads in (1, 2):
                torch.set_num_threads(threads)
                outs.append(k.run(tokens, positions, r.kv_cache, meta, logits=True).logits)
            assert torch.equal(outs[0], outs[1]), len(step)
    finally:
        torch.set_num_threads(before)


def test_int8_perplexity_stays_near_fp32_activations(runners, real_model_path):
    """`pdserve bench perplexity`'s figures on 4 chunks of 512: perplexity within 0.3%
    of fp32 activations' (measured: auto +0.12%, int8 +0.19%; at 16 chunks +0.01 /
    +0.07% on AVX-512, +0.01 / +0.16% on AVX2), and the steadier mean KL divergence from
    fp32 activations' next-token distributions below 1e-3 / 1.2e-3 nats a token
    (measured 5.9e-4 / 7.7e-4; x's steps per 16 values instead of 8 would give about
    1.65e-3, per 32 3.1e-3), auto's below int8's (its q|k|v rows are exact); and a
    stream's path (one decode step a token over one chunk's scored half: a single
    chunk's figure moves more than four's) within 1% of fp32's forward pass."""
    from pdserve.bench import perplexity as ppl
    from pdserve.engine.model.tokenizer import Tokenizer

    ids = Tokenizer.from_model(real_model_path).encode(ppl.reference_text(),
                                                       add_special_tokens=False)
    chunks = ppl.chunks(ids, 512, 4)
    exact = [ppl.pdserve_logits(runners["fp32"], c) for c in chunks]  # once for both
    kl = {}
    for precision, bound in (("auto", 1e-3), ("int8", 1.2e-3)):
        got = ppl.compare((ppl.pdserve_logits(runners[precision], c), e, c)
                          for c, e in zip(chunks, exact, strict=True))
        assert abs(got["ppl"] / got["reference_ppl"] - 1) < 3e-3, (precision, got)
        kl[precision] = got["kl"]
        assert 0 < kl[precision] < bound, (precision, kl)
    assert kl["auto"] < kl["int8"]
    stepped = ppl.pdserve_perplexity(real_model_path, chunks[:1], decode_steps=True,
                                     runner=runners["auto"])
    forward = ppl.pdserve_perplexity(real_model_path, chunks[:1], runner=runners["fp32"])
    assert abs(stepped / forward - 1) < 1e-2, (stepped, forward)


def test_divergence_is_the_mean_kl_over_the_scored_rows():
    """KL(p || q) summed over the rows predicting the chunk's second half: here two rows
    of p = (1/2, 1/2) against q = (1/4, 3/4): 1/2 ln 2 + 1/2 ln(2/3) each; none against
    itself."""
    from pdserve.bench.perplexity import divergence

    p = torch.log(torch.tensor([[0.5, 0.5]] * 4))
    q = torch.log(torch.tensor([[0.9, 0.1], [0.25, 0.75], [0.25, 0.75], [0.1, 0.9]]))
    total, rows = divergence(p, q, [0, 1, 0, 1])  # rows 1 and 2 predict tokens 2 and 3
    assert rows == 2
    assert total == pytest.approx(2 * (0.5 * math.log(2) + 0.5 * math.log(2 / 3)), rel=1e-6)
    assert divergence(q, q, [0, 1, 0, 1])[0] == pytest.approx(0.0, abs=1e-7)


def test_the_ratio_comes_with_its_standard_error_over_the_chunks():
    """Two chunks: in the first every scored token is half as likely as the reference
    says (ln 2 more a token), in the second as likely: the ratio is exp(ln 2 / 2) and its
    standard error stdev(ln 2, 0) / sqrt(2) = ln 2 / 2. One chunk: no error."""
    from pdserve.bench.perplexity import compare

    chunk = [0, 1, 0, 1]  # rows 1 and 2 predict its scored tokens 0 and 1
    even = torch.log(torch.full((4, 2), 0.5))
    worse = torch.log(torch.tensor([[0.5, 0.5], [0.25, 0.75], [0.75, 0.25], [0.5, 0.5]]))
    got = compare([(worse, even, chunk), (even, even, chunk)])
    assert got["ppl"] / got["reference_ppl"] == pytest.approx(math.exp(math.log(2) / 2))
    assert got["ratio_se"] == pytest.approx(math.log(2) / 2)
    assert compare([(worse, even, chunk)])["ratio_se"] is None


def test_bench_perplexity_holds_the_chosen_precision_to_fp32_activations(real_model_path,
                                                                         tmp_path):
    """`pdserve bench perplexity --activation-precision int8` writes the figure, fp32
    activations' beside it (which equal the dequantized weights' fp32 figure but for
    rounding) and the divergence from them."""
    import argparse
    import json

    from pdserve.bench import perplexity as ppl

    p = argparse.ArgumentParser()
    ppl.add_args(p)
    out = tmp_path / "int8.json"
    assert ppl.run(p.parse_args(["--model", real_model_path, "--ctx", "64", "--chunks", "2",
                                 "--activation-precision", "int8", "--out", str(out)])) == 0
    got = json.loads(out.read_text())
    assert got["activation_precision"] == "int8"
    assert got["pdserve_fp32_activations"] == pytest.approx(got["pdserve_fp32"], rel=1e-6)
    assert got["vs_fp32_activations"] == pytest.approx(
        got["pdserve"] / got["pdserve_fp32_activations"] - 1, abs=1e-9)
    assert 0 < got["kl_vs_fp32_activations"] < 5e-3
    assert 0 < got["vs_fp32_activations_se"] < 1e-2
