"""Step-kind votes of NORMAL engines (spec S7-S11) across real gloo processes.

Each rank drives its own Scheduler with a TorchDistCommunicator; no model runs: every
sampled token is a fixed fake token fed back through process_outputs. The ranks must
take the same kind of step at every step (PROMPT and EMPTY_PROMPT are one kind).
Small intervals (ALL points every 5 decode steps, ANY points every 3) reach the vote
points quickly: ALL points are decode_step 0, 5, 10, 20, ...; ANY points 3, 6, 9, 12,
15 (15 and 30 coincide with an ALL point and count as ANY points).
"""

from __future__ import annotations

import random

import pytest

from pdserve.scheduler import (
    EngineType,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    Sequence,
)

TOKEN = 11  # every sampled token (no end-of-sequence id: requests stop by max_tokens)
ALL_EVERY, ANY_EVERY = 5, 3

BASE_CONFIG = dict(
    block_size=4, num_blocks=64, num_state_slots=16, max_model_len=256, max_num_seqs=8,
    max_num_batched_tokens=256, prefill_attempt_interval=ALL_EVERY,
    prefill_any_attempt_interval=ANY_EVERY, chunked_prefill=False, enable_prefix_caching=False,
)


# ---- what runs on each rank -------------------------------------------------------


def _wants_prefill(sched: Scheduler) -> bool:
    """S8, from the scheduler's public state: cache usage <= watermark, schedulable head."""
    return (sched.cache_usage <= sched.config.prefill_watermark and len(sched.waiting) > 0
            and sched.waiting[0].schedulable)


def drive(ctx, config: dict, arrivals: dict, steps: int, world_size: int | None = None,
          drain: bool = False, max_steps: int = 3000) -> dict:
    """Run ``steps`` scheduler steps on this rank (then, with ``drain``, until every rank
    is idle), adding ``arrivals[rank]`` = [(step, attempt, prompt_len, max_tokens)].

    Returns the per-step trace as tuples (step, decode_step before, wanted prefill,
    kind, rows as (attempt, q, sample), vote all-reduces made, decode_step after),
    the finish reason of every request, and the drained-pool check.
    """
    ws = ctx.world_size if world_size is None else world_size
    comm = ctx.communicator("votes", world_size=ws)
    done = ctx.communicator("done", world_size=ws) if drain else None
    sched = Scheduler(SchedulerConfig(**config), EngineType.NORMAL, communicator=comm)
    mine = sorted(arrivals.get(ctx.rank, []))
    trace, reasons = [], {}
    nxt = 0
    t = 0
    try:
        while True:
            while nxt < len(mine) and mine[nxt][0] <= t:
                _, rid, plen, max_tokens = mine[nxt]
                sched.add(Sequence(rid, [1 + (i % 7) for i in range(plen)],
                                   SamplingParams(max_tokens=max_tokens, temperature=0.0),
                                   arrival_time=float(t)))
                nxt += 1
            d, want, calls = sched.decode_step, _wants_prefill(sched), comm.calls
            out = sched.schedule()
            votes = comm.calls - calls
            rows = [(r.attempt, r.query_len, r.sample) for r in out.scheduled]
            res = sched.process_outputs(out, [TOKEN if r.sample else None for r in out.scheduled])
            for seq in res.finished:
                assert seq.attempt not in reasons, f"{seq.attempt} finished twice"
                reasons[seq.attempt] = seq.finish_reason
            trace.append((t, d, want, out.kind.name, rows, votes, sched.decode_step))
            t += 1
            if t < steps:
                continue
            if done is None or t >= max_steps:
                break
            idle = nxt == len(mine) and not sched.has_unfinished()
            if done.all_reduce_min(1 if idle else 0) == 1:
                break
        drained = None
        if drain:
            try:
                sched.assert_drained()
                drained = "ok"
            except AssertionError as e:
                drained = str(e)
        return {"trace": trace, "reasons": reasons, "drained": drained,
                "preemptions": sched.num_preemptions, "vote_calls": comm.calls}
    finally:
        comm.close()
        if done is not None:
            done.close()


