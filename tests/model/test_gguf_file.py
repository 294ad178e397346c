"""GGUF files: a GGUF written here from the tiny model (as llama.cpp's converter writes
one: Q/K rows interleaved for its rope, names from gguf's table, a quantized matrix,
the tokenizer's vocabulary and merges) loads to the same model, tokenizer and template
as the Hugging Face folder; bad files are refused in one line, before any Ray starts."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from pdserve.engine.model.catalog import ModelError, check_model, resolve_model  # noqa: E402
from pdserve.engine.model.gguf_file import GGUFModel, find_gguf  # noqa: E402
from pdserve.engine.model.tokenizer import Tokenizer  # noqa: E402
from pdserve.engine.model_runner import ModelRunner, RunnerRow  # noqa: E402

QUANTIZED = "model.layers.1.mlp.up_proj.weight"  # stored as Q8_0


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf LlamaModel.permute, written out independently."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_gguf(hf_dir: Path, out: Path, *, arch: str = "llama", quantize: bool = True,
               extra_tensor=None, drop: tuple[str, ...] = ()) -> Path:
    """The tiny HF folder as a GGUF file."""
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    tcfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name("tiny test model")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    special = {t["content"] for t in tok["added_tokens"]}
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in special else 1 for t, _ in vocab])
    merges = tok["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_add_bos_token(bool(tcfg.get("add_bos_token", False)))
    w.add_chat_template(tcfg["chat_template"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg["num_hidden_layers"])
    for name, value in sorted(load_file(str(hf_dir / "model.safetensors")).items()):
        if name in drop:
            continue
        base, _, suffix = name.rpartition(".")
        value = value.astype(np.float32)
        if name.endswith("q_proj.weight"):
            value = _llama_cpp_permute(value, cfg["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            value = _llama_cpp_permute(value, cfg["num_key_value_heads"])
        target = f"{names.get_name(base)}.{suffix}"
        if quantize and name == QUANTIZED:
            q8 = gguf.quants.quantize(value, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(target, q8, raw_shape=q8.shape,
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(target, value)
    if extra_tensor is not None:
        extra_tensor(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_dir, tmp_path_factory):
    return write_gguf(Path(tiny_model_dir), tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module")
def dequantized_folder(tiny_model_dir, tiny_gguf, tmp_path_factory):
    """The HF folder with the Q8_0 matrix replaced by its dequantized values: the model
    the GGUF file holds, in Hugging Face form."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("dequant") / "model"
    shutil.copytree(tiny_model_dir, out)
    state = load_file(str(out / "model.safetensors"))
    reader = gguf.GGUFReader(str(tiny_gguf))
    t = next(t for t in reader.tensors if t.name == "blk.1.ffn_up.weight")
    assert t.tensor_type == gguf.GGMLQuantizationType.Q8_0
    state[QUANTIZED] = torch.from_numpy(
        gguf.quants.dequantize(t.data, t.tensor_type).copy()).reshape(state[QUANTIZED].shape)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _logits(model: str | Path, ids: list[int]) -> torch.Tensor:
    runner = ModelRunner(model, block_size=8, num_kv_blocks=16, num_state_slots=2, ring_len=8)
    table = list(range(1, 12))
    out, pos = [], 0
    for q in (13, 1, 20, 1):  # prefill chunks and decode steps
        out.append(runner.compute_logits([RunnerRow(ids[pos:pos + q], pos, table, 1)])[0])
        pos += q
    return torch.stack(out)


def test_gguf_config_matches_the_folder(tiny_model_dir, tiny_gguf):
    from pdserve.engine.model.config import ModelConfig

    ours, theirs = ModelConfig.from_model(tiny_gguf), ModelConfig.from_dir(tiny_model_dir)
    for field in ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers",
                  "num_heads", "num_kv_heads", "head_dim", "rms_norm_eps", "rope",
                  "tie_word_embeddings", "bos_token_id", "eos_token_ids", "layer_windows"):
        assert getattr(ours, field) == getattr(theirs, field), field


