"""Model folders: the tiny model generator, config parsing, weights checks, tokenizer,
other Llama-family architectures against transformers, the CLI."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.cli import main as cli_main
from pdserve.engine.model.config import ModelConfig, ModelConfigError
from pdserve.engine.model.llama import CausalLM
from pdserve.engine.model.tiny import model_config
from pdserve.engine.model.tokenizer import IncrementalDetokenizer, Tokenizer
from pdserve.engine.model.weights import WeightsError
from pdserve.engine.model_runner import ModelRunner, RunnerRow


def _digests(d):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def test_tiny_model_is_deterministic_via_cli(tiny_dirs, tmp_path):
    assert cli_main(["make-tiny-model", str(tmp_path / "again")]) == 0
    assert _digests(tmp_path / "again") == _digests(tiny_dirs["llama"])
    names = set(_digests(tiny_dirs["llama"]))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= names


def test_tiny_model_shapes():
    tiny = ModelConfig.from_dict(model_config("llama", "tiny"))
    swa = ModelConfig.from_dict(model_config("mistral-swa", "tiny"))
    small = ModelConfig.from_dict(model_config("llama", "small"))
    assert (tiny.hidden_size, tiny.num_layers, tiny.num_heads, tiny.num_kv_heads) == (256, 4, 4, 2)
    assert swa.architecture == "MistralForCausalLM" and swa.layer_windows == (32,) * 4
    with torch.device("meta"):
        n = sum(p.numel() for p in CausalLM(small).parameters())
    assert 75e6 < n < 100e6, n
    with pytest.raises(ValueError, match="unknown variant 'gpt2'"):
        model_config("gpt2")


def test_transformers_tokenizer_agrees(tiny_dirs):
    transformers = pytest.importorskip("transformers")
    d = tiny_dirs["llama"]
    hf = transformers.AutoTokenizer.from_pretrained(d)
    tok = Tokenizer.from_model(d)
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    for text in ["The quick brown fox jumps over the lazy dog.", "  spaces\tand\nnewlines ",
                 "déjà vu, 東京, emoji 🙂!", "def f(x):\n    return x * 3 + 1\n"]:
        ids = tok.encode(text)
        assert ids == hf(text).input_ids
        assert ids[0] == 1 and ids.count(1) == 1
        assert tok.decode(ids) == text
        assert hf.decode(ids, skip_special_tokens=True) == text


def test_incremental_detokenizer_streams_whole_text(tiny_dirs):
    tok = Tokenizer.from_model(tiny_dirs["llama"])
    text = "Héllo wörld, 東京 🙂 and the model token cache."
    prompt = tok.encode("Prompt:")
    ids = tok.encode(text, add_special_tokens=False)
    det = IncrementalDetokenizer(tok, prompt)
    pieces = [det.push(t) for t in ids]
    pieces.append(det.flush())
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


# ---- bad folders ------------------------------------------------------------------

@pytest.fixture
def copy_of(tiny_dirs, tmp_path):
    def make(variant="llama"):
        dst = tmp_path / f"copy-{variant}"
        shutil.copytree(tiny_dirs[variant], dst)
        return dst
    return make


def _edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


def test_missing_config(copy_of):
    d = copy_of()
    (d / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        ModelRunner(d)


def test_missing_weights(copy_of):
    d = copy_of()
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors weights"):
        ModelRunner(d)


def test_missing_shard(copy_of):
    d = copy_of()
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        ModelRunner(d)


def test_missing_tokenizer(copy_of):
    d = copy_of()
    (d / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json not found"):
        ModelRunner(d, num_kv_blocks=4).tokenizer  # noqa: B018


@pytest.mark.parametrize("changes,match", [
    ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture .*GPT2LMHeadModel"),
    ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope_type 'yarn'"),
    ({"num_key_value_heads": 3}, r"num_attention_heads \(4\) is not a multiple"),
    ({"hidden_size": None}, "required field 'hidden_size' is missing"),
])
def test_bad_config(copy_of, changes, match):
    d = copy_of()
    _edit_config(d, **changes)
    with pytest.raises(ModelConfigError, match=match):
        ModelRunner(d)


def test_shape_mismatch_names_tensor(copy_of):
    d = copy_of()
    w = load_file(d / "model.safetensors")
    w["model.layers.2.mlp.up_proj.weight"] = w["model.layers.2.mlp.up_proj.weight"][:100]
    save_file(w, d / "model.safetensors")
    with pytest.raises(WeightsError, match=r"model\.layers\.2\.mlp\.up_proj\.weight .*"
                       r"expected shape \(688, 256\), got \(100, 256\)"):
        ModelRunner(d)


def test_missing_tensor_named(copy_of):
    d = copy_of()
    w = load_file(d / "model.safetensors")
    del w["model.layers.1.self_attn.k_proj.weight"]
    save_file(w, d / "model.safetensors")
    with pytest.raises(WeightsError, match=r"missing tensor\(s\) model\.layers\.1\.self_attn\.k_proj"):
        ModelRunner(d)


def test_config_variants_parse():
    base = model_config("llama")
    q2 = ModelConfig.from_dict({**base, "architectures": ["Qwen2ForCausalLM"],
                                "use_sliding_window": True, "sliding_window": 8,
                                "max_window_layers": 2})
    assert q2.layer_windows == (None, None, 8, 8)
    q2off = ModelConfig.from_dict({**base, "architectures": ["Qwen2ForCausalLM"],
                                   "sliding_window": 8})
    assert not q2off.has_sliding_window
    q3 = ModelConfig.from_dict({**base, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32})
    assert q3.qk_norm and q3.head_dim == 32
    l3 = ModelConfig.from_dict({**base, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})
    assert l3.rope.rope_type == "llama3" and l3.rope.theta == 5e5
    old = ModelConfig.from_dict({**{k: v for k, v in base.items() if k != "rope_parameters"},
                                 "rope_theta": 1e6, "rope_scaling": {"type": "linear",
                                                                      "factor": 2.0}})
    assert (old.rope.rope_type, old.rope.theta, old.rope.factor) == ("linear", 1e6, 2.0)


# ---- other architectures against transformers -----------------------------------

def _hf_random(hf_random, tmp_path, name, cfg_cls, **kw):
    model = hf_random(cfg_cls, **kw)
    model.save_pretrained(tmp_path / name)
    return tmp_path / name, model


@pytest.mark.parametrize("name,cfg_cls,kw", [
    ("qwen2-swa", "Qwen2Config", dict(use_sliding_window=True, sliding_window=8,
                                      max_window_layers=1)),
    ("qwen3", "Qwen3Config", dict(head_dim=32, attention_bias=True)),
    # Head size 32, so that the C decode step takes the decode steps: mixed full and
    # sliding-window layers through it.
    ("qwen2-swa-hd32", "Qwen2Config", dict(hidden_size=128, use_sliding_window=True,
                                           sliding_window=8, max_window_layers=1)),
    ("llama3-tied", "LlamaConfig", dict(tie_word_embeddings=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
])
def test_architecture_logits_match_transformers(tmp_path, hf_random, name, cfg_cls, kw):
    path, hf = _hf_random(hf_random, tmp_path, name, cfg_cls, **kw)
    runner = ModelRunner(path, block_size=8, num_kv_blocks=16, num_state_slots=2, ring_len=8)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (45,), generator=g).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    table = list(range(1, 8))
    pos, worst = 0, 0.0
    for q in [13, 20, 1, 11]:
        lg = runner.compute_logits([RunnerRow(ids[pos:pos + q], pos, table, 1)])
        pos += q
        worst = max(worst, (lg[0] - ref[pos - 1]).abs().max().item())
    assert worst < 1e-4, worst
    from pdserve.kernels import decode_step

    if name in ("qwen3", "qwen2-swa-hd32"):  # the single-token step ran in C
        assert runner.decode_kernel == decode_step.available()