# ---- checks in the test process -----------------------------------------------------


def point_of(d: int) -> str | None:
    if d != 0 and d % ANY_EVERY == 0:
        return "ANY"  # an ANY point wins when both coincide (S7)
    if d % ALL_EVERY == 0:
        return "ALL"
    return None


def step_class(kind: str) -> str:
    return "DECODE" if kind == "DECODE" else "PROMPT"


def check_lockstep(results: list[dict]) -> dict:
    """Every rank took the same kind of step at every step, as the votes dictate.

    Returns counts of the vote situations seen, so a scenario can show what it covered.
    """
    traces = [r["trace"] for r in results]
    n = len(traces[0])
    assert all(len(tr) == n for tr in traces), [len(tr) for tr in traces]
    seen = dict.fromkeys(("any_split", "all_refused", "all_agree", "all_empty_fallback",
                          "empty_prompt_wanting", "empty_prompt_idle", "prompt"), 0)
    for i in range(n):
        steps = [tr[i] for tr in traces]
        t, d = steps[0][0], steps[0][1]
        where = f"step {t}: {steps}"
        assert all(s[0] == t and s[1] == d for s in steps), f"decode_step differs at {where}"
        kinds = [s[3] for s in steps]
        wants = [s[2] for s in steps]
        classes = {step_class(k) for k in kinds}
        assert len(classes) == 1, f"ranks disagree on the kind at {where}"
        _check_votes(steps, point_of(d), classes.pop(), where, seen)
        for s, want in zip(steps, wants, strict=True):
            _check_rank_step(s, want, kinds, d, where, seen)
    return seen


def _check_votes(steps: list, point: str | None, cls: str, where: str, seen: dict) -> None:
    """The vote all-reduces the ranks made at one step, and the kind of step they chose."""
    kinds = [s[3] for s in steps]
    wants = [s[2] for s in steps]
    if point is None:
        assert kinds == ["DECODE"] * len(kinds), where
        assert all(s[5] == 0 for s in steps), f"a vote off the points at {where}"
        return
    tried = any(wants) if point == "ANY" else all(wants)
    assert all(s[5] == (2 if tried else 1) for s in steps), f"vote count at {where}"
    if not tried:
        assert cls == "DECODE", where
        if point == "ALL" and any(wants):
            seen["all_refused"] += 1
        return
    if point == "ANY" and not all(wants):
        seen["any_split"] += 1
    if point == "ALL":
        seen["all_agree"] += 1
    if cls == "DECODE":
        seen["all_empty_fallback"] += 1
        assert any(wants), where


def _check_rank_step(s: tuple, want: bool, kinds: list[str], d: int, where: str,
                     seen: dict) -> None:
    """One rank's step, against what it wanted and what its peers did."""
    kind, rows, after = s[3], s[4], s[6]
    if kind == "PROMPT":
        assert want, f"a rank that did not want prefill prefilled at {where}"
        seen["prompt"] += 1
    if kind == "EMPTY_PROMPT":
        assert rows == [], where
        assert "PROMPT" in kinds, f"EMPTY_PROMPT with no peer prefilling at {where}"
        seen["empty_prompt_wanting" if want else "empty_prompt_idle"] += 1
    if kind == "DECODE":
        assert all(q == 1 for _, q, _ in rows), where
    # S11: a prompt step resets the counter, a decode step advances it.
    assert after == (d + 1 if kind == "DECODE" else 0), f"decode_step after {where}"


def kinds_by_rank(results: list[dict]) -> list[str]:
    short = {"PROMPT": "P", "DECODE": "D", "EMPTY_PROMPT": "E"}
    return ["".join(short[s[3]] for s in r["trace"]) for r in results]


# ---- hand-derived scenarios ----------------------------------------------------------


def test_two_ranks_disagree_at_any_and_all_points(rank_pool):
    # t0 both prefill (ALL point, both want). t2 rank 0 gets a1; at the ANY point
    # (t4, decode_step 3) it prefills alone while rank 1 runs an empty prompt step.
    # t5 rank 0 gets a2 at an ALL point (decode_step 0): rank 1 does not want, so both
    # decode; the next ANY point (t8) lets rank 0 prefill alone again.
    arrivals = {0: [(0, "a0", 4, 40), (2, "a1", 4, 40), (5, "a2", 4, 40)],
                1: [(0, "b0", 4, 40)]}
    out = rank_pool.run(drive, BASE_CONFIG, arrivals, 10, world_size=2, ranks=[0, 1])
    assert kinds_by_rank(out) == ["PDDDPDDDPD", "PDDDEDDDED"]
    assert [s[1] for s in out[0]["trace"]] == [0, 0, 1, 2, 3, 0, 1, 2, 3, 0]
    assert [s[5] for s in out[0]["trace"]] == [2, 1, 0, 0, 2, 1, 0, 0, 2, 1]
    assert [s[4] for s in out[0]["trace"] if s[3] == "PROMPT"] == [
        [("a0", 4, True)], [("a1", 4, True)], [("a2", 4, True)]]
    seen = check_lockstep(out)
    assert seen["any_split"] == 2 and seen["all_refused"] == 1
    assert seen["empty_prompt_idle"] == 2 and seen["all_empty_fallback"] == 0


def test_empty_attempt_runs_an_empty_prompt_step_and_all_empty_falls_back_to_decode(rank_pool):
    # max_num_seqs 1: a rank whose running list is full still *wants* prefill (S8 looks
    # only at cache usage and the head) but its pass selects nothing (S16).
    config = dict(BASE_CONFIG, max_num_seqs=1)
    arrivals = {0: [(0, "a0", 4, 3), (3, "a1", 4, 4), (5, "a2", 4, 40)],
                1: [(0, "b0", 4, 60), (0, "b1", 4, 60)]}
    out = rank_pool.run(drive, config, arrivals, 12, world_size=2, ranks=[0, 1])
    # t4 (ANY): both want; rank 0 selects a1, rank 1 is full -> EMPTY_PROMPT.
    # t5 (ALL) and t8 (ANY): both want, both passes are empty (rank 0's running still
    # holds a1, finished at t7 but swept only by the next decode pass) -> the group
    # decodes and decode_step keeps growing instead of resetting (S10).
    # t10 (ALL, decode_step 5): rank 0 selects a2; rank 1 is still full -> EMPTY_PROMPT.
    assert kinds_by_rank(out) == ["PDDDPDDDDDPD", "PDDDEDDDDDED"]
    assert [s[1] for s in out[0]["trace"]] == [0, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 0]
    assert [s[5] for s in out[1]["trace"]] == [2, 1, 0, 0, 2, 2, 0, 0, 2, 0, 2, 1]
    assert [s[2] for s in out[1]["trace"]][1:] == [True] * 11  # b1 waits behind b0 all along
    assert out[0]["reasons"] == {"a0": "length", "a1": "length"}
    seen = check_lockstep(out)
    assert seen["empty_prompt_wanting"] == 2 and seen["all_empty_fallback"] == 2


def test_head_waiting_for_blocks_runs_an_empty_prompt_step(rank_pool):
    # 10 usable blocks of 4. Rank 1 runs b0 (3 blocks, then 4) while b1 (36 positions,
    # 9 blocks) waits at its head: usage stays far under 0.9, so rank 1 wants prefill
    # at every point, but its pass stops at the LATER head (S14) and selects nothing.
    config = dict(BASE_CONFIG, num_blocks=11, max_model_len=64, max_num_batched_tokens=64)
    arrivals = {0: [(0, "a0", 4, 40), (2, "a1", 4, 40)],
                1: [(0, "b0", 12, 60), (0, "b1", 36, 60)]}
    out = rank_pool.run(drive, config, arrivals, 6, world_size=2, ranks=[0, 1])
    assert kinds_by_rank(out) == ["PDDDPD", "PDDDED"]
    assert [s[2] for s in out[1]["trace"]] == [True] * 6
    assert out[1]["trace"][0][4] == [("b0", 12, True)]  # b1 was LATER from the start
    seen = check_lockstep(out)
    assert seen["empty_prompt_wanting"] == 1 and seen["all_refused"] == 2  # t1, t5


