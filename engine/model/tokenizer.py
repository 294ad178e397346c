"""Tokenizer wrapper over the ``tokenizers`` library (no transformers needed).

``Tokenizer.from_model(path)`` takes a model folder or a GGUF file. A folder:
``tokenizer.json`` plus the BOS/EOS settings of ``tokenizer_config.json``,
``generation_config.json`` and ``config.json``. A GGUF file: its vocabulary, merges and
special ids, turned into a ``tokenizers`` tokenizer by transformers' GGUF converter (as
``from_pretrained(gguf_file=...)`` does; torch is not imported).
``encode`` adds BOS when the folder asks for it (once: a post-processor that already
adds it is respected); ``decode`` skips special tokens by default.
``IncrementalDetokenizer`` turns a growing token list into text deltas for streaming
without ever emitting half of a multi-byte character.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import pre_tokenizers


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_content(tok) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


def _digits_then_bytes():
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False)])


# llama.cpp pre-tokenizer names that transformers' GGUF converter does not know yet, as
# the models' own tokenizer.json files split text (SmolLM: one digit per piece).
_PRE_TOKENIZERS = {"smollm": _digits_then_bytes}


class Tokenizer:
    def __init__(self, tokenizer, bos_token_id: int | None, eos_token_ids: tuple[int, ...],
                 add_bos: bool):
        self._tok = tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.add_bos = add_bos and bos_token_id is not None

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def backend(self):
        """The ``tokenizers.Tokenizer`` underneath (for libraries that read a vocabulary)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_model(cls, model: str | Path) -> Tokenizer:
        """The tokenizer of a model folder or GGUF file."""
        # lazy: gguf_file loads numpy and gguf (the router imports this module)
        from pdserve.engine.model.gguf_file import find_gguf

        gguf_path = find_gguf(model)
        return cls.from_gguf(gguf_path) if gguf_path else cls.from_dir(model)

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        # lazy: transformers is heavy, gguf_file loads numpy: only for a GGUF file
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            convert_gguf_tokenizer,
        )

        from pdserve.engine.model.gguf_file import GGUFModel

        gguf = GGUFModel.open(path)
        tokenizer_dict = gguf.tokenizer_dict()
        tok, _ = convert_gguf_tokenizer(gguf.architecture, tokenizer_dict)
        split = _PRE_TOKENIZERS.get(tokenizer_dict.get("pre_tokenizer_type"))
        if split is not None:
            tok.pre_tokenizer = split()
        config = gguf.hf_config()
        eos = config.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(tok, config.get("bos_token_id"), eos_ids, gguf.add_bos_token)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        d = Path(model_dir)
        path = d / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer.json not found in model folder {d}")
        tok = HFTokenizer.from_file(str(path))
        tcfg = _read_json(d / "tokenizer_config.json")
        gcfg = _read_json(d / "generation_config.json")
        mcfg = _read_json(d / "config.json")

        def token_id(name: str) -> int | None:
            content = _token_content(tcfg.get(name))
            return tok.token_to_id(content) if content else None

        bos = token_id("bos_token")
        if bos is None:
            bos = gcfg.get("bos_token_id", mcfg.get("bos_token_id"))
        eos_raw = gcfg.get("eos_token_id", mcfg.get("eos_token_id"))
        eos_ids: list[int] = []
        if isinstance(eos_raw, list):
            eos_ids = [int(e) for e in eos_raw]
        elif eos_raw is not None:
            eos_ids = [int(eos_raw)]
        tok_eos = token_id("eos_token")
        if tok_eos is not None and tok_eos not in eos_ids:
            eos_ids.insert(0, tok_eos)
        add_bos = bool(tcfg.get("add_bos_token", False))
        return cls(tok, bos, tuple(eos_ids), add_bos)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)


class IncrementalDetokenizer:
    """Streaming text for one sequence: ``push(token_id)`` returns the new text.

    It re-decodes a small window of recent tokens so that merges across tokens
    (byte-level pieces, spaces) come out exactly as a full decode would, and holds
    text back while it ends in an incomplete UTF-8 sequence (U+FFFD).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None,
                 skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = list(prompt_ids or [])
        self.prefix_offset = max(len(self.ids) - 5, 0)
        self.read_offset = len(self.ids)
        self.text = ""

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        full = self.tok.decode(self.ids[self.prefix_offset:], self.skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is still held back (call when the sequence finishes)."""
        full = self.tok.decode(self.ids[self.prefix_offset:], self.skip)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        delta = full[len(prefix):]
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta
