"""Soak: mixed load at a fixed rate for many minutes, a rank killed and a pool resized
every minute; per minute: requests sent, finished, lost, p99 TTFT / ITL, and each
process's resident memory (which must not grow minute over minute); per kill: the time
to the pool's re-formed group and to the first token of a request moved off the dead
rank.

    python bench/soak.py --minutes 10 --rate 4
    python bench/soak.py --minutes 2 --rate 2 --transport grpc

Runs an in-process router (embedded Ray, the built-in tiny model, 2 prefill + 2 decode
ranks). Requests are greedy with `ignore_eos`, so each one's tokens are checked against
the offline engine's (`wrong`). Each minute, at +20 s one rank is SIGKILLed (prefill and
decode in turn) and at +40 s the decode pool is resized (2 -> 3, then back). `lost`
counts requests that did not finish with their full output (an error, a broken stream,
a hang past the client deadline). The ranks' collective timeout is the service's
default unless `--collective-timeout` says otherwise. Writes JSON
(results/bench_soak.json by default).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.bench.chaos import MAX_TOKENS, PROMPTS, Reference, chaos_router_config
from pdserve.bench.harness import RouterHarness, start_embedded_ray
from pdserve.rank.messages import DEFAULT_COLLECTIVE_TIMEOUT_S
from pdserve.router.client import AsyncClient


@dataclass
class Minute:
    index: int
    sent: int = 0
    finished: int = 0
    lost: int = 0
    wrong: int = 0
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    rss_mib: dict[str, float] = field(default_factory=dict)  # process -> peak this minute

    def summary(self) -> dict:
        return {"minute": self.index, "sent": self.sent, "finished": self.finished,
                "lost": self.lost, "wrong": self.wrong,
                "p99_ttft_ms": _p99_ms(self.ttft_s), "p99_itl_ms": _p99_ms(self.itl_s),
                "events": self.events, "peak_rss_mib": self.rss_mib}


@dataclass
class Trace:
    """One request as its client saw it (time.monotonic())."""

    start: float
    token_times: list[float] = field(default_factory=list)
    moves: int = 0  # from the last response's timings


@dataclass
class Kill:
    """A SIGKILLed rank: when, and when its pool re-formed, a moved request's first
    token after the kill arrived, and the first request sent after the kill got its
    first token (None: not seen; a prefill rank often holds no request when killed)."""

    pool: str
    victim: str
    at: float
    reformed_at: float | None = None
    first_moved_token_at: float | None = None
    first_new_token_at: float | None = None

    def summary(self, start: float) -> dict:
        def ms(t: float | None) -> float | None:
            return None if t is None else round(1e3 * (t - self.at), 1)

        return {"pool": self.pool, "victim": self.victim, "at_s": round(self.at - start, 1),
                "reformed_ms": ms(self.reformed_at),
                "first_moved_token_ms": ms(self.first_moved_token_at),
                "first_new_token_ms": ms(self.first_new_token_at)}


def first_moved_token(kill: Kill, traces: list[Trace]) -> float | None:
    """The first token after the kill of a moved request that was in flight at the kill."""
    times = [t for tr in traces if tr.moves and tr.start <= kill.at
             and tr.token_times and tr.token_times[-1] > kill.at
             for t in tr.token_times if t > kill.at]
    return min(times, default=None)


def first_new_token(kill: Kill, traces: list[Trace]) -> float | None:
    """The first token of the requests sent after the kill."""
    return min((tr.token_times[0] for tr in traces if tr.start > kill.at and tr.token_times),
               default=None)


def _p99_ms(values: list[float]) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return round(1e3 * v[min(len(v) - 1, int(0.99 * len(v)))], 2)


def rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _processes(harness) -> dict[str, int]:
    """name -> pid: the router (with this load generator) and each live rank."""
    procs = {"router": os.getpid()}
    for name, pool in harness.service.pools.items():
        for r in pool.ranks:
            if r.state != "dead" and r.info is not None:
                procs[f"{name}-{r.uid}"] = r.info.pid
    return procs


async def _one(client, prompt: str, max_tokens: int, want: list[int], minute: Minute,
               timeout_s: float, trace: Trace) -> None:
    start = time.monotonic()
    last = None
    tokens: list[int] = []
    finish = ""
    try:
        async for msg in client.stream(prompt, max_tokens=max_tokens, temperature=0,
                                       ignore_eos=True, timeout=timeout_s):
            now = time.monotonic()
            trace.moves = max(trace.moves, msg.timings.moves)
            if msg.token_ids:
                trace.token_times.append(now)
                if last is None:
                    minute.ttft_s.append(now - start)
                else:
                    minute.itl_s.append(now - last)
                last = now
            tokens += msg.token_ids
            finish = msg.finish_reason or finish
    except Exception:
        finish = ""
    if finish == "length" and len(tokens) == max_tokens:
        minute.finished += 1
        if tokens != want[:max_tokens]:
            minute.wrong += 1
    else:
        minute.lost += 1


async def _load(harness, reference: Reference, minutes: list[Minute], traces: list[Trace],
                rate: float, seconds: float, seed: int, stop: threading.Event) -> None:
    rng = random.Random(seed)
    tasks: set[asyncio.Task] = set()  # the unfinished ones only: RSS is the router's
    async with AsyncClient(harness.address, timeout=120) as client:
        start = time.monotonic()
        next_at = start
        while time.monotonic() - start < seconds:
            next_at += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            minute = minutes[min(len(minutes) - 1, int((time.monotonic() - start) // 60))]
            prompt = rng.choice(PROMPTS)
            minute.sent += 1
            traces.append(Trace(time.monotonic()))
            task = asyncio.create_task(_one(
                client, prompt, rng.randint(8, MAX_TOKENS), reference.tokens(prompt),
                minute, 120.0, traces[-1]))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)
    stop.set()


def _note_reforms(harness, kills: list[Kill]) -> None:
    """Each kill's first re-formed group of its pool (read from the pool's formations)."""
    for kill in kills:
        if kill.reformed_at is None:
            formed = [f.at for f in harness.service.pools[kill.pool].formations if f.at > kill.at]
            kill.reformed_at = min(formed, default=None)


def _chaos(harness, minutes: list[Minute], kills: list[Kill], stop: threading.Event,
           start: float) -> None:
    """At +20 s of each minute SIGKILL a rank (prefill, decode in turn); at +40 s resize
    the decode pool (2 -> 3 -> 2 ...); sample memory every second."""
    done: set[tuple[int, str]] = set()
    while not stop.is_set():
        _note_reforms(harness, kills)
        elapsed = time.monotonic() - start
        m = min(len(minutes) - 1, int(elapsed // 60))
        minute = minutes[m]
        for name, pid in _processes(harness).items():
            rss = rss_mib(pid)
            if rss is not None:
                minute.rss_mib[name] = round(max(minute.rss_mib.get(name, 0.0), rss), 1)
        second = elapsed - 60 * m
        svc = harness.service
        if second >= 20 and (m, "kill") not in done:
            done.add((m, "kill"))
            pool = svc.pools["prefill" if m % 2 == 0 else "decode"]
            ready = pool.ready()
            if len(ready) > 1:
                victim = ready[0]
                try:
                    os.kill(victim.info.pid, signal.SIGKILL)
                    kills.append(Kill(pool.name, victim.name, time.monotonic()))
                    minute.events.append(f"SIGKILL {victim.name}")
                except ProcessLookupError:
                    pass
        if second >= 40 and (m, "scale") not in done:
            done.add((m, "scale"))
            pool = svc.pools["decode"]
            target = 3 if pool.target == 2 else 2
            try:
                harness.call(svc.scale("decode", target), timeout=180)
                minute.events.append(f"decode -> {target}")
            except Exception as exc:
                minute.events.append(f"decode -> {target} failed: {exc}")
        stop.wait(1.0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--rate", type=float, default=4.0, help="requests per second (Poisson)")
    p.add_argument("--transport", default="ray", choices=("ray", "grpc"))
    p.add_argument("--fault-rate", type=float, default=0.0,
                   help="probability that a rank's model run raises")
    p.add_argument("--collective-timeout", type=float, default=DEFAULT_COLLECTIVE_TIMEOUT_S,
                   help="seconds a rank waits in a vote for a hung peer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="model folder (default: the built-in tiny)")
    p.add_argument("--result-file", default="results/bench_soak.json")
    args = p.parse_args(argv)

    model = start_embedded_ray(args.model)  # before ray is imported: it binds loopback then
    # lazy: ray after start_embedded_ray: Ray reads its loopback settings at import
    import ray
    reference = Reference(model)
    harness = RouterHarness(chaos_router_config(model, args.transport,
                                                fault_rate=args.fault_rate,
                                                collective_timeout_s=args.collective_timeout))
    seconds = 60.0 * args.minutes
    minutes = [Minute(i + 1) for i in range(max(1, int(-(-seconds // 60))))]
    traces: list[Trace] = []
    kills: list[Kill] = []
    stop = threading.Event()
    start = time.monotonic()
    chaos = threading.Thread(target=_chaos, args=(harness, minutes, kills, stop, start),
                             daemon=True)
    chaos.start()
    try:
        asyncio.run(_load(harness, reference, minutes, traces, args.rate, seconds, args.seed,
                          stop))
    finally:
        stop.set()
        chaos.join(200)
        _note_reforms(harness, kills)
        harness.wait_drained(60.0)
        leaks = harness.drained_errors() if len(harness.service.tracker) == 0 else \
            [f"the router still holds {len(harness.service.tracker)} requests"]
        harness.close()
        ray.shutdown()
    rows = [m.summary() for m in minutes]
    print(f"{'min':>3} {'sent':>5} {'done':>5} {'lost':>4} {'wrong':>5} {'p99 TTFT ms':>11} "
          f"{'p99 ITL ms':>10}  router MiB  max rank MiB  events")
    for r in rows:
        ranks = [v for k, v in r["peak_rss_mib"].items() if k != "router"]
        print(f"{r['minute']:>3} {r['sent']:>5} {r['finished']:>5} {r['lost']:>4} "
              f"{r['wrong']:>5} {r['p99_ttft_ms'] or 0:>11.1f} {r['p99_itl_ms'] or 0:>10.1f}  "
              f"{r['peak_rss_mib'].get('router', 0):>10.0f}  {max(ranks, default=0):>12.0f}  "
              f"{'; '.join(r['events'])}")
    for kill in kills:
        kill.first_moved_token_at = first_moved_token(kill, traces)
        kill.first_new_token_at = first_new_token(kill, traces)
    events = [k.summary(start) for k in kills]
    for e in events:
        print(f"kill {e['victim']} at {e['at_s']:.0f} s: group re-formed after "
              f"{e['reformed_ms']} ms; first token of a moved request after "
              f"{e['first_moved_token_ms']} ms, of a new one after {e['first_new_token_ms']} ms")
    totals = {k: sum(r[k] for r in rows) for k in ("sent", "finished", "lost", "wrong")}
    print(f"total: {totals}; leaks after the run: {leaks or 'none'}")
    out = Path(args.result_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "totals": totals, "leaks": leaks,
                               "minutes": rows, "kills": events}, indent=2))
    print(f"wrote {out}")
    return 0 if totals["lost"] == 0 and totals["wrong"] == 0 and not leaks else 1


if __name__ == "__main__":
    sys.exit(main())