def test_four_ranks_any_point_needs_one_wish_all_point_needs_every_wish(rank_pool):
    arrivals = {r: [(0, f"r{r}.0", 4, 40)] for r in range(4)}
    for r in (0, 1, 2):  # three of four want at the ALL point t1
        arrivals[r].append((1, f"r{r}.1", 4, 40))
    arrivals[3].append((5, "r3.1", 4, 40))  # one of four wants at the ALL point t5
    out = rank_pool.run(drive, BASE_CONFIG, arrivals, 10)
    assert kinds_by_rank(out) == ["PDDDPDDDED"] * 3 + ["PDDDEDDDPD"]
    seen = check_lockstep(out)
    assert seen["all_refused"] == 2 and seen["any_split"] == 2 and seen["all_agree"] == 1


# ---- uneven random load, many steps -------------------------------------------------


def random_arrivals(seed: int, rates: list[float], until: int, max_tokens: int = 20) -> dict:
    rng = random.Random(seed)
    arrivals: dict[int, list] = {r: [] for r in range(len(rates))}
    for t in range(until):
        for r, rate in enumerate(rates):
            if rng.random() < rate:
                arrivals[r].append(
                    (t, f"r{r}.t{t}", rng.randint(1, 40), rng.randint(1, max_tokens)))
    return arrivals


# Tight memory (23 usable blocks of 4 for prompts up to 40 and outputs up to 20), at
# most 3 running and 16-position chunks: passes come back empty for S14 (LATER), S16
# and S24 reasons, and decode preempts. Preempted requests stop (the engine-argument
# default): with recompute, a victim pushed in front of a partial prompt can leave two
# partial prompts holding > 90% of the blocks, after which no rank ever wants prefill
# again (S8) and the group decodes an empty running list forever; see
# test_recompute_load_keeps_lockstep_without_draining.
RANDOM_CONFIG = dict(
    BASE_CONFIG, num_blocks=24, num_state_slots=8, max_model_len=64, max_num_seqs=3,
    max_num_batched_tokens=16, chunked_prefill=True, stop_preempted_request=True,
)
SITUATIONS = ("any_split", "all_refused", "all_agree", "all_empty_fallback",
              "empty_prompt_wanting", "empty_prompt_idle", "prompt")


@pytest.mark.parametrize("rates, seed", [
    ([0.45, 0.05], 1),
    ([0.35, 0.35, 0.2, 0.05], 3),
], ids=["2ranks", "4ranks"])
def test_uneven_random_load_keeps_every_rank_in_lockstep(rank_pool, rates, seed):
    world = len(rates)
    arrivals = random_arrivals(seed, rates, until=150)
    out = rank_pool.run(drive, RANDOM_CONFIG, arrivals, 150, world_size=world,
                        ranks=list(range(world)), drain=True, timeout=90)
    seen = check_lockstep(out)
    steps = len(out[0]["trace"])
    assert 150 <= steps < 3000, "the group did not drain"
    for r, res in enumerate(out):
        assert res["drained"] == "ok", f"rank {r}: {res['drained']}"
        assert set(res["reasons"]) == {a[1] for a in arrivals[r]}, f"rank {r} lost requests"
    assert sum(res["preemptions"] for res in out) > 0
    # The load really produced each situation the votes must handle.
    for situation in SITUATIONS:
        assert seen[situation] > 0, (situation, seen)


def test_recompute_load_keeps_lockstep_without_draining(rank_pool):
    """Recompute preemption (stop_preempted_request off): lockstep holds for 300 steps.

    Not drained: this load reaches the state described above RANDOM_CONFIG, where the
    spec's own rules leave every rank decoding nothing (reported, not asserted here).
    """
    config = dict(RANDOM_CONFIG, stop_preempted_request=False)
    arrivals = random_arrivals(1, [0.45, 0.05], until=150)
    out = rank_pool.run(drive, config, arrivals, 300, world_size=2, ranks=[0, 1])
    check_lockstep(out)
    assert len(out[0]["trace"]) == 300 and out[0]["preemptions"] > 0
