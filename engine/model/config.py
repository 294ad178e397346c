"""Hugging Face ``config.json`` -> a typed, validated :class:`ModelConfig`.

Supported: ``LlamaForCausalLM``, ``MistralForCausalLM`` (sliding window on every
layer), ``Qwen2ForCausalLM`` (qkv bias; sliding window on layers
``>= max_window_layers`` when ``use_sliding_window``), ``Qwen3ForCausalLM`` (q/k
RMSNorm per head). RoPE types: default, linear, llama3. Anything else is refused
with an error that names the field and the value.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
_ARCHITECTURE_OF_MODEL_TYPE = {family: arch for arch, family in SUPPORTED_ARCHITECTURES.items()}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class ModelConfigError(ValueError):
    """A config.json that pdserve cannot run; the message names the problem."""


@dataclass(frozen=True)
class RopeConfig:
    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    family: str  # llama | mistral | qwen2 | qwen3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # One entry per layer: None for full attention, else the window length W
    # (a query at position p sees keys p-W+1 .. p, as in transformers).
    layer_windows: tuple[int | None, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def sliding_window(self) -> int | None:
        windows = [w for w in self.layer_windows if w is not None]
        return max(windows) if windows else None

    @property
    def has_sliding_window(self) -> bool:
        return any(w is not None for w in self.layer_windows)

    @property
    def has_full_attention(self) -> bool:
        return any(w is None for w in self.layer_windows)

    @classmethod
    def from_model(cls, model: str | Path) -> ModelConfig:
        """The config of a model folder (config.json) or GGUF file (its metadata)."""
        # lazy: gguf_file loads numpy and gguf (`import pdserve.cli` loads this module)
        from pdserve.engine.model.gguf_file import GGUFModel, find_gguf

        gguf_path = find_gguf(model)
        if gguf_path is None:
            return cls.from_dir(model)
        return cls.from_dict(GGUFModel.open(gguf_path).hf_config(), source=str(gguf_path))

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not Path(model_dir).is_dir():
            raise FileNotFoundError(f"model folder {model_dir} does not exist")
        if not path.is_file():
            raise FileNotFoundError(f"config.json not found in model folder {model_dir}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ModelConfigError(f"{path}: invalid JSON ({e})") from e
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> ModelConfig:
        def need(key: str):
            if key not in raw or raw[key] is None:
                raise ModelConfigError(f"{source}: required field '{key}' is missing")
            return raw[key]

        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None and not archs:  # e.g. a hand-written config: model_type says it
            arch = _ARCHITECTURE_OF_MODEL_TYPE.get(raw.get("model_type"))
        if arch is None:
            raise ModelConfigError(
                f"{source}: unsupported architecture {archs or raw.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ModelConfigError(f"{source}: unsupported hidden_act {act!r} (only 'silu')")

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = int(raw.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise ModelConfigError(
                f"{source}: num_attention_heads ({heads}) is not a multiple of "
                f"num_key_value_heads ({kv_heads})"
            )
        if head_dim % 2:
            raise ModelConfigError(f"{source}: head_dim must be even for RoPE, got {head_dim}")
        num_layers = int(need("num_hidden_layers"))
        if raw.get("partial_rotary_factor", 1.0) not in (1, 1.0):
            raise ModelConfigError(f"{source}: partial_rotary_factor is not supported")

        rope = _parse_rope(raw, source)
        windows = _parse_windows(raw, family, num_layers, source)

        eos = raw.get("eos_token_id")
        eos_ids = tuple(int(e) for e in eos) if isinstance(eos, list) else (
            (int(eos),) if eos is not None else ()
        )
        dtype = raw.get("dtype") or raw.get("torch_dtype") or "float32"
        return cls(
            architecture=arch,
            family=family,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            rope=rope,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", family == "qwen2")),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=family == "qwen3",
            layer_windows=windows,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=str(dtype),
            raw=raw,
        )


def _parse_rope(raw: dict, source: str) -> RopeConfig:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ModelConfigError(f"{source}: rope_parameters must be an object, got {params!r}")
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ModelConfigError(f"{source}: per-layer-type rope_parameters are not supported")
    rope_type = params.get("rope_type") or params.get("type") or "default"
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(
            f"{source}: unsupported rope_type {rope_type!r}; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if params.get("partial_rotary_factor", 1.0) not in (1, 1.0):
        raise ModelConfigError(f"{source}: partial_rotary_factor is not supported")
    if rope_type == "default":
        return RopeConfig("default", float(theta))
    if "factor" not in params:
        raise ModelConfigError(f"{source}: rope_type {rope_type!r} needs 'factor'")
    if rope_type == "linear":
        return RopeConfig("linear", float(theta), factor=float(params["factor"]))
    for k in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        if k not in params:
            raise ModelConfigError(f"{source}: rope_type 'llama3' needs '{k}'")
    return RopeConfig(
        "llama3",
        float(theta),
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


def _parse_windows(raw: dict, family: str, n: int, source: str) -> tuple[int | None, ...]:
    if family == "llama":
        return (None,) * n
    window = _sliding_window(raw, family, source)
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        return _windows_by_layer_type(layer_types, window, n, source)
    if window is None:
        return (None,) * n
    if family == "mistral":
        return (window,) * n
    first = int(raw.get("max_window_layers", n))
    return tuple(window if i >= first else None for i in range(n))


def _sliding_window(raw: dict, family: str, source: str) -> int | None:
    """The configured window; qwen2/qwen3 configs carry one that applies only with
    ``use_sliding_window``."""
    window = raw.get("sliding_window")
    if family in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
        return None
    if window is None:
        return None
    window = int(window)
    if window < 1:
        raise ModelConfigError(f"{source}: sliding_window must be >= 1, got {window}")
    return window


def _windows_by_layer_type(layer_types: list, window: int | None, n: int,
                           source: str) -> tuple[int | None, ...]:
    if len(layer_types) != n:
        raise ModelConfigError(
            f"{source}: layer_types has {len(layer_types)} entries, expected {n}"
        )
    out: list[int | None] = []
    for i, t in enumerate(layer_types):
        if t == "full_attention":
            out.append(None)
        elif t == "sliding_attention":
            if window is None:
                raise ModelConfigError(
                    f"{source}: layer_types[{i}] is sliding_attention but no sliding_window"
                )
            out.append(window)
        else:
            raise ModelConfigError(f"{source}: unsupported layer_types[{i}] {t!r}")
    return tuple(out)

