"""The planner's decisions: pure, on snapshots (signals.py) with explicit time.

No asyncio, no Ray, no clock: ``Planner.decide(signals)`` takes the snapshot's own
``at`` as "now", so a recorded trace of snapshots replays exactly (tests/planner/).
The loop (loop.py) applies what it returns and reports back failures (``failed``).

How a pool is judged, each look (one pool at a time; prefill and decode are
independent, each with its own objective):

- Samples count only from ranks that are ready and past ``warmup_s`` when the sample
  was taken, and only those taken since the pool last changed (a resize, a failed
  resize; the planner's first look counts as one): the new size is judged on what it
  did itself, and a rank in its first steps (cold caches, first allocations) cannot
  ask for more. Fewer than ``min_samples`` never make a breach.
- prefill: TTFT at ``percentile`` above ``slo_ttft`` is a breach; so is the prompt
  tokens waiting per prefill rank rising on each of ``QUEUE_GROWTH_TICKS`` looks (to at
  least twice its first value), unless TTFT is well under the objective.
- decode: inter-token latency at ``percentile`` above ``slo_itl`` is a breach; so is a
  warm decode rank preempting sequences (its KV is short). A TTFT breach never grows
  decode and an ITL breach never grows prefill.

What it does with that:

- A pool being resized (by the planner or a person) or re-formed is left alone: the
  ranks it is starting, placed or still waiting for Ray, are pending capacity.
- A pool outside [min, max] is brought to the nearest bound at once.
- After any change a pool is left alone for ``cooldown_s``.
- Breach: one more rank, never past the maximum; but not while the router is idle
  (nothing in flight, every queue empty): the window's samples then describe a load
  that has gone, and a rank started for it would serve nobody.
- Idle (no request in the router, every queue empty) for a whole ``cooldown_s``: both
  pools go straight to their minima.
- Hysteresis: one rank less only when the latency is under ``SCALE_DOWN_BELOW`` of
  its objective (or nothing was measured), its queues are empty and (decode) the ranks
  that stay have room for the KV in use.
- A scale-up whose new ranks could not start (Ray could not place them, or they
  failed to load) leaves the pool at what is placed: it is held there, with the reason,
  for ``backoff_s`` before the planner asks for more again.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pdserve.planner.latency_window import LatencySample, percentile
from pdserve.planner.signals import PoolSignals, Signals

# Hysteresis: shrink only well under the objective, so a size that just meets it stays.
SCALE_DOWN_BELOW = 0.5
# Decode shrinks only if the ranks that stay would use at most this share of their KV.
KV_HEADROOM = 0.8
# Looks in a row the prompt queue per rank must rise to count as growing: one or two
# rises are noise; a queue that rises every look means arrivals outpace the prefills.
QUEUE_GROWTH_TICKS = 4
POOLS = ("prefill", "decode")


@dataclass(frozen=True)
class PolicyConfig:
    """The planner's settings, in seconds; defined and defaulted in RouterConfig."""

    slo_ttft_s: float
    slo_itl_s: float
    percentile: float
    bounds: dict[str, tuple[int, int]]  # pool -> (min, max)
    cooldown_s: float
    warmup_s: float
    min_samples: int
    backoff_s: float

    @classmethod
    def from_router_config(cls, c) -> PolicyConfig:
        return cls(slo_ttft_s=c.slo_ttft_ms / 1e3, slo_itl_s=c.slo_itl_ms / 1e3,
                   percentile=c.slo_percentile,
                   bounds={"prefill": (c.min_prefill, c.max_prefill),
                           "decode": (c.min_decode, c.max_decode)},
                   cooldown_s=c.planner_cooldown_s, warmup_s=c.planner_warmup_s,
                   min_samples=c.planner_min_samples, backoff_s=c.planner_backoff_s)


@dataclass(frozen=True)
class Decision:
    pool: str
    from_replicas: int
    to_replicas: int
    reason: str

    @property
    def direction(self) -> str:
        return "up" if self.to_replicas > self.from_replicas else "down"


@dataclass(frozen=True)
class Judgement:
    """One pool's latency against its objective, on the samples that count."""

    num_samples: int
    value_s: float | None  # the percentile (None: no sample counts)
    breach: bool           # enough samples, and above the objective
    low: bool              # under SCALE_DOWN_BELOW of it (or nothing measured)