def test_gguf_weights_equal_the_folder_they_came_from(dequantized_folder, tiny_gguf):
    """Q/K rows put back in HF order (a wrong order changes every logit), Q8_0 dequantized."""
    ids = torch.randint(3, 4096, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    ours, ref = _logits(tiny_gguf, ids), _logits(dequantized_folder, ids)
    assert (ours - ref).abs().max().item() < 1e-4


def test_gguf_tokenizer_and_template_equal_the_folder(tiny_model_dir, tiny_gguf):
    from pdserve.router.chat_template import ChatTemplate

    ours, theirs = Tokenizer.from_model(tiny_gguf), Tokenizer.from_model(tiny_model_dir)
    assert (ours.bos_token_id, ours.eos_token_ids, ours.add_bos) == \
        (theirs.bos_token_id, theirs.eos_token_ids, theirs.add_bos)
    for text in ["the quick brown fox", "def f(x):\n    return x * 3 + 1\n", "1234 + 56",
                 "déjà vu, 東京 🙂", "</s> stays whole"]:
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.decode(ours.encode(text)) == theirs.decode(theirs.encode(text))
    msgs = [{"role": "user", "content": "hello"}]
    assert ChatTemplate.from_model_dir(tiny_gguf).render(msgs) == \
        ChatTemplate.from_model_dir(tiny_model_dir).render(msgs)


def test_a_folder_holding_one_gguf_file_is_that_file(tiny_gguf, tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "x.gguf").symlink_to(tiny_gguf)
    assert find_gguf(tmp_path / "m") == tmp_path / "m" / "x.gguf"
    (tmp_path / "m" / "y.gguf").symlink_to(tiny_gguf)
    with pytest.raises(ValueError, match="holds 2 GGUF files"):
        check_model(tmp_path / "m")


def test_truncated_gguf_is_refused(tiny_gguf, tmp_path):
    data = tiny_gguf.read_bytes()
    for cut in (10, len(data) // 3, len(data) - 100):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ModelError, match=rf"{bad}: (not a|truncated|not a readable)"):
            check_model(bad)


def test_unsupported_architecture_is_refused(tiny_model_dir, tmp_path):
    path = write_gguf(Path(tiny_model_dir), tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(ModelError, match="unsupported architecture 'gpt2'; supported: llama"):
        check_model(path)


def test_tensor_type_it_cannot_dequantize_is_refused_by_name(tiny_model_dir, tmp_path):
    def q8_1(w):  # a type the gguf package does not dequantize
        w.add_tensor("extra.weight", np.zeros((2, 40), np.uint8), raw_shape=(2, 40),
                     raw_dtype=gguf.GGMLQuantizationType.Q8_1)

    path = write_gguf(Path(tiny_model_dir), tmp_path / "q81.gguf", extra_tensor=q8_1)
    with pytest.raises(ModelError, match="tensor extra.weight has type Q8_1"):
        check_model(path)


def test_missing_tensor_is_named(tiny_model_dir, tmp_path):
    from pdserve.engine.model.weights import WeightsError

    path = write_gguf(Path(tiny_model_dir), tmp_path / "hole.gguf",
                      drop=("model.layers.0.mlp.up_proj.weight",))
    with pytest.raises(WeightsError, match="missing tensor.*model.layers.0.mlp.up_proj.weight"):
        ModelRunner(path, block_size=8, num_kv_blocks=16)


def test_gguf_fingerprint_is_the_file(tiny_gguf, tmp_path):
    a = ModelRunner(tiny_gguf, block_size=8, num_kv_blocks=8)
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(tiny_gguf.read_bytes())
    assert ModelRunner(copy, block_size=8, num_kv_blocks=8).model_fingerprint \
        == a.model_fingerprint
    assert GGUFModel.open(copy).path == copy.resolve()


# ---- Hugging Face folders, made robust -------------------------------------------------

def _copy(tiny_model_dir, tmp_path) -> Path:
    import shutil

    out = tmp_path / "m"
    shutil.copytree(tiny_model_dir, out)
    return out


def test_config_without_architectures_uses_model_type(tiny_model_dir, tmp_path):
    d = _copy(tiny_model_dir, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["architectures"]
    (d / "config.json").write_text(json.dumps(cfg))
    assert check_model(d).architecture == "LlamaForCausalLM"
    cfg["model_type"] = "gpt_neox"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="unsupported architecture 'gpt_neox'"):
        check_model(d)


def test_tied_embeddings_saved_as_lm_head(tiny_model_dir, tmp_path):
    """transformers' safetensors writer keeps a tied matrix as lm_head.weight only."""
    from safetensors.torch import load_file, save_file

    d = _copy(tiny_model_dir, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (d / "config.json").write_text(json.dumps(cfg))
    state = load_file(str(d / "model.safetensors"))
    state["lm_head.weight"] = state.pop("model.embed_tokens.weight")
    save_file(state, str(d / "model.safetensors"))
    runner = ModelRunner(d, block_size=8, num_kv_blocks=8)
    model = runner.model
    assert torch.equal(model.model.embed_tokens.weight, state["lm_head.weight"])
    del state["lm_head.weight"]
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match="model.embed_tokens.weight"):
        ModelRunner(d, block_size=8, num_kv_blocks=8)


def test_truncated_safetensors_is_refused(tiny_model_dir, tmp_path):
    d = _copy(tiny_model_dir, tmp_path)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(ModelError, match="model.safetensors: truncated"):
        check_model(d)


def test_builtin_names_resolve():
    resolved = resolve_model(None)
    assert resolved.name == "smollm2-135m-instruct"
    assert resolved.path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    with pytest.raises(ModelError, match="no such file or folder"):
        resolve_model("no-such-model")


def test_rank_repr_never_raises():
    from pdserve.rank.engine_rank import EngineRank

    rank = EngineRank.__new__(EngineRank)  # as Ray sees it when __init__ failed
    assert repr(rank).startswith("EngineRank(pool=normal, rank=?, pid=")


@pytest.mark.parametrize("case", ["missing", "truncated", "not-a-model"])
def test_serve_refuses_a_bad_model_in_one_line_before_ray(tiny_gguf, tmp_path, case):
    bad = {"missing": tmp_path / "nope.gguf", "truncated": tmp_path / "cut.gguf",
           "not-a-model": tmp_path / "notes.txt"}[case]
    if case == "truncated":
        bad.write_bytes(tiny_gguf.read_bytes()[:5000])
    elif case == "not-a-model":
        bad.write_text("hello")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pdserve.cli", "serve", "--model", str(bad),
                           "--port", "0"], capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ,
                               "PDSERVE_RAY_TMP": str(tmp_path / "ray")})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {bad}"), proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not (tmp_path / "ray").exists()  # no Ray process started
    assert time.monotonic() - t0 < 60


