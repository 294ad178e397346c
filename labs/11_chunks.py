"""Lab 11: does a smaller prompt chunk let short requests answer sooner?

Reproduces the three runs of the chapter's section 5.1 (scheduler-spec section 10):
one request's prompt, or a chunk of it, per step; a step of ``q`` positions lasts
``overhead + q``; requests that arrive at or before a step's end join ``waiting``
before an unfinished prompt is put back (at the front or at the back, depending on
the run); an idle scheduler jumps to the next arrival.

    python labs/11_chunks.py
    python labs/11_chunks.py --requests A:0:12,B:3:2,C:3:2 --budget 4 --overhead 1
    python labs/11_chunks.py --plot results/11_chunks.png

The output is printed and also written to ``results/11_chunks.txt``.
"""

from __future__ import annotations

import argparse
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_REQUESTS = "A:0:12,B:3:2,C:3:2"
RESULTS_FILE = Path("results") / "11_chunks.txt"


@dataclass(frozen=True)
class Request:
    name: str
    arrival: int
    positions: int


@dataclass(frozen=True)
class Step:
    start: int
    end: int
    name: str
    q: int
    waiting: tuple[str, ...]  # the queue after the step (arrivals joined, remainder put back)


@dataclass(frozen=True)
class Run:
    title: str
    steps: tuple[Step, ...]
    delays: dict[str, int]  # first-token time minus arrival, in request order

    @property
    def work(self) -> int:
        return sum(s.q for s in self.steps)

    @property
    def finish(self) -> int:
        return self.steps[-1].end if self.steps else 0


def _check_arguments(requests: list[Request], budget: int, overhead: int) -> None:
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    if overhead < 0:
        raise ValueError(f"overhead must be >= 0, got {overhead}")
    names = [r.name for r in requests]
    if len(set(names)) != len(names):
        raise ValueError(f"request names must be unique, got {names}")


@dataclass
class _Queue:
    """Requests yet to arrive (``pending``, by arrival), the names of those waiting for
    a step, and the time each finished its prompt."""

    pending: deque[Request]
    waiting: deque[str] = field(default_factory=deque)
    done_at: dict[str, int] = field(default_factory=dict)

    def admit(self, until: int) -> None:
        """Every request that arrived by ``until`` joins ``waiting``."""
        while self.pending and self.pending[0].arrival <= until:
            req = self.pending.popleft()
            if req.positions > 0:
                self.waiting.append(req.name)
            else:  # nothing to prefill: the first token is due on arrival
                self.done_at[req.name] = req.arrival

    def put_back(self, name: str, rotate: bool) -> None:
        """An unfinished prompt: behind the arrivals (``rotate``) or before them."""
        if rotate:
            self.waiting.append(name)
        else:
            self.waiting.appendleft(name)


def simulate(
    requests: list[Request], budget: int, overhead: int = 1, rotate: bool = False
) -> tuple[list[Step], dict[str, int]]:
    """Run the one-prompt-per-step scheduler; return its steps and first-token delays.

    ``budget`` caps the positions of one step; ``rotate`` puts an unfinished prompt at
    the back of ``waiting`` (behind the arrivals seen during its step) instead of the
    front. Pure: no printing, no clock.
    """
    _check_arguments(requests, budget, overhead)
    # Stable sort: requests arriving together keep the order they were given in.
    queue = _Queue(deque(sorted(requests, key=lambda r: r.arrival)))
    remaining = {r.name: r.positions for r in requests}
    arrival = {r.name: r.arrival for r in requests}
    steps: list[Step] = []
    now = min(0, queue.pending[0].arrival) if queue.pending else 0
    queue.admit(now)
    while queue.waiting or queue.pending:
        if not queue.waiting:  # idle: jump to the next arrival
            now = max(now, queue.pending[0].arrival)
            queue.admit(now)
            continue
        name = queue.waiting.popleft()
        q = min(budget, remaining[name])
        start, now = now, now + overhead + q
        remaining[name] -= q
        queue.admit(now)  # arrivals during this step come before a put-back continuation
        if remaining[name]:
            queue.put_back(name, rotate)
        else:
            queue.done_at[name] = now
        steps.append(Step(start, now, name, q, tuple(queue.waiting)))
    delays = {r.name: queue.done_at[r.name] - arrival[r.name] for r in requests}
    return steps, delays


def three_runs(requests: list[Request], budget: int = 4, overhead: int = 1) -> list[Run]:
    """The chapter's comparison: whole prompts FIFO, chunks at the front, chunks at the back."""
    whole = max((r.positions for r in requests), default=1) or 1
    runs = []
    for title, b, rotate in (
        (f"Whole prompts, FIFO (budget {whole})", whole, False),
        (f"Chunks, continuation at front (budget {budget})", budget, False),
        (f"Chunks, continuation at back (budget {budget})", budget, True),
    ):
        steps, delays = simulate(requests, b, overhead, rotate)
        runs.append(Run(title, tuple(steps), delays))
    return runs


