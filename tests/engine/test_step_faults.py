"""Steps are transactions: an exception inside a step (model run, KV import, KV export)
ends exactly the sequences it took with "error" naming the cause, frees their blocks and
state slots, and leaves every other request and the engine itself working. A rank whose
steps keep failing gives up after a bounded number of tries (`fatal` in its poll)."""

from __future__ import annotations

import time

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.rank.fault_injection import FaultyEngineFactory, InjectedFault
from pdserve.rank.messages import AddRequest
from pdserve.scheduler.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _engine(model_dir: str, engine_type: str = "normal", **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=model_dir, engine_type=engine_type, block_size=4,
                                  num_kv_blocks=64, max_num_seqs=8, **kw))


def _run(engine: LLMEngine, limit: int = 200) -> dict:
    outs: dict[str, list] = {}
    for _ in range(limit):
        if not engine.has_work():
            break
        for o in engine.step().outputs:
            outs.setdefault(o.attempt, []).append(o)
    return outs


def _faulty(engine: LLMEngine, fail_runs: set[int]) -> None:
    execute, runs = engine._execute, [0]

    def faulty(sched_out):
        if not sched_out.is_empty:
            runs[0] += 1
            if runs[0] in fail_runs:
                raise InjectedFault(f"run {runs[0]}")
        return execute(sched_out)

    engine._execute = faulty


def test_a_failed_model_run_ends_its_rows_with_error_and_frees_everything(model_dirs):
    ref = _engine(model_dirs["llama"])
    ref.add_request("late", [9, 8, 7, 6], GREEDY)
    want = [t for o in _run(ref)["late"] for t in o.new_token_ids]

    engine = _engine(model_dirs["llama"])
    _faulty(engine, {2})  # the first decode step of a and b fails
    engine.add_request("a", [5, 6, 7], GREEDY)
    engine.add_request("b", [3, 4, 5, 6, 7], GREEDY)
    engine.step()  # prefill both (run 1)
    out = engine.step()  # run 2 raises inside
    ended = {o.attempt: o for o in out.outputs}
    assert set(ended) == {"a", "b"}
    for o in ended.values():
        assert o.finish_reason == "error" and o.step_failed and o.new_token_ids == []
        assert "InjectedFault" in o.error and "run 2" in o.error
    assert engine.num_failed_steps == 1
    engine.assert_drained()  # blocks and state slots are back, nothing registered
    # the engine goes on serving, with the same tokens as one that never failed
    engine.add_request("late", [9, 8, 7, 6], GREEDY)
    outs = _run(engine)
    assert [t for o in outs["late"] for t in o.new_token_ids] == want
    assert outs["late"][-1].finish_reason == "length"
    engine.assert_drained()


def test_a_failed_prompt_step_on_a_prompt_engine_hands_nothing_off(model_dirs):
    engine = _engine(model_dirs["llama"], "prompt")
    _faulty(engine, {1})
    engine.add_request("p", list(range(3, 40)), GREEDY)
    out = engine.step()
    assert out.handoffs == []
    assert [(o.attempt, o.finish_reason) for o in out.outputs] == [("p", "error")]
    engine.assert_drained()


def test_a_failed_kv_export_and_import_end_with_error_and_leak_nothing(model_dirs):
    prompt = _engine(model_dirs["llama"], "prompt")
    completion = _engine(model_dirs["llama"], "completion", stop_preempted_request=True)
    prompt.add_request("ok", list(range(3, 20)), GREEDY)
    payload = prompt.step().handoffs[0].payload

    def broken_export(*a, **k):
        raise RuntimeError("export broke")

    prompt.runner.kv_cache.export_into = broken_export
    prompt.add_request("x", list(range(3, 20)), GREEDY)
    out = prompt.step()
    assert out.handoffs == [] and out.outputs[0].finish_reason == "error"
    assert "KV export failed" in out.outputs[0].error
    prompt.assert_drained()

    def broken_import(*a, **k):
        raise RuntimeError("import broke")

    real_import = completion.runner.kv_cache.import_sequence
    completion.runner.kv_cache.import_sequence = broken_import
    completion.import_prefilled(payload)
    outs = _run(completion)
    assert outs["ok"][-1].finish_reason == "error" and "KV import failed" in outs["ok"][-1].error
    completion.assert_drained()
    completion.runner.kv_cache.import_sequence = real_import
    completion.import_prefilled(payload)  # the same attempt may now arrive again
    assert _run(completion)["ok"][-1].finish_reason == "length"
    completion.assert_drained()


def test_a_rank_whose_steps_keep_failing_gives_up(model_dirs):
    from pdserve.rank.engine_rank import EngineRank
    from pdserve.scheduler.votes import SingleRankCommunicator

    rank = EngineRank(dict(model_dir=model_dirs["llama"], block_size=4, num_kv_blocks=64),
                      engine_factory=FaultyEngineFactory(rate=1.0),
                      communicator_factory=lambda *a, **k: SingleRankCommunicator(),
                      kv_transport="in_process", max_failed_steps=3)
    try:
        rank.join_group(0, 1, None, 0, [])
        failures = []
        deadline = time.monotonic() + 30
        reply = None
        n = 0
        while time.monotonic() < deadline:
            if n < 6:
                assert rank.add_request(AddRequest(f"r.{n}", [5, 6, 7], GREEDY)).ok
                n += 1
            reply = rank.poll(0.2)
            failures += [o for s in reply.steps for o in s.outputs if o.step_failed]
            if reply.fatal:
                break
        assert reply is not None and reply.fatal, "the rank never gave up"
        assert "3 steps in a row failed" in reply.loop_error
        assert len(failures) >= 3 and all(o.finish_reason == "error" for o in failures)
        time.sleep(0.3)
        assert not rank.loop.running  # it stopped stepping
    finally:
        rank.shutdown()


@pytest.mark.parametrize("seed", [1, 2])
def test_seeded_draws_depend_on_the_position_so_a_moved_request_continues_exactly(
        model_dirs, seed):
    """A seeded request recomputed from its history (prompt + tokens so far, fewer
    tokens left) draws exactly the tokens it would have drawn where it was."""
    sp = SamplingParams(max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True)
    prompt = [5, 6, 7, 8, 9]
    whole = _engine(model_dirs["llama"])
    whole.add_request("w", prompt, sp)
    tokens = [t for o in _run(whole)["w"] for t in o.new_token_ids]
    assert len(tokens) == 12
    moved = _engine(model_dirs["llama"])
    moved.add_request("m", prompt + tokens[:5], SamplingParams(
        max_tokens=7, temperature=1.0, seed=seed, ignore_eos=True))
    assert [t for o in _run(moved)["m"] for t in o.new_token_ids] == tokens[5:]
