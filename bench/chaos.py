"""Seeded chaos scenarios against a live router, and the invariants every one must keep.

    python bench/chaos.py --scenarios 300                 # 150 per transport, counts as JSON
    python bench/chaos.py --scenarios 50 --transports grpc --seed 7

A scenario (`make_scenario(seed)`) mixes greedy requests that run to the end, cancel
mid-stream, are aborted by label, hit a short client deadline, or reuse the label of a
request just cancelled, with at most one cluster event: a SIGKILL of a prefill or a
decode rank, or a `ScalePool` of a pool down and back up under a 0.5 s client deadline.
Ranks also raise inside steps at a small seeded rate (`FaultyEngineFactory`).

After each scenario (`check_invariants`):
- every request ended exactly once for its client (one finish, or the client's own
  cancel / deadline), none hung;
- every token a client saw is the offline engine's greedy token at that position (no
  token twice, none lost, none from another request);
- the router holds no request state, no payload ticket (so no Ray object is kept
  alive by it) and no KV stream, every rank has all its blocks and state slots free
  (no partial import of streamed KV either) and no KV payload
  left, no rank is draining, and the pools are back at size.
The test suite runs some of these (`tests/chaos/`); this tool runs many more.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc

from pdserve.bench.harness import RouterHarness, start_embedded_ray
from pdserve.rank.fault_injection import FaultyEngineFactory
from pdserve.router.client import AsyncClient, build_request
from pdserve.router.config import PoolConfig, RouterConfig
from pdserve.scheduler.sampling_params import SamplingParams

PROMPTS = (
    "the quick brown fox", "def add(x, y):", "once upon a time", "import numpy as np",
    "the river runs", "hello world", "a b c d e f g", "SELECT * FROM users WHERE",
    "In the beginning", "for i in range(10):", "The capital of France is", "1, 2, 3, 4,",
)
MAX_TOKENS = 40
# Every fourth request sends a long version of its prompt (40-230 tokens): the prefill
# ranks take 64 tokens a step (chaos_router_config), so it streams its KV in chunks to
# its decode rank while it computes, and kills and resizes land mid-stream too.
LONG_EVERY = 4
LONG_REPEATS = 10


def long_prompt(prompt: str) -> str:
    return " ".join([prompt] * LONG_REPEATS)
ACTIONS = ("complete", "complete", "complete", "cancel", "abort", "deadline", "reuse")
EVENTS = ("none", "none", "kill_prefill", "kill_decode", "scale_decode", "scale_prefill")


@dataclass
class RequestPlan:
    index: int
    prompt: str
    max_tokens: int
    action: str  # complete | cancel | abort | deadline | reuse (of the previous cancel)
    label: str = ""
    after_messages: int = 1  # cancel / abort after this many messages
    start_s: float = 0.0
    deadline_s: float = 60.0


@dataclass
class ScenarioPlan:
    seed: int
    requests: list[RequestPlan]
    event: str = "none"
    event_at_s: float = 0.3


def make_scenario(seed: int, *, min_requests: int = 4, max_requests: int = 10,
                  events: tuple[str, ...] = EVENTS) -> ScenarioPlan:
    rng = random.Random(seed)
    plans: list[RequestPlan] = []
    last_cancel: RequestPlan | None = None
    for i in range(rng.randint(min_requests, max_requests)):
        action = rng.choice(ACTIONS)
        if action == "reuse" and last_cancel is None:
            action = "complete"
        prompt = rng.choice(PROMPTS)
        if i % LONG_EVERY == LONG_EVERY - 1:
            prompt = long_prompt(prompt)
        plan = RequestPlan(i, prompt, rng.randint(4, MAX_TOKENS), action,
                           start_s=round(rng.uniform(0.0, 0.6), 3),
                           after_messages=rng.randint(1, 4))
        if action in ("cancel", "abort") or rng.random() < 0.3:
            plan.label = f"s{seed}-r{i}"
        if action == "deadline":
            plan.deadline_s = round(rng.uniform(0.2, 1.5), 3)
        if action == "reuse":
            plan.label = last_cancel.label  # starts the moment that stream is cancelled
        if action == "cancel":
            last_cancel = plan
        plans.append(plan)
    return ScenarioPlan(seed, plans, rng.choice(events), round(rng.uniform(0.1, 0.8), 3))


@dataclass
class RequestOutcome:
    index: int
    action: str
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = ""
    num_finishes: int = 0
    rpc_error: str = ""
    error: str = ""
    hung: bool = False
    retries: int = 0  # ALREADY_EXISTS answers before a reused label was free


@dataclass
class ScenarioResult:
    seed: int
    transport: str
    event: str
    num_requests: int
    seconds: float
    lost: int = 0          # ended without a finish, not by the client's own doing
    duplicated: int = 0    # more than one finish, or a token seen twice / out of place
    wrong: int = 0         # a token that is not the offline engine's
    hung: int = 0          # a complete request that did not end within its deadline
    errors: int = 0        # finished with "error"
    leaked: int = 0        # ranks holding blocks, slots, payloads; router state left
    moves: int = 0         # attempts the router restarted elsewhere (what the chaos caused)
    rank_failures: int = 0
    label_retries: int = 0  # ALREADY_EXISTS before a just-cancelled label was free
    chunks_streamed: int = 0  # KV chunks that reached a decode rank ahead of their hand-off
    direct_handoffs: int = 0  # hand-offs a prefill rank had its decode rank import itself
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.lost or self.duplicated or self.wrong or self.hung or self.errors
                    or self.leaked)


class Reference:
    """The offline engine's greedy tokens (ignore_eos) for each prompt, computed once."""

    def __init__(self, model_dir: str) -> None:
        # lazy: engine.llm imports torch; only the reference run needs it
        from pdserve.engine.llm import LLM

        self.llm = LLM(model_dir, mode="normal")
        self._tokens: dict[str, list[int]] = {}

    def tokens(self, prompt: str) -> list[int]:
        if prompt not in self._tokens:
            sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
            prompts = [*PROMPTS, *map(long_prompt, PROMPTS)]
            for p, out in zip(prompts, self.llm.generate(prompts, sp, use_tqdm=False),
                              strict=True):
                self._tokens[p] = list(out.token_ids)
        return self._tokens[prompt]