def format_run(run: Run) -> list[str]:
    lines = [run.title]
    for s in run.steps:
        lines.append(f"  {s.start:2d}->{s.end:2d}: {s.name} q={s.q:2d} waiting={list(s.waiting)}")
    delays = ", ".join(f"{n}={d}" for n, d in run.delays.items())
    lines.append(f"  first-token delays: {delays}")
    lines.append(f"  work={run.work} positions; steps={len(run.steps)}; finish={run.finish}")
    return lines


def format_runs(runs: list[Run]) -> str:
    return "\n\n".join("\n".join(format_run(r)) for r in runs) + "\n"


def plot_runs(runs: list[Run], path: Path) -> None:
    """Draw each run as a timeline row; a bar per step, its width the assigned time."""
    # lazy: matplotlib is heavy; only --plot needs it
    import matplotlib

    matplotlib.use("Agg")
    # lazy: matplotlib is heavy; only --plot needs it (after use("Agg"))
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(s.name for r in runs for s in r.steps))
    cmap = plt.get_cmap("tab10")
    colour = {n: cmap(i % 10) for i, n in enumerate(names)}
    finish = max((r.finish for r in runs), default=1)
    fig, ax = plt.subplots(figsize=(max(8.0, 0.45 * finish), 1.1 * len(runs) + 1.2))
    for row, run in enumerate(runs):
        y = len(runs) - 1 - row  # first run on top
        for s in run.steps:
            ax.barh(y, s.end - s.start, left=s.start, height=0.6,
                    color=colour[s.name], edgecolor="black", linewidth=0.8)
            overhead = s.end - s.start - s.q
            if overhead > 0:  # the step's fixed cost, hatched at its start
                ax.barh(y, overhead, left=s.start, height=0.6, color="none",
                        edgecolor="black", hatch="//", linewidth=0.0)
            ax.text((s.start + max(overhead, 0) + s.end) / 2, y, f"{s.name} q={s.q}",
                    ha="center", va="center", fontsize=8)
    ax.set_yticks(range(len(runs)))
    ax.set_yticklabels([r.title for r in reversed(runs)], fontsize=8)
    ax.set_xlim(0, finish)
    ax.set_xlabel("time (assigned units; hatched: per-step overhead)")
    ax.set_title("One prompt per step: whole prompts vs chunks (continuation front/back)")
    ax.grid(axis="x", linestyle=":", linewidth=0.5)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_requests(text: str) -> list[Request]:
    """Parse ``NAME:ARRIVAL:POSITIONS,...``."""
    out = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        parts = item.split(":")
        if len(parts) != 3 or not parts[0]:
            raise ValueError(f"bad request {item!r}: expected NAME:ARRIVAL:POSITIONS")
        try:
            arrival, positions = int(parts[1]), int(parts[2])
        except ValueError:
            raise ValueError(f"bad request {item!r}: ARRIVAL and POSITIONS are integers") from None
        if arrival < 0 or positions < 1:
            raise ValueError(f"bad request {item!r}: ARRIVAL must be >= 0, POSITIONS >= 1")
        out.append(Request(parts[0], arrival, positions))
    if not out:
        raise ValueError("no requests given")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", default=DEFAULT_REQUESTS,
                    help=f"NAME:ARRIVAL:POSITIONS,... (default {DEFAULT_REQUESTS})")
    ap.add_argument("--budget", type=int, default=4,
                    help="positions per step in the chunked runs (default 4); "
                         "the whole-prompt run uses the largest prompt")
    ap.add_argument("--overhead", type=int, default=1, help="time units per step (default 1)")
    ap.add_argument("--plot", type=Path, default=None, help="also draw the runs to this PNG")
    ap.add_argument("--out", type=Path, default=RESULTS_FILE,
                    help=f"where to save the text (default {RESULTS_FILE})")
    args = ap.parse_args(argv)
    try:
        requests = parse_requests(args.requests)
        if args.budget < 1:
            raise ValueError(f"--budget must be >= 1, got {args.budget}")
        if args.overhead < 0:
            raise ValueError(f"--overhead must be >= 0, got {args.overhead}")
    except ValueError as e:
        ap.error(str(e))
    runs = three_runs(requests, args.budget, args.overhead)
    text = format_runs(runs)
    sys.stdout.write(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    print(f"Saved output · {args.out}", file=sys.stderr)  # the chapter's caption
    if args.plot is not None:
        plot_runs(runs, args.plot)
        print(f"Saved plot · {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
