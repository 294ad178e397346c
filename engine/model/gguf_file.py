"""A GGUF model file: config, weights, tokenizer and chat template, all from one file.

llama.cpp's format carries everything a model needs. ``GGUFModel.open(path)`` reads the
header once (the ``gguf`` package, numpy only: no torch, so the router reads the
tokenizer and template with it too) and gives:

1. ``hf_config()``: the metadata as a Hugging Face ``config.json`` dict (llama, qwen2,
   qwen3; llama files whose name says Mistral as ``MistralForCausalLM``), which
   ``ModelConfig.from_dict`` validates like any other;
2. ``tensor(hf_name)``: a weight by its Hugging Face name, dequantized to float32 by the
   ``gguf`` package (every type it knows; others are refused by name when the file is
   checked), with the attention Q/K rows put back in Hugging Face order (llama.cpp's
   converter interleaves them for its rope);
3. ``tokenizer_dict()``: the vocabulary, merges and special ids in the shape transformers'
   GGUF tokenizer converter takes (``engine/model/tokenizer.py`` builds the tokenizer with it);
4. ``chat_template`` and ``special_tokens`` for the router's chat template.

``check()`` validates a file without reading its weights: header, architecture, every
tensor inside the file, every tensor type dequantizable. Errors are ``GGUFError`` with
one line naming the file and the problem.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

GGUF_SUFFIX = ".gguf"
# general.architecture -> the Hugging Face class it is loaded as
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# llama.cpp's converter interleaves the rotary halves of Q and K for these (its
# LlamaModel.permute); Qwen files keep Hugging Face's order.
_PERMUTED_QK = ("LlamaForCausalLM", "MistralForCausalLM")
_GGML_CONTROL = 3  # token_type of a control (special) token


class GGUFError(ValueError):
    """A GGUF file pdserve cannot serve; the message names the file and the problem."""


def is_gguf(path: str | Path) -> bool:
    return str(path).lower().endswith(GGUF_SUFFIX)


def find_gguf(path: str | Path) -> Path | None:
    """``path`` itself when it is a GGUF file; the one GGUF file in a folder that holds
    one and no ``config.json``; else None (a Hugging Face folder, or nothing)."""
    p = Path(path)
    if p.is_file() and is_gguf(p):
        return p
    if p.is_dir() and not (p / "config.json").is_file():
        files = sorted(f for f in p.glob("*" + GGUF_SUFFIX) if f.is_file())
        if len(files) == 1:
            return files[0]
        if len(files) > 1:
            raise GGUFError(f"{p}: holds {len(files)} GGUF files "
                            f"({', '.join(f.name for f in files[:3])}...): name one")
    return None


class GGUFModel:
    """One opened GGUF file; see the module docstring."""

    def __init__(self, path: Path, reader: Any) -> None:
        self.path = path
        self._reader = reader
        self._tensors = {t.name: t for t in reader.tensors}
        self._fields: dict[str, Any] = {}
        self.architecture = str(self.field("general.architecture", ""))

    @staticmethod
    def open(path: str | Path) -> GGUFModel:
        """The file at ``path``, read once per process (cached by path, size and mtime)."""
        p = Path(path).resolve()
        try:
            st = p.stat()
        except OSError as exc:
            raise GGUFError(f"{path}: {exc.strerror or exc}") from exc
        return _open_cached(str(p), st.st_size, st.st_mtime_ns)

    # -- metadata --------------------------------------------------------------------

    def field(self, key: str, default: Any = None) -> Any:
        if key not in self._fields:
            f = self._reader.fields.get(key)
            value = None if f is None else f.contents()
            if isinstance(value, float):  # stored as float32: its shortest decimal (1e-05)
                value = float(str(np.float32(value)))
            self._fields[key] = value
        value = self._fields[key]
        return default if value is None else value

    def _arch(self, key: str, default: Any = None) -> Any:
        return self.field(f"{self.architecture}.{key}", default)

    @property
    def hf_architecture(self) -> str:
        arch = GGUF_ARCHITECTURES.get(self.architecture)
        if arch is None:
            raise GGUFError(f"{self.path}: unsupported architecture {self.architecture!r}; "
                            f"supported: {', '.join(GGUF_ARCHITECTURES)}")
        name = str(self.field("general.name", "")).lower()
        if arch == "LlamaForCausalLM" and "mistral" in name:
            return "MistralForCausalLM"  # llama.cpp writes Mistral as llama (transformers too)
        return arch

    def hf_config(self) -> dict[str, Any]:
        """The metadata as a Hugging Face config.json dict."""
        arch = self.hf_architecture
        need = self._need
        heads = int(need("attention.head_count"))
        hidden = int(need("embedding_length"))
        head_dim = int(self._arch("attention.key_length", hidden // heads))
        rope_dims = self._arch("rope.dimension_count")
        if rope_dims is not None and int(rope_dims) != head_dim:
            raise GGUFError(f"{self.path}: partial rotary embeddings (rope.dimension_count "
                            f"{rope_dims} of head size {head_dim}) are not supported")
        if "rope_freqs.weight" in self._tensors:
            raise GGUFError(f"{self.path}: per-dimension rope frequencies (rope_freqs.weight, "
                            "llama3 rope scaling) are not supported")
        tokens = self.field("tokenizer.ggml.tokens")
        vocab = int(self._arch("vocab_size", len(tokens) if tokens is not None else 0))
        eos = [self.field(k) for k in ("tokenizer.ggml.eos_token_id",
                                       "tokenizer.ggml.eot_token_id")]
        eos_ids = list(dict.fromkeys(int(e) for e in eos if e is not None))
        raw: dict[str, Any] = {
            "architectures": [arch],
            "model_type": {"MistralForCausalLM": "mistral"}.get(arch, self.architecture),
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": int(need("feed_forward_length")),
            "num_hidden_layers": int(need("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self._arch("attention.head_count_kv", heads)),
            "head_dim": head_dim,
            "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
            "max_position_embeddings": int(self._arch("context_length", 4096)),
            "rope_theta": float(self._arch("rope.freq_base", 10000.0)),
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "attention_bias": "blk.0.attn_q.bias" in self._tensors,
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None),
            "torch_dtype": "float32",
        }
        scaling = self._arch("rope.scaling.type")
        if scaling not in (None, "none"):
            raw["rope_scaling"] = {"rope_type": str(scaling),
                                   "factor": float(self._arch("rope.scaling.factor", 1.0))}
        return raw

    def _need(self, key: str) -> Any:
        value = self._arch(key)
        if value is None:
            raise GGUFError(f"{self.path}: metadata {self.architecture}.{key} is missing")
        return value

    # -- tensors ---------------------------------------------------------------------

    def gguf_name(self, hf_name: str) -> str:
        """The file's name for a Hugging Face tensor name (gguf's own name table)."""
        base, dot, suffix = hf_name.rpartition(".")
        mapped = _name_map(self.architecture, int(self._need("block_count"))).get_name(base)
        if mapped is None:
            raise GGUFError(f"{self.path}: no GGUF name for tensor {hf_name}")
        return f"{mapped}{dot}{suffix}"

    def has_tensor(self, hf_name: str) -> bool:
        return self.gguf_name(hf_name) in self._tensors

    def tensor_shape(self, hf_name: str) -> tuple[int, ...]:
        t = self._tensors[self.gguf_name(hf_name)]
        return tuple(int(d) for d in reversed(t.shape))  # ggml lists the fastest dim first

    def tensor(self, hf_name: str) -> np.ndarray:
        """The weight, dequantized to float32, in Hugging Face layout."""
        t = self._tensors[self.gguf_name(hf_name)]
        shape = self.tensor_shape(hf_name)
        values = dequantize(t.data, t.tensor_type).reshape(shape)
        if not values.flags.writeable:  # float32 data is a view of the read-only mapping
            values = values.copy()
        if self.hf_architecture in _PERMUTED_QK:
            if hf_name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
                values = _unpermute(values, int(self._need("attention.head_count")))
            elif hf_name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
                values = _unpermute(values, int(self._arch(
                    "attention.head_count_kv", self._need("attention.head_count"))))
        return values

    def quantized(self, hf_name: str):
        """The weight as the file holds it, where the C kernels compute with it in place
        (``kernels/quant_panels.py``): (values int8 [N, K], scales float32 [N, K / bk],
        offsets float32 [N, K / bk] or None, bk) with ``scale * value + offset`` what
        ``tensor`` dequantizes to, bit for bit; None for other types (Q8_0, Q4_0, Q4_1,
        Q4_K and Q6_K only)."""
        t = self._tensors[self.gguf_name(hf_name)]
        layout = _BLOCKS.get(t.tensor_type.name)
        if layout is None:
            return None
        n, k = self.tensor_shape(hf_name)
        if layout in ("q4_k", "q6_k"):
            values, scales, offsets, bk = _k_quant(np.asarray(t.data).reshape(n * k // 256, -1),
                                                   layout)
            values, scales = values.reshape(n, k), scales.reshape(n, k // bk)
            offsets = None if offsets is None else offsets.reshape(n, k // bk)
        else:
            values, scales, offsets, bk = _block_32(np.asarray(t.data).reshape(n, k // 32, -1),
                                                    layout)
            values = values.reshape(n, k)
        if self.hf_architecture in _PERMUTED_QK and hf_name.endswith(
                ("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
            heads = int(self._need("attention.head_count") if "q_proj" in hf_name else
                        self._arch("attention.head_count_kv",
                                   self._need("attention.head_count")))
            values, scales = _unpermute(values, heads), _unpermute(scales, heads)
            offsets = None if offsets is None else _unpermute(offsets, heads)
        return values, scales, offsets, bk

    # -- tokenizer and chat template ---------------------------------------------------

    def tokenizer_dict(self) -> dict[str, Any]:
        """What transformers' GGUF tokenizer converter takes (its field names)."""
        keys = {"model": "tokenizer_type", "pre": "pre_tokenizer_type", "tokens": "tokens",
                "scores": "scores", "token_type": "token_type", "merges": "merges",
                "bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id",
                "unknown_token_id": "unk_token_id", "padding_token_id": "pad_token_id",
                "add_space_prefix": "add_prefix_space"}
        out = {}
        for key, name in keys.items():
            value = self.field(f"tokenizer.ggml.{key}")
            if value is not None:
                out[name] = value
        if "tokens" not in out:
            raise GGUFError(f"{self.path}: no tokenizer (tokenizer.ggml.tokens) in the file")
        return out

    @property
    def add_bos_token(self) -> bool:
        flag = self.field("tokenizer.ggml.add_bos_token")
        if flag is None:  # llama.cpp's default: sentencepiece vocabularies add BOS
            return self.field("tokenizer.ggml.model") == "llama"
        return bool(flag)

    @property
    def chat_template(self) -> str | None:
        template = self.field("tokenizer.chat_template")
        return str(template) if template else None

    @property
    def special_tokens(self) -> dict[str, str]:
        """bos_token, eos_token, unk_token and pad_token as strings, where the file names them."""
        tokens = self.field("tokenizer.ggml.tokens") or []
        out = {}
        for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                          ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
            token_id = self.field(f"tokenizer.ggml.{key}")
            if token_id is not None and 0 <= int(token_id) < len(tokens):
                out[name] = str(tokens[int(token_id)])
        return out

    # -- checks ------------------------------------------------------------------------

    def check(self) -> None:
        """Every tensor lies inside the file and has a type the gguf package dequantizes."""
        self.hf_config()
        size = self.path.stat().st_size
        tried: set = set()
        for t in self._reader.tensors:
            if int(t.data_offset) + int(t.n_bytes) > size:
                raise GGUFError(f"{self.path}: truncated (tensor {t.name} ends past the end "
                                "of the file)")
            if t.tensor_type in tried:
                continue
            tried.add(t.tensor_type)
            try:
                dequantize(np.asarray(t.data[:1]), t.tensor_type)
            except NotImplementedError:
                raise GGUFError(f"{self.path}: tensor {t.name} has type {t.tensor_type.name}, "
                                "which pdserve cannot dequantize") from None