async def _run_request(client, plan: RequestPlan, outcome: RequestOutcome,
                       cancelled: dict[int, asyncio.Event]) -> None:
    request = build_request(plan.prompt, max_tokens=plan.max_tokens, temperature=0.0,
                            ignore_eos=True, request_id=plan.label)
    try:
        for _ in range(250):  # a reused label is free once the router saw the cancel
            call = client._stub.Generate(request, timeout=plan.deadline_s)
            try:
                await _read(client, call, plan, outcome)
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.ALREADY_EXISTS and plan.action == "reuse":
                    outcome.retries += 1
                    await asyncio.sleep(0.02)
                    continue
                outcome.rpc_error = exc.code().name
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and plan.action != "deadline":
                    outcome.hung = True
                return
            finally:
                call.cancel()
        outcome.rpc_error = "ALREADY_EXISTS"
    finally:
        if plan.index in cancelled:
            cancelled[plan.index].set()


async def _read(client, call, plan: RequestPlan, outcome: RequestOutcome) -> None:
    messages = 0
    async for msg in call:
        messages += 1
        if outcome.num_finishes:
            outcome.num_finishes += 1  # anything after a finish is a duplicate
        outcome.tokens.extend(msg.token_ids)
        if msg.finish_reason:
            outcome.num_finishes += 1
            outcome.finish_reason = msg.finish_reason
            outcome.error = msg.error
        elif plan.action == "abort" and messages == plan.after_messages:
            await client.abort(plan.label)
        elif plan.action == "cancel" and messages >= plan.after_messages:
            return  # the caller cancels the call


async def _event(harness: Any, plan: ScenarioPlan, log: list[str], victims: list) -> None:
    if plan.event == "none":
        return
    await asyncio.sleep(plan.event_at_s)
    svc = harness.service
    if plan.event.startswith("kill_"):
        pool = svc.pools[plan.event.removeprefix("kill_")]
        ready = pool.ready()
        if len(ready) < 2:
            return
        victim = random.Random(plan.seed).choice(ready)
        log.append(f"SIGKILL {victim.name} (pid {victim.info.pid})")
        victims.append(victim)
        try:
            os.kill(victim.info.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    elif plan.event.startswith("scale_"):
        name = plan.event.removeprefix("scale_")
        async with AsyncClient(harness.address, timeout=0.5) as client:
            try:  # the deadline passes mid-drain: the pool operation must finish anyway
                await client.scale(name, 1)
            except grpc.aio.AioRpcError as exc:
                log.append(f"ScalePool({name}, 1): {exc.code().name}")


async def run_scenario(harness: Any, reference: Reference, plan: ScenarioPlan,
                       transport: str, sizes: dict[str, int], *,
                       drain_timeout_s: float = 60.0) -> ScenarioResult:
    started = time.monotonic()
    svc = harness.service
    moves, failures, chunks = svc.num_moves, svc.num_rank_failures, svc.num_kv_chunks_streamed
    direct = svc.num_direct_handoffs
    outcomes = [RequestOutcome(p.index, p.action) for p in plan.requests]
    cancelled: dict[int, asyncio.Event] = {}
    previous_cancel = None
    waits_for: dict[int, int] = {}
    for p in plan.requests:
        if p.action == "cancel":
            previous_cancel = p.index
            cancelled[p.index] = asyncio.Event()
        elif p.action == "reuse" and previous_cancel is not None:
            waits_for[p.index] = previous_cancel
    log: list[str] = []
    victims: list = []

    async with AsyncClient(harness.address, timeout=60) as client:
        async def one(p: RequestPlan) -> None:
            if p.index in waits_for:
                await cancelled[waits_for[p.index]].wait()
            else:
                await asyncio.sleep(p.start_s)
            await _run_request(client, p, outcomes[p.index], cancelled)

        event = asyncio.ensure_future(_event(harness, plan, log, victims))
        await asyncio.gather(*(one(p) for p in plan.requests))
        await event
    result = ScenarioResult(plan.seed, transport, plan.event, len(plan.requests),
                            time.monotonic() - started)
    _check_outcomes(plan, outcomes, reference, result)
    await asyncio.to_thread(restore_and_check, harness, sizes, result, drain_timeout_s, victims)
    result.problems[:0] = log if not result.ok else []
    result.seconds = time.monotonic() - started
    result.moves = svc.num_moves - moves
    result.rank_failures = svc.num_rank_failures - failures
    result.chunks_streamed = svc.num_kv_chunks_streamed - chunks
    result.direct_handoffs = svc.num_direct_handoffs - direct
    result.label_retries = sum(o.retries for o in outcomes)
    return result


def _check_outcomes(plan: ScenarioPlan, outcomes: list[RequestOutcome], reference: Reference,
                    result: ScenarioResult) -> None:
    for p, o in zip(plan.requests, outcomes, strict=True):
        want = reference.tokens(p.prompt)[: p.max_tokens]
        where = f"request {p.index} ({p.action}, label {p.label!r})"
        if o.num_finishes > 1:
            result.duplicated += 1
            result.problems.append(f"{where}: {o.num_finishes} finishes")
        if o.tokens != want[: len(o.tokens)]:
            if len(o.tokens) > len(want) or sorted(o.tokens) != sorted(want[: len(o.tokens)]):
                result.wrong += 1
            else:
                result.duplicated += 1
            result.problems.append(f"{where}: tokens {o.tokens} are not {want[:len(o.tokens)]}")
        if o.hung:
            result.hung += 1
            result.problems.append(f"{where}: no finish before its {p.deadline_s}s deadline")
        if o.finish_reason == "error":
            result.errors += 1
            result.problems.append(f"{where}: error: {o.error}")
        ended_by_client = (p.action == "cancel" or o.rpc_error == "DEADLINE_EXCEEDED")
        if not o.num_finishes and not ended_by_client:
            result.lost += 1
            result.problems.append(f"{where}: ended without a finish ({o.rpc_error or 'no error'})")
        if o.finish_reason in ("length", "stop") and o.tokens != want:
            result.lost += 1
            result.problems.append(f"{where}: finished {o.finish_reason} after "
                                   f"{len(o.tokens)} of {len(want)} tokens")
        if p.action in ("complete", "reuse") and o.num_finishes and o.finish_reason != "length":
            result.problems.append(f"{where}: finished {o.finish_reason}: {o.error}")
            result.lost += o.finish_reason != "error"


def restore_and_check(harness: Any, sizes: dict[str, int], result: ScenarioResult,
                      timeout_s: float, victims: list = ()) -> None:
    """Wait for every pool operation to end (a killed rank seen dead and replaced),
    bring the pools back to `sizes`, then check that nothing is left anywhere."""
    svc = harness.service
    deadline = time.monotonic() + timeout_s
    harness.call(_restore_pools(svc, sizes, result, deadline, victims), timeout=timeout_s + 30)
    stats = harness.wait_drained(max(5.0, deadline - time.monotonic()))
    if len(svc.tracker):
        _leaked(result, f"the router still holds {len(svc.tracker)} requests")
    for name, ranks in stats.items():
        _check_drained_pool(name, ranks, sizes, result)
    for err in harness.drained_errors():
        _leaked(result, err)
    _check_router_released(svc, result)


def _leaked(result: ScenarioResult, problem: str) -> None:
    result.leaked += 1
    result.problems.append(problem)


async def _restore_pools(svc: Any, sizes: dict[str, int], result: ScenarioResult,
                         deadline: float, victims: list) -> None:
    while any(v.state != "dead" for v in victims) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    for name, pool in svc.pools.items():
        if pool.scaling is not None:
            await asyncio.wait([pool.scaling], timeout=max(1.0, deadline - time.monotonic()))
        while len(pool.ready()) != sizes[name] and time.monotonic() < deadline:
            if pool.lock.locked():  # a dead rank's replacement is on its way
                await asyncio.sleep(0.1)
                continue
            try:
                await svc.scale(name, sizes[name])
            except Exception as exc:
                result.problems.append(f"restoring {name} to {sizes[name]}: {exc}")
                await asyncio.sleep(0.5)


def _check_drained_pool(name: str, ranks: list[dict], sizes: dict[str, int],
                        result: ScenarioResult) -> None:
    """Every live rank of the pool ready with all its blocks free, as many as `sizes` says."""
    for r in ranks:
        if r["state"] == "dead":
            continue
        if r["state"] != "ready":
            _leaked(result, f"{name} rank {r['rank']} is {r['state']}")
        if r["num_free_blocks"] != r["num_total_blocks"]:
            _leaked(result, f"{name} rank {r['rank']}: {r['num_free_blocks']} of "
                            f"{r['num_total_blocks']} blocks free")
    live = [r for r in ranks if r["state"] == "ready"]
    if len(live) != sizes[name]:
        _leaked(result, f"{name} pool has {len(live)} ranks, not {sizes[name]}")


def _check_router_released(svc: Any, result: ScenarioResult) -> None:
    """No KV stream, hand-off or rank's in-flight request left at the router."""
    if svc.num_kv_streams:  # KV streamed ahead of a hand-off that never came
        _leaked(result, f"router still holds {svc.num_kv_streams} KV streams")
    if svc.num_handoffs_in_flight:  # each holds a payload's ticket (a Ray object ref)
        _leaked(result, f"{svc.num_handoffs_in_flight} hand-offs still hold payloads")
    for pool in svc.pools.values():
        for r in pool.ranks:
            if r.state != "dead" and (r.inflight or r.exports):
                _leaked(result, f"{r.name}: router still counts {sorted(r.inflight)} "
                                f"in flight, {sorted(r.exports)} exported")


def chaos_router_config(model_dir: str, transport: str, *, fault_rate: float = 0.01,
                        seed: int = 0, prefill: int = 2, decode: int = 2,
                        collective_timeout_s: float = 3.0):
    # 64 prefill tokens a step: a long prompt streams its KV ahead in chunks
    engine = dict(num_kv_blocks=256, max_num_seqs=32, block_size=16, max_num_batched_tokens=64)
    return RouterConfig(
        model_dir=model_dir, port=0, metrics_port=0, kv_transport=transport,
        prefill=PoolConfig("prefill", replicas=prefill, num_cpus=0.25, resources={"prefill": 1},
                           engine=engine),
        decode=PoolConfig("decode", replicas=decode, num_cpus=0.25, resources={"decode": 1},
                          engine=engine),
        engine_factory=FaultyEngineFactory(rate=fault_rate, seed=seed) if fault_rate else None,
        collective_timeout_s=collective_timeout_s, drain_timeout_s=5.0, rank_wait_s=30.0,
        handoff_timeout_s=20.0, rank_unresponsive_s=30.0, rank_call_timeout_s=10.0,
        max_attempts=12)


def summarize(results: list[ScenarioResult]) -> dict:
    keys = ("lost", "duplicated", "wrong", "hung", "errors", "leaked")
    out: dict[str, Any] = {"scenarios": len(results),
                           "requests": sum(r.num_requests for r in results),
                           "failed_scenarios": sum(not r.ok for r in results)}
    out.update({k: sum(getattr(r, k) for r in results)
                for k in (*keys, "moves", "rank_failures", "label_retries", "chunks_streamed",
                          "direct_handoffs")})
    by_event: dict[str, int] = {}
    for r in results:
        by_event[r.event] = by_event.get(r.event, 0) + 1
    out["events"] = by_event
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenarios", type=int, default=50,
                   help="scenarios in all, split evenly across the transports")
    p.add_argument("--transports", default="ray,grpc")
    p.add_argument("--seed", type=int, default=1000, help="first scenario seed")
    p.add_argument("--fault-rate", type=float, default=0.01,
                   help="probability that a rank's model run raises")
    p.add_argument("--model", default=None, help="model folder (default: the built-in tiny)")
    p.add_argument("--result-file", default="results/bench_chaos.json")
    args = p.parse_args(argv)

    model = start_embedded_ray(args.model)  # before ray is imported: it binds loopback then
    # lazy: ray after start_embedded_ray: Ray reads its loopback settings at import
    import ray
    reference = Reference(model)
    results: list[ScenarioResult] = []
    transports = args.transports.split(",")
    for t, transport in enumerate(transports):
        harness = RouterHarness(chaos_router_config(model, transport,
                                                    fault_rate=args.fault_rate))
        sizes = {name: pool.target for name, pool in harness.service.pools.items()}
        count = args.scenarios // len(transports) + (t < args.scenarios % len(transports))
        try:
            for i in range(count):
                plan = make_scenario(args.seed + i)
                r = harness.call(run_scenario(harness, reference, plan, transport, sizes),
                                 timeout=300)
                results.append(r)
                status = "ok" if r.ok else "FAILED: " + "; ".join(r.problems[:3])
                print(f"[{transport} {i + 1}/{count}] seed {plan.seed} "
                      f"{plan.event:13s} {r.num_requests:2d} requests {r.moves:2d} moves "
                      f"{r.seconds:5.1f}s {status}",
                      flush=True)
        finally:
            harness.close()
    summary = summarize(results)
    print(json.dumps(summary, indent=2))
    out = Path(args.result_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"summary": summary, "args": vars(args),
                               "scenarios": [asdict(r) for r in results]}, indent=2))
    print(f"wrote {out}")
    ray.shutdown()
    return 0 if summary["failed_scenarios"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
