"""Safetensors loading with checks: missing files, missing tensors and wrong shapes
are reported by name (tensor, expected shape, actual shape, file)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open


class WeightsError(ValueError):
    """The model folder's weights do not fit the config; the message says how."""


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a folder (sharded via the index, or every *.safetensors)."""
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({d / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"weights shard {f.name} listed in {index.name} is missing")
        return files
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights found in model folder {d}")
    return files


def file_digest(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def load_checked(
    model_dir: str | Path,
    expected: dict[str, tuple[int, ...]],
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    optional: frozenset[str] = frozenset(),
) -> dict[str, torch.Tensor]:
    """Load the tensors named in ``expected`` (name -> shape) from the folder.

    Names in ``optional`` may be absent (e.g. a tied ``lm_head.weight``). Extra
    tensors in the files are ignored. Shapes are checked before any data is read.
    """
    where: dict[str, Path] = {}
    for f in weight_files(model_dir):
        with safe_open(f, framework="pt", device="cpu") as sf:
            for name in sf.keys():
                where.setdefault(name, f)
    missing = [n for n in expected if n not in where and n not in optional]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise WeightsError(
            f"model folder {model_dir}: missing tensor(s) {', '.join(missing[:5])}{more}"
        )
    out: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        if name in where:
            by_file.setdefault(where[name], []).append(name)
    for f, names in by_file.items():
        with safe_open(f, framework="pt", device="cpu") as sf:
            for name in names:
                shape = tuple(sf.get_slice(name).get_shape())
                if shape != tuple(expected[name]):
                    raise WeightsError(
                        f"tensor {name} in {f.name}: expected shape {tuple(expected[name])}, "
                        f"got {shape}"
                    )
                out[name] = sf.get_tensor(name).to(device=device, dtype=dtype)
    return out