@dataclass
class _PoolMemory:
    target: int | None = None        # the target seen last look
    changed_at: float = float("-inf")
    backoff_until: float = float("-inf")
    ceiling: int = 0                 # while backing off: the size that is placed
    hold_reason: str = ""
    queue: deque = field(default_factory=lambda: deque(maxlen=QUEUE_GROWTH_TICKS))
    preemptions: dict[int, int] = field(default_factory=dict)  # rank uid -> last count


class Planner:
    """Decides pool sizes from snapshots; its state is what it remembers of past looks."""

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config
        self._memory = {name: _PoolMemory() for name in POOLS}
        self._idle_since: float | None = None
        # For status: why each pool is as it is, and the last judgement of each.
        self.notes: dict[str, str] = {name: "" for name in POOLS}
        self.judgements: dict[str, Judgement] = {}

    # -- the loop's entry points ------------------------------------------------------

    def decide(self, s: Signals) -> list[Decision]:
        """At most one decision per pool for the snapshot ``s`` (time: ``s.at``)."""
        self._track_idle(s)
        decisions = []
        for name in POOLS:
            pool = s.pools.get(name)
            if pool is None:
                continue
            mem = self._memory[name]
            if pool.resizing or pool.target != mem.target:
                self._changed(mem, s.at)  # the new size is judged from now on
                mem.target = pool.target
            pressure, calm = (self._prefill_case if name == "prefill"
                              else self._decode_case)(s, pool, mem)
            decision = self._decide_pool(s.at, pool, mem, pressure, calm)
            if decision is not None:
                self._changed(mem, s.at)
                self.notes[name] = ""
                decisions.append(decision)
        return decisions

    def failed(self, decision: Decision, at: float, error: str, could_not_start: bool) -> None:
        """The loop could not apply ``decision`` (at ``at``). ``could_not_start``: new
        ranks did not start (Ray could not place them, or they failed to load): the pool
        is held at what is placed for ``backoff_s``. Else: the usual cooldown."""
        mem = self._memory[decision.pool]
        self._changed(mem, at)
        if could_not_start and decision.to_replicas > decision.from_replicas:
            mem.ceiling = decision.from_replicas
            mem.backoff_until = at + self.config.backoff_s
            mem.hold_reason = (f"held at {decision.from_replicas}: {decision.to_replicas} "
                               f"ranks could not start ({error})")

    def held(self, pool: str, at: float) -> str:
        """Why ``pool`` may not grow past what is placed at ``at`` ("" when it may)."""
        mem = self._memory[pool]
        return mem.hold_reason if at < mem.backoff_until else ""

    # -- per pool ------------------------------------------------------------------

    def _decide_pool(self, at: float, pool: PoolSignals, mem: _PoolMemory,
                     pressure: str, calm: str) -> Decision | None:
        name, n = pool.name, pool.target
        low, high = self.config.bounds[name]
        note = self.notes
        if pool.resizing:
            note[name] = f"resize to {n} in flight: its pending ranks count as capacity"
            return None
        if n > high:
            return Decision(name, n, high, f"above the maximum {high}")
        if n < low:
            return self._grow(at, pool, mem, low, f"below the minimum {low}")
        left = mem.changed_at + self.config.cooldown_s - at
        if left > 0:
            note[name] = f"cooling down ({left:.0f}s left)"
            return None
        if self._idle_since is not None:
            return self._when_idle(at, name, n, low, pressure)
        if pressure:
            if n >= high:
                note[name] = f"at its maximum {high}: {pressure}"
                return None
            return self._grow(at, pool, mem, n + 1, pressure)
        if calm and n > low:
            return Decision(name, n, n - 1, calm)
        note[name] = ""
        return None

    def _when_idle(self, at: float, name: str, n: int, low: int,
                   pressure: str) -> Decision | None:
        """An idle service goes back to the minimum after a cooldown of idleness, by this
        rule alone: nothing grows (the samples are of a load that has gone: a new rank
        would serve nobody) and nothing steps down by one meanwhile."""
        idle_s = at - self._idle_since
        if n > low and idle_s >= self.config.cooldown_s:
            return Decision(name, n, low, f"idle for {idle_s:.0f}s: back to the minimum")
        if pressure:
            self.notes[name] = f"idle now, so not growing on: {pressure}"
        elif n > low:
            self.notes[name] = (f"idle for {idle_s:.0f}s: back to the minimum after "
                                f"{self.config.cooldown_s:.0f}s")
        else:
            self.notes[name] = ""
        return None

    def _grow(self, at: float, pool: PoolSignals, mem: _PoolMemory, to: int,
              why: str) -> Decision | None:
        if at < mem.backoff_until and to > mem.ceiling:
            left = mem.backoff_until - at
            self.notes[pool.name] = f"{mem.hold_reason}; no retry for {left:.0f}s ({why})"
            return None
        return Decision(pool.name, pool.target, to, why)

    def _prefill_case(self, s: Signals, pool: PoolSignals, mem: _PoolMemory
                      ) -> tuple[str, str]:
        """(why it needs a rank more, or ""; why it can do with one less, or "")."""
        c = self.config
        j = self.judgements["prefill"] = self._judge(s.ttft, pool, mem, c.slo_ttft_s)
        mem.queue.append(pool.waiting_prompt_tokens_per_rank)
        q = list(mem.queue)
        growing = (len(q) == QUEUE_GROWTH_TICKS and all(q[i + 1] > q[i] for i in range(len(q) - 1))
                   and q[-1] >= 2 * q[0])
        if j.breach:
            return (f"TTFT p{c.percentile:g} {_ms(j.value_s)} > objective "
                    f"{_ms(c.slo_ttft_s)} ({j.num_samples} samples)"), ""
        if growing and not (j.low and j.num_samples):
            return (f"prompt tokens waiting per prefill rank rose {len(q) - 1} looks in a "
                    f"row ({' -> '.join(f'{v:.0f}' for v in q)})"), ""
        if j.low and pool.queues_empty:
            return "", (f"{_measured('TTFT', j, c)} and no prompt waiting")
        return "", ""

    def _decode_case(self, s: Signals, pool: PoolSignals, mem: _PoolMemory
                     ) -> tuple[str, str]:
        c = self.config
        j = self.judgements["decode"] = self._judge(s.itl, pool, mem, c.slo_itl_s)
        preempted = self._new_preemptions(s.at, pool, mem)
        if j.breach:
            return (f"ITL p{c.percentile:g} {_ms(j.value_s)} > objective "
                    f"{_ms(c.slo_itl_s)} ({j.num_samples} samples)"), ""
        if preempted:
            return f"decode ranks preempted {preempted} sequences (KV is short)", ""
        ready = pool.ready
        if j.low and pool.queues_empty and len(ready) > 1:
            usage = sum(r.kv_usage for r in ready) / (len(ready) - 1)
            if usage <= KV_HEADROOM:
                return "", (f"{_measured('ITL', j, c)}, no request waiting and the ranks "
                            f"left would use {100 * usage:.0f}% of their KV")
        return "", ""

    def _judge(self, samples: tuple[LatencySample, ...], pool: PoolSignals,
               mem: _PoolMemory, objective_s: float) -> Judgement:
        c = self.config
        values = []
        for x in samples:
            rank = pool.rank(x.rank_uid) if x.pool == pool.name else None
            if x.at >= mem.changed_at and rank is not None and rank.warm(x.at, c.warmup_s):
                values.append(x.seconds)
        value = percentile(values, c.percentile)
        if len(values) >= c.min_samples:
            return Judgement(len(values), value, value > objective_s,
                             value < SCALE_DOWN_BELOW * objective_s)
        # too few to judge a breach; calm only if every one of them is well under
        return Judgement(len(values), value, False,
                         all(v < SCALE_DOWN_BELOW * objective_s for v in values))

    def _new_preemptions(self, at: float, pool: PoolSignals, mem: _PoolMemory) -> int:
        """Sequences warm ranks preempted since the last look (a rank's first look only
        records its counter)."""
        new, seen = 0, {}
        for r in pool.ranks:
            seen[r.uid] = r.num_preemptions
            last = mem.preemptions.get(r.uid)
            if last is not None and r.warm(at, self.config.warmup_s):
                new += max(0, r.num_preemptions - last)
        mem.preemptions = seen
        return new

    def _changed(self, mem: _PoolMemory, at: float) -> None:
        mem.changed_at = at
        mem.queue.clear()

    def _track_idle(self, s: Signals) -> None:
        idle = s.num_inflight == 0 and all(p.queues_empty for p in s.pools.values())
        if not idle:
            self._idle_since = None
        elif self._idle_since is None:
            self._idle_since = s.at


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.0f} ms"


def _measured(what: str, j: Judgement, c: PolicyConfig) -> str:
    if not j.num_samples:
        return f"no recent {what} sample"
    return (f"{what} p{c.percentile:g} {_ms(j.value_s)} < {100 * SCALE_DOWN_BELOW:.0f}% of "
            "the objective")
