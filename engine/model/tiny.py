"""The built-in model: a small Llama (or Mistral with a short sliding window) with
random weights and a byte-level BPE tokenizer trained here on a built-in corpus.

``make_tiny_model(path, variant, size)`` writes a Hugging Face folder that
``transformers`` loads unchanged. Everything is generated from fixed seeds, so the
same call writes byte-identical files. Its tokenizer_config.json carries a small chat
template (``CHAT_TEMPLATE``); ``add_chat_template(path)`` puts the current one into a
folder written before it existed (it rewrites only tokenizer_config.json).

Importing this module does not import torch (only writing weights does), so the router
process can call ``add_chat_template``.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

VARIANTS = ("llama", "mistral-swa")
SIZES = {
    # hidden, intermediate, layers, heads, kv heads
    "tiny": (256, 688, 4, 4, 2),
    "small": (768, 2048, 12, 12, 4),
}
VOCAB_SIZE = 4096
SLIDING_WINDOW = 32
SEED = 20261130
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
# The built-in chat template (tokenizer_config.json's "chat_template"): each turn is a
# plain-text role header line and the content, BOS opens the conversation and EOS ends
# every assistant turn (generation stops at EOS). It uses only the special tokens above,
# so the vocabulary is unchanged. Rendered, one user turn reads
# "<s>### user\nHello\n### assistant\n".
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '### ' + message['role'] + '\\n' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '### assistant\\n' }}{% endif %}"
)

_WORDS = (
    "the a an of to in and is was for on with as by at from that this it be are were "
    "model token cache block prefill decode request batch queue engine rank router "
    "stream key value attention layer head window ring slot scheduler chunk prompt "
    "river mountain forest city garden window table paper light music story morning "
    "evening winter summer ocean island bridge station market library teacher student "
    "quick brown fox jumps over lazy dog red green blue yellow small large old new "
    "runs walks reads writes sings builds opens closes finds keeps sends takes brings "
    "under above near between after before during while because although however "
    "one two three four five six seven eight nine ten hundred thousand first last"
).split()
_SYLLABLES = (
    "ka ri to mu sen la vo pe di qua zor nel fi ban tu ro sha gle mor tik pra "
    "dun ve lo ser mi ha ne ost ur bel cra jo fen wi ta"
).split()


def corpus(seed: int = SEED, lines: int = 6000) -> list[str]:
    """A fixed, generated text corpus (English-like sentences, invented words,
    numbers, punctuation and a little code) for training the tokenizer."""
    rng = random.Random(seed)
    invented = sorted({"".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4)))
                       for _ in range(3000)})
    out = []
    for i in range(lines):
        kind = i % 5
        if kind == 4:
            name = rng.choice(invented)
            out.append(f"def {name}(x, y={rng.randint(0, 99)}):\n    return x * {rng.randint(2, 9)} + y\n")
            continue
        n = rng.randint(6, 18)
        words = [rng.choice(invented) if rng.random() < 0.35 else rng.choice(_WORDS)
                 for _ in range(n)]
        if kind == 3:
            words.insert(rng.randint(0, n), str(rng.randint(0, 99999)))
        s = " ".join(words)
        s = s[0].upper() + s[1:] + rng.choice([".", ".", "!", "?", ";", ","])
        out.append(s)
    return out


def train_tokenizer(vocab_size: int = VOCAB_SIZE):
    # lazy: tokenizers, only to write a model (`import pdserve.cli` loads this module)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    return tok


def model_config(variant: str = "llama", size: str = "tiny",
                 max_position_embeddings: int = 2048) -> dict:
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose from {', '.join(SIZES)}")
    hidden, inter, layers, heads, kv_heads = SIZES[size]
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "initializer_range": 0.02,
        "dtype": "float32",
    }
    if variant == "mistral-swa":
        cfg.update(architectures=["MistralForCausalLM"], model_type="mistral",
                   sliding_window=SLIDING_WINDOW)
        del cfg["attention_bias"], cfg["mlp_bias"]
    return cfg


def random_weights(cfg: dict, seed: int = SEED) -> dict[str, torch.Tensor]:
    import torch  # lazy: only to write a model (`import pdserve.cli` loads this module)

    g = torch.Generator().manual_seed(seed)
    std = cfg["initializer_range"]
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def normal(*shape, scale=std):
        return (torch.randn(*shape, generator=g) * scale).contiguous()

    # Plain std-0.02 weights make greedy decoding collapse onto one repeated token.
    # Larger embeddings (the current token matters) and sharper attention (larger
    # q/k) give varied, context-dependent greedy outputs.
    w = {"model.embed_tokens.weight": normal(cfg["vocab_size"], h, scale=0.3)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        w[p + "self_attn.q_proj.weight"] = normal(nh * d, h, scale=0.1)
        w[p + "self_attn.k_proj.weight"] = normal(nkv * d, h, scale=0.1)
        w[p + "self_attn.v_proj.weight"] = normal(nkv * d, h)
        w[p + "self_attn.o_proj.weight"] = normal(h, nh * d)
        w[p + "mlp.gate_proj.weight"] = normal(i, h)
        w[p + "mlp.up_proj.weight"] = normal(i, h)
        w[p + "mlp.down_proj.weight"] = normal(h, i)
        # Norm scales near 1 (not exactly 1, so a missing norm would be noticed).
        w[p + "input_layernorm.weight"] = 1.0 + normal(h)
        w[p + "post_attention_layernorm.weight"] = 1.0 + normal(h)
    w["model.norm.weight"] = 1.0 + normal(h)
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = normal(cfg["vocab_size"], h)
    return w


def make_tiny_model(path: str | os.PathLike, variant: str = "llama", size: str = "tiny",
                    max_position_embeddings: int = 2048) -> Path:
    """Write the built-in model folder at ``path`` (created if needed) and return it;
    ``max_position_embeddings``: a longer context than the built-in 2048 (same weights)."""
    from safetensors.torch import save_file  # lazy: imports torch; only to write a model

    cfg = model_config(variant, size, max_position_embeddings)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer()
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True))
    _write_json(out / "tokenizer_config.json", tokenizer_config(cfg["max_position_embeddings"]))
    _write_json(out / "special_tokens_map.json",
                {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    _write_json(out / "config.json", cfg)
    _write_json(out / "generation_config.json", {
        "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": EOS_ID,
        "do_sample": False,
    })
    save_file(random_weights(cfg), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def tokenizer_config(model_max_length: int = 2048) -> dict:
    """The built-in model's tokenizer_config.json."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }


def add_chat_template(path: str | os.PathLike) -> bool:
    """Give a built-in model folder written by an older pdserve (no chat template, or an
    older one) the current ``CHAT_TEMPLATE``. Only tokenizer_config.json is rewritten
    (atomically), with its other keys kept; True if it was. Weights, vocabulary and
    generation are untouched."""
    file = Path(path) / "tokenizer_config.json"
    tok_cfg = json.loads(file.read_text()) if file.is_file() else tokenizer_config()
    if file.is_file() and tok_cfg.get("chat_template") == CHAT_TEMPLATE:
        return False
    tok_cfg["chat_template"] = CHAT_TEMPLATE
    tmp = file.with_name(file.name + f".tmp{os.getpid()}")
    _write_json(tmp, tok_cfg)
    os.replace(tmp, file)
    return True


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
