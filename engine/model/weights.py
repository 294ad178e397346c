"""Weights loading with checks, from a model folder's safetensors or a GGUF file: missing
files, missing tensors and wrong shapes are reported by name (tensor, expected shape,
actual shape, file)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: the router lists weight files without torch
    import torch


class WeightsError(ValueError):
    """The model folder's weights do not fit the config; the message says how."""


def weight_files(model_dir: str | Path) -> list[Path]:
    """The files holding the weights: a GGUF file, or the safetensors files of a folder
    (sharded via the index, or every *.safetensors)."""
    # lazy: gguf_file loads numpy and gguf (`import pdserve.cli` loads this module)
    from pdserve.engine.model.gguf_file import find_gguf

    gguf_path = find_gguf(model_dir)
    if gguf_path is not None:
        return [gguf_path]
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
    # lazy: safetensors and gguf_file (numpy, gguf), only when weights load
    from safetensors import safe_open

    from pdserve.engine.model.gguf_file import GGUFModel, find_gguf

    gguf_path = find_gguf(model_dir)
    if gguf_path is not None:
        return _load_gguf(GGUFModel.open(gguf_path), expected, dtype, device, optional)
    where: dict[str, Path] = {}
    for f in weight_files(model_dir):
        with safe_open(f, framework="pt", device="cpu") as sf:
            for name in sf.keys():
                where.setdefault(name, f)
    _check_present(model_dir, [n for n in expected if n not in where and n not in optional])
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


def _check_present(model: str | Path, missing: list[str]) -> None:
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise WeightsError(f"model {model}: missing tensor(s) {', '.join(missing[:5])}{more}")


def _load_gguf(gguf, expected: dict[str, tuple[int, ...]], dtype: torch.dtype,
               device: str | torch.device, optional: frozenset[str]) -> dict[str, torch.Tensor]:
    import torch  # lazy: only when weights load (the CLI lists weight files with this module)

    present = {n for n in expected if gguf.has_tensor(n)}
    _check_present(gguf.path, [n for n in expected if n not in present and n not in optional])
    for name in present:
        shape = gguf.tensor_shape(name)
        if shape != tuple(expected[name]):
            raise WeightsError(f"tensor {name} ({gguf.gguf_name(name)}) in {gguf.path.name}: "
                               f"expected shape {tuple(expected[name])}, got {shape}")
    return {name: torch.from_numpy(gguf.tensor(name)).to(device=device, dtype=dtype)
            for name in expected if name in present}