@functools.lru_cache(maxsize=4)
def _open_cached(path: str, size: int, mtime_ns: int) -> GGUFModel:
    del size, mtime_ns  # the cache key: a file rewritten in place is read again
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError) as exc:
        if os.path.getsize(path) < 24:
            raise GGUFError(f"{path}: not a GGUF file (too short)") from exc
        raise GGUFError(f"{path}: not a readable GGUF file, truncated or corrupt "
                        f"({_short(exc)})") from exc
    return GGUFModel(Path(path), reader)


@functools.lru_cache(maxsize=8)
def _name_map(architecture: str, num_layers: int):
    arch = next((k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == architecture), None)
    if arch is None:
        raise GGUFError(f"unsupported GGUF architecture {architecture!r}")
    return gguf.get_tensor_name_map(arch, num_layers)


# GGUF block types whose 32-value blocks the C kernels read in place (quantized()).
_BLOCKS = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1", "Q4_K": "q4_k", "Q6_K": "q6_k"}


def _fp16_at(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 field at byte ``at`` of each block, as float32 [..., 1]."""
    return blocks[..., at:at + 2].copy().view(np.float16).astype(np.float32)


def _block_32(blocks: np.ndarray, layout: str):
    """Q8_0 / Q4_0 / Q4_1 blocks [N, K / 32, bytes]: (values, scales, offsets, 32)."""
    scales, offsets = _fp16_at(blocks, 0)[..., 0], None
    if layout == "q8_0":
        return blocks[..., 2:].copy().view(np.int8), scales, None, 32
    nibbles = blocks[..., 4:] if layout == "q4_1" else blocks[..., 2:]
    values = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1).astype(np.int8)
    if layout == "q4_0":  # d * (q - 8) as d * q + (-8 d): both exact in float32
        offsets = -8.0 * scales
    else:
        offsets = _fp16_at(blocks, 2)[..., 0]
    return values, scales, offsets, 32


# Scale fields that make gguf's own dequantization give a K-quant's integer values:
# Q4_K d = 1, dmin = 0 and every 6-bit sub-block scale 1, min 0; Q6_K d = 1 and every
# int8 sub-block scale 1. The bit layouts stay gguf's (not a copy of them here).
_UNIT_FP16 = np.array([1.0], np.float16).view(np.uint8)
_Q4_K_UNIT_SCALES = np.array([1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1], np.uint8)


def _k_quant(blocks: np.ndarray, layout: str):
    """Q4_K / Q6_K super-blocks [B, bytes] (256 values each) as (values int8 [B, 256],
    scales [B, subs], offsets [B, subs] or None, values per sub-block): a sub-block's
    scale is the product of the super-block's fp16 scale and its own (fp32: exact)."""
    unit = blocks.copy()
    if layout == "q4_k":
        sc, mn = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])
        scales = _fp16_at(blocks, 0) * sc.astype(np.float32)
        offsets = -(_fp16_at(blocks, 2) * mn.astype(np.float32))
        unit[:, 0:2], unit[:, 2:4], unit[:, 4:16] = _UNIT_FP16, 0, _Q4_K_UNIT_SCALES
        qtype, bk = gguf.GGMLQuantizationType.Q4_K, 32
    else:
        scales = _fp16_at(blocks, 208) * blocks[:, 192:208].view(np.int8).astype(np.float32)
        offsets = None
        unit[:, 192:208], unit[:, 208:210] = 1, _UNIT_FP16
        qtype, bk = gguf.GGMLQuantizationType.Q6_K, 16
    values = gguf.quants.dequantize(unit, qtype).reshape(len(blocks), 256).astype(np.int8)
    return values, scales, offsets, bk


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's ``permute``: the file orders each head's rows (i, half), rotary
    pairs interleaved; Hugging Face orders them (half, i), the two halves apart."""
    shape = w.shape
    return (w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:])
            .swapaxes(1, 2).reshape(shape))


def _short(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text[:200]
