"""Structured output: guides compiled by xgrammar, one matcher per guided sequence.

A guided request's life:

1. The router checks its ``Guide`` (``check_guide``: the schema, regex, grammar or
   choices must parse) and refuses a bad one with a message naming the field.
2. A rank that gets it (``add_request``, or a KV import on a decode rank) asks
   ``GrammarBook.request(guide)``: compiling for this tokenizer runs on the book's
   worker thread, or is found in its cache. The request waits off the scheduler until
   the grammar is ready (``Engine``); the other requests step on.
3. When ready, the sequence gets a matcher that has accepted its answer so far
   (``GrammarBook.matcher``): a moved, imported, forked or recomputed sequence goes on
   where its answer is. ``so_status`` becomes 1 (active).
4. Each step, a guided row's logits get its matcher's token bitmask
   (``engine/logits_controls.py``) before the other controls, temperature and top-p: an
   unguided row pays nothing. EOS is allowed only where the grammar may end.
5. Every token the scheduler appends passes ``accept``; a rejected one sets ``so_status``
   to -1 and the request ends with ``structured_output_failed`` (spec S30's words).
6. A finished sequence drops its matcher (``Engine``).

xgrammar is imported on first use, so the engine loads without it; a guided request to
a rank without it fails with a message saying how to install it.
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from pdserve.scheduler.sampling_params import Guide

COMPILE_NICE = 10  # compiles run behind the steps of the same rank
MAX_CACHED_GRAMMARS = 256  # compiled grammars a rank keeps (least recently used go)
MAX_CHOICES = 256  # strings of a `choice` guide
INSTALL_HINT = ("structured output needs the xgrammar package: pip install xgrammar "
                "(pdserve's `make setup` installs it)")


def _xgrammar():
    try:
        import xgrammar  # lazy: optional (the grammar extra) and heavy; only guided requests
    except ImportError as exc:
        raise RuntimeError(INSTALL_HINT) from exc
    return xgrammar


def choice_grammar(spec: str) -> str:
    """The EBNF grammar of a ``choice`` guide's spec (a JSON list of strings)."""
    try:
        choices = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise ValueError(f"choice must be a JSON list of strings: {exc}") from None
    if not isinstance(choices, list) or not choices or not all(
            isinstance(c, str) and c for c in choices):
        raise ValueError("choice must be a non-empty list of non-empty strings")
    if len(choices) > MAX_CHOICES:
        raise ValueError(f"choice must hold at most {MAX_CHOICES} strings, got {len(choices)}")
    # json.dumps writes an EBNF string literal: quotes and backslashes escaped
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def _grammar_of(xgr, guide: Guide):
    """The xgrammar Grammar of a guide (no tokenizer needed); ValueError when it does
    not parse."""
    try:
        if guide.kind == "json":
            return xgr.Grammar.from_json_schema(guide.spec, any_whitespace=False)
        if guide.kind == "json_object":
            return xgr.Grammar.builtin_json_grammar()
        if guide.kind == "regex":
            return xgr.Grammar.from_regex(guide.spec)
        if guide.kind == "choice":
            return xgr.Grammar.from_ebnf(choice_grammar(guide.spec))
        return xgr.Grammar.from_ebnf(guide.spec)
    except (RuntimeError, TypeError) as exc:  # xgrammar's parse errors
        raise ValueError(_short(exc)) from None


def _short(exc: Exception) -> str:
    """xgrammar's message without its source-file prefix ("[time] file.cc:123: ")."""
    text = str(exc).strip()
    head, sep, rest = text.partition(": ")
    if sep and head.startswith("[") and ".cc:" in head:
        text = rest
    return text.splitlines()[0][:300] if text else type(exc).__name__


def check_guide(guide: Guide) -> None:
    """ValueError (the parser's reason) when the guide's spec does not parse."""
    if guide.kind == "json":
        try:
            schema = json.loads(guide.spec)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("the JSON schema must be an object")
    _grammar_of(_xgrammar(), guide)


class GrammarBook:
    """Compiles guides for one tokenizer, off the step loop, and keeps them (LRU)."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._compiler = None  # built on the worker thread by the first request
        self._pool: ThreadPoolExecutor | None = None
        self._compiled: OrderedDict[Guide, Future] = OrderedDict()
        self._lock = threading.Lock()

    def request(self, guide: Guide) -> Future:
        """The future of the guide's compiled grammar (done at once when cached)."""
        with self._lock:
            future = self._compiled.get(guide)
            if future is not None:
                self._compiled.move_to_end(guide)
                return future
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="pdserve-grammar",
                                                initializer=_lower_priority)
            future = self._pool.submit(self._compile, guide)
            self._compiled[guide] = future
            while len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
            return future

    def ready(self, guide: Guide) -> bool:
        return self.request(guide).done()

    def _compile(self, guide: Guide):
        xgr = _xgrammar()
        if self._compiler is None:
            self._compiler = xgr.GrammarCompiler(self._tokenizer_info(xgr), max_threads=1)
        return self._compiler.compile_grammar(_grammar_of(xgr, guide))

    def _tokenizer_info(self, xgr):
        # lazy: transformers is heavy; only compiling a grammar needs its tokenizer wrapper
        from transformers import PreTrainedTokenizerFast

        # transformers' wrapper lets xgrammar read the vocabulary's type (byte-level,
        # byte-fallback, raw) from the tokenizer itself, as it does for any HF model
        wrapped = PreTrainedTokenizerFast(tokenizer_object=self._tokenizer.backend)
        return xgr.TokenizerInfo.from_huggingface(
            wrapped, vocab_size=self._vocab_size,
            stop_token_ids=list(self._tokenizer.eos_token_ids) or None)

    def matcher(self, guide: Guide, answer: list[int]) -> tuple[Any, bool]:
        """A matcher for a ready guide that has accepted ``answer``; False when the
        answer does not fit the grammar (the matcher then holds its longest fitting
        prefix)."""
        xgr = _xgrammar()
        matcher = xgr.GrammarMatcher(self.request(guide).result(timeout=0))
        return matcher, all(matcher.accept_token(int(t)) for t in answer)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _lower_priority() -> None:
    """The compile thread yields the cores to the step loop (Linux: a thread's nice)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICE)
    except (AttributeError, OSError):  # not Linux, or not allowed: compile as it is
        pass