# ---- qwen2 / qwen3 files (no Q/K interleave; biases; q/k norms) ---------------------------

@pytest.mark.parametrize("arch,cfg_cls,kw", [
    ("qwen2", "Qwen2Config", {}),
    ("qwen3", "Qwen3Config", dict(head_dim=32)),
])
def test_qwen_gguf_logits_match_transformers(tmp_path, hf_random, arch, cfg_cls, kw):
    hf = hf_random(cfg_cls, num_hidden_layers=2, max_position_embeddings=256,
                   rope_theta=10000.0, **kw)
    cfg = hf.config
    w = gguf.GGUFWriter(str(tmp_path / "q.gguf"), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    names = gguf.get_tensor_name_map(
        next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), cfg.num_hidden_layers)
    for name, value in hf.state_dict().items():
        base, _, suffix = name.rpartition(".")
        w.add_tensor(f"{names.get_name(base)}.{suffix}", value.numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    runner = ModelRunner(tmp_path / "q.gguf", block_size=8, num_kv_blocks=16,
                         num_state_slots=2, ring_len=8)
    assert runner.config.architecture == f"{arch.capitalize()}ForCausalLM"
    ids = torch.randint(0, 512, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    table, pos, worst = list(range(1, 8)), 0, 0.0
    for q in (13, 1, 16):
        lg = runner.compute_logits([RunnerRow(ids[pos:pos + q], pos, table, 1)])
        pos += q
        worst = max(worst, (lg[0] - ref[pos - 1]).abs().max().item())
    assert worst < 1e-4, worst
