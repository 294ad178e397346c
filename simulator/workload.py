"""What the simulated clients send: ``pdserve bench serve``'s datasets and arrival
process (``bench/serve.py build_requests``, ``bench/datasets.py arrival_offsets``), or
a recorded trace.

Requests are built lazily, ``BATCH`` at a time, so a million of them never sit in
memory at once: batch k is ``build_requests`` with ``--num-prompts`` the batch's size
and ``--seed`` seed + k. A run of at most ``BATCH`` requests therefore sends exactly
the requests ``bench serve`` sends with the same arguments; arrival times are always
exactly bench serve's (one ``arrival_offsets`` call for the whole run).

A trace is JSON: a list of ``{"arrival_s", "prompt_tokens", "output_tokens"}`` (or
of ``[arrival_s, prompt_tokens, output_tokens]``); its prompts are seeded random ids
of those lengths (no prefix is shared).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from pdserve.bench.datasets import FIRST_PROMPT_ID, arrival_offsets
from pdserve.bench.serve import build_requests

TINY_VOCAB = 4096  # the built-in model's: a workload's token ids when no model is named

BATCH = 10_000


class WorkItem(NamedTuple):  # not a frozen dataclass: a million are made, 2.5x faster
    index: int
    arrival_s: float
    prompt: list[int]
    output_len: int
    kind: str = ""
    after: int | None = None  # index of the request that must finish before this is sent


@dataclass
class Workload:
    num_requests: int
    arrivals: list[float]
    batches: object  # callable: k -> list of (prompt ids, output_len, kind, after)
    request_rate: float = math.inf

    def __iter__(self) -> Iterator[WorkItem]:
        index = 0
        k = 0
        while index < self.num_requests:
            for prompt, out_len, kind, after in self.batches(k):
                if index >= self.num_requests:
                    return
                yield WorkItem(index, self.arrivals[index], prompt, out_len, kind, after)
                index += 1
            k += 1


def from_bench_args(args: argparse.Namespace, batch: int = BATCH) -> Workload:
    """The workload ``bench serve`` would send with these dataset and load arguments."""
    if args.dataset_name == "random" and args.prompt_format != "ids":
        raise SystemExit("error: simulate takes token-id prompts (--prompt-format ids)")
    n = args.num_prompts
    if n < 1:
        raise SystemExit("error: --num-prompts must be >= 1")

    def batches(k: int) -> list[tuple]:
        size = min(batch, n - k * batch)
        sub = argparse.Namespace(**{**vars(args), "num_prompts": size, "seed": args.seed + k,
                                    "prompt_format": "ids"})
        first = k * batch
        return [(list(r.prompt), r.output_len, r.kind,
                 None if r.after is None else first + r.after) for r in build_requests(sub)]

    arrivals = arrival_offsets(n, args.request_rate, args.burstiness, args.seed)
    return Workload(n, arrivals, batches, args.request_rate)


def from_trace(path: str | Path, vocab_size: int, seed: int = 0) -> Workload:
    """A recorded trace (see the module doc), sorted by arrival."""
    rows = json.loads(Path(path).read_text())
    items = []
    for i, row in enumerate(rows):
        if isinstance(row, dict):
            row = (row["arrival_s"], row["prompt_tokens"], row["output_tokens"])
        arrival, prompt_len, out_len = float(row[0]), int(row[1]), int(row[2])
        if arrival < 0 or prompt_len < 1 or out_len < 1:
            raise ValueError(f"trace row {i}: arrival_s >= 0, prompt_tokens >= 1 and "
                             f"output_tokens >= 1, got {row!r}")
        items.append((arrival, prompt_len, out_len))
    items.sort(key=lambda t: t[0])
    n = len(items)
    if not n:
        raise ValueError(f"trace {path} holds no requests")

    def batches(k: int) -> list[tuple]:
        rng = np.random.default_rng(seed + k)
        part = items[k * BATCH:(k + 1) * BATCH]
        return [(rng.integers(FIRST_PROMPT_ID, vocab_size, size=p).tolist(), o, "trace", None)
                for _, p, o in part]

    duration = items[-1][0] - items[0][0]
    return Workload(n, [t[0] for t in items], batches,
                    (n - 1) / duration if duration > 0 else math.inf)


def workload_of(args: argparse.Namespace, request_rate: float | None = None) -> Workload:
    """The workload ``pdserve simulate``'s arguments ask for (a trace, or bench serve's
    dataset and load), at ``request_rate`` when given."""
    if request_rate is not None:
        args = argparse.Namespace(**{**vars(args), "request_rate": request_rate})
    if args.trace:
        return from_trace(args.trace, args.vocab_size or TINY_VOCAB, args.seed)
    if args.vocab_size is None and args.model is None:
        args = argparse.Namespace(**{**vars(args), "vocab_size": TINY_VOCAB})
    return from_bench_args(args)
