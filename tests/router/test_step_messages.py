"""One set of step types from the engine to the router: an engine step becomes a
``StepReport`` in one place (the ``of`` constructors in rank/messages.py), and the
engine's ``EngineStats`` is the one stats type from the engine to ``RankState``."""

from __future__ import annotations

import dataclasses
import pickle
from types import SimpleNamespace

import pytest

from pdserve.engine.outputs import (
    EngineStats,
    HandedOffFork,
    HandOff,
    KVChunk,
    RequestOutput,
    StepOutputs,
    TokenLogprobs,
)
from pdserve.rank.messages import (
    HandedOffChoice,
    HandoffTicket,
    KVChunkTicket,
    PollReply,
    RankInfo,
    RankTimings,
    StepReport,
    TokenReport,
)
from pdserve.router.rank_handle import RankHandle
from pdserve.router.server import rank_message
from pdserve.rpc import router_pb2

LP = TokenLogprobs(-0.5, [3, 4], [-0.5, -1.5])


def test_a_step_becomes_one_report_with_every_field_carried():
    out = RequestOutput("r.1", [7, 8], finish_reason="stop", num_prompt_tokens=5,
                        num_output_tokens=4, error=None, step_failed=False,
                        new_logprobs=[LP, LP], num_cached_tokens=16)
    failed = RequestOutput("r.2", [], finish_reason="error", num_output_tokens=0,
                           error="boom", step_failed=True)
    fork = HandedOffFork("f.1", 9, LP)
    handoff = HandOff("p.1", 5, b"x" * 40, 12, first_token_logprobs=LP, forks=[fork],
                      num_cached_tokens=4, streamed_blocks=2, stream_of="p.1")
    chunk = KVChunk("p.1", "p.1/kv0", 0, 2, b"y" * 24)
    step = StepOutputs("prompt", [out, failed], [handoff], cache_events=[(True, b"h")],
                       kv_chunks=[chunk])

    timings = RankTimings(prefill_s=0.1)
    ticket = HandoffTicket.of(handoff, "loc", timings, direct_import="ref")
    assert ticket == HandoffTicket("p.1", 5, 12, 40, "loc", timings, first_token_logprobs=LP,
                                   forks=[HandedOffChoice("f.1", 9, LP)], num_cached_tokens=4,
                                   streamed_blocks=2, stream_of="p.1", direct_import="ref")
    assert [c.attempt for c in ticket.choices] == ["p.1", "f.1"]
    chunk_ticket = KVChunkTicket.of(chunk, "cloc")
    assert chunk_ticket == KVChunkTicket("p.1/kv0", "p.1", 0, 2, 24, "cloc")

    report = StepReport.of(step, [ticket], [chunk_ticket])
    assert report == StepReport("prompt", [
        TokenReport("r.1", [7, 8], 4, "stop", None, False, logprobs=[LP, LP],
                    num_cached_tokens=16),
        TokenReport("r.2", [], 0, "error", "boom", True)], [ticket], [(True, b"h")],
        [chunk_ticket])
    assert pickle.loads(pickle.dumps(report)) == report  # crosses Ray as it is


def test_a_missing_field_is_a_bug_not_a_default():
    partial = SimpleNamespace(attempt="r.1", new_token_ids=[1], num_output_tokens=1)
    with pytest.raises(AttributeError):
        TokenReport.of(partial)
    with pytest.raises(AttributeError):
        HandoffTicket.of(SimpleNamespace(attempt="p.1", first_token_id=1,
                                         num_prompt_tokens=3, payload=b"x"), "loc")


def _stats() -> EngineStats:
    """Every field a different value, so a field read as another shows."""
    values = {f.name: (f"t{i}" if f.type == "str" else [100 + i, i]
                       if f.type.startswith("list") else 100 + i)
              for i, f in enumerate(dataclasses.fields(EngineStats))}
    values["num_free_blocks"], values["num_total_blocks"] = 30, 120
    return EngineStats(**values)


def test_engine_stats_cross_ray_and_become_the_proto_in_one_place():
    st = _stats()
    reply = pickle.loads(pickle.dumps(PollReply([], st, 1)))
    assert reply.stats == st and reply.stats.kv_usage == pytest.approx(0.75)
    info = RankInfo("decode", "completion", 1, "node-a", "h", 64, 100, 2, 16, 999)
    handle = RankHandle("decode", None, 1, state="ready", rank=3, info=info, stats=reply.stats,
                        inflight={"a.1", "b.1"})
    msg = rank_message(handle)
    router_side = {"rank": 3, "actor_id": "", "node_id": "node-a", "state": "ready",
                   "num_inflight": 2}
    for field in router_pb2.RankState.DESCRIPTOR.fields:
        want = router_side.get(field.name, getattr(st, field.name, None))
        assert want is not None, f"RankState.{field.name} has no source"
        got = getattr(msg, field.name)
        got = list(got) if isinstance(want, list) else got
        assert got == pytest.approx(want), field.name


def test_a_rank_not_yet_heard_from():
    info = RankInfo("prefill", "prompt", 1, "n", "h", 64, 100, 2, 16, 77)
    msg = rank_message(RankHandle("prefill", None, 1, info=info))
    assert msg.state == "starting" and msg.num_total_blocks == 77  # from its RankInfo
    assert msg.kv_usage == 0.0 and msg.num_waiting == 0
    assert EngineStats().kv_usage == 0.0
