"""Fixtures for the model/kernel tests: tiny model folders (generated once per
session), transformers references, and a small scheduler-like driver."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from pdserve.engine.model.tiny import make_tiny_model  # noqa: E402
from pdserve.engine.model_runner import RunnerRow  # noqa: E402
from pdserve.scheduler.sampling_params import SamplingParams  # noqa: E402


def random_hf_model(cfg_cls: str, **kw):
    """A small random transformers model of config class ``cfg_cls`` (``kw`` overrides
    the sizes), with non-trivial norms and biases."""
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    common.update(kw)
    cfg = getattr(transformers, cfg_cls)(**common)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or n.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.3)
    return model


@pytest.fixture
def hf_random():
    """``random_hf_model`` for a test."""
    return random_hf_model


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_models")
    return {
        "llama": make_tiny_model(root / "llama", "llama"),
        "mistral-swa": make_tiny_model(root / "mistral-swa", "mistral-swa"),
    }


_HF_CACHE: dict = {}


def hf_model(path):
    transformers = pytest.importorskip("transformers")
    key = str(path)
    if key not in _HF_CACHE:
        m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        _HF_CACHE[key] = m.eval()
    return _HF_CACHE[key]


def prompts_of(lengths, vocab=4096, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(3, vocab, (n - 1,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def hf_greedy(path, prompt, max_new, eos=2):
    m = hf_model(path)
    out = m.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                     dtype=torch.long), max_new_tokens=max_new, do_sample=False,
                     pad_token_id=eos)
    toks = out[0, len(prompt):].tolist()
    return toks[: toks.index(eos) + 1] if eos in toks else toks


@dataclass
class _Seq:
    prompt: list[int]
    blocks: list[int]
    slot: int
    sampling: SamplingParams
    max_new: int
    done_prompt: int = 0
    out: list[int] = field(default_factory=list)
    finished: bool = False


def drive(runner, prompts, max_new, budget=None, mixed=True, sampling=None, eos=2,
          first_block=1, slots=None):
    """Run prompts to completion the way the scheduler would: prefill chunks of at
    most ``budget`` positions per step (whole prompts when None), prompts in order
    (a chunked one ends the prefill selection), decode rows (q = 1) either in the
    same step as chunks (``mixed``) or in separate steps. Returns outputs per prompt."""
    seqs = _place(runner.block_size, prompts, max_new, sampling, first_block, slots)
    while not all(s.finished for s in seqs):
        rows, owners = _prefill_rows(seqs, budget)
        if mixed or not rows:
            _add_decode_rows(seqs, rows, owners)
        toks = runner.execute(rows)
        for (s, kind, q), t in zip(owners, toks, strict=True):
            _advance(s, kind, q, t, eos)
    return [s.out for s in seqs]


def _place(bs, prompts, max_new, sampling, first_block, slots) -> list[_Seq]:
    """Each prompt's sequence, with blocks for its prompt and every new token."""
    nxt = first_block
    seqs = []
    for i, p in enumerate(prompts):
        n = math.ceil((len(p) + max_new) / bs)
        sp = sampling[i] if isinstance(sampling, list) else (sampling or SamplingParams(
            temperature=0.0, max_tokens=max_new))
        seqs.append(_Seq(p, list(range(nxt, nxt + n)), slots[i] if slots else i, sp, max_new))
        nxt += n
    return seqs


def _prefill_rows(seqs, budget) -> tuple[list, list]:
    """One step's prefill chunks, prompts in order within ``budget`` positions; a chunked
    prompt ends the selection."""
    rows, owners = [], []
    left = budget if budget is not None else 10**9
    for s in seqs:
        if s.done_prompt < len(s.prompt) and left > 0:
            q = min(len(s.prompt) - s.done_prompt, left)
            last = s.done_prompt + q == len(s.prompt)
            rows.append(RunnerRow(s.prompt[s.done_prompt:s.done_prompt + q], s.done_prompt,
                                  s.blocks, s.slot, s.sampling, last, 0))
            owners.append((s, "p", q))
            left -= q
            if not last:
                break
    return rows, owners


def _add_decode_rows(seqs, rows, owners) -> None:
    for s in seqs:
        if s.done_prompt == len(s.prompt) and not s.finished:
            hist = len(s.prompt) + len(s.out)
            rows.append(RunnerRow([s.out[-1]], hist - 1, s.blocks, s.slot, s.sampling,
                                  True, len(s.out)))
            owners.append((s, "d", 1))


def _advance(s: _Seq, kind: str, q: int, token, eos) -> None:
    """A row's result: its prompt positions done, its sampled token (if any) taken."""
    if kind == "p":
        s.done_prompt += q
    if token is None:
        return
    s.out.append(token)
    if token == eos or len(s.out) >= s.max_new:
        s.finished = True


def decode_hidden(runner, rows):
    """A decode step's hidden states for ``rows`` (``RunnerRow``s), through whichever path
    ``runner``'s model takes (the C step, or torch)."""
    tokens, positions, meta, _ = runner.prepare(rows)
    return runner.model.forward_decode(tokens, positions, runner.kv_cache, meta)


@pytest.fixture(scope="session")
def h():
    """The helpers above, for test modules (conftest is not importable by name)."""
    from types import SimpleNamespace

    return SimpleNamespace(drive=drive, hf_greedy=hf_greedy, prompts_of=prompts_of,
                           hf_model=hf_model, decode_hidden=decode_hidden)
