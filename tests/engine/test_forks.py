"""n > 1 through forks (spec S34): the choices of one prompt share one prefill.

A request with forks runs its prompt once; when the prompt completes, every choice
draws its first token from the same logits (choice i with seed + i) and the forks
share the prompt's KV, copying only the partial last block and the state slot. A
PROMPT engine hands all choices off in one payload that a COMPLETION engine imports
once. Each choice equals an independent request with its own settings, token for
token, and every path (abort before or after the fork, a first token that ends a
choice, a failed step) ends each choice once and frees everything."""

from __future__ import annotations

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.kv.payload import KVPayload
from pdserve.scheduler.sampling_params import SamplingParams

PROMPT = [1, 327, 399, 81, 10, 90, 320, 55, 7, 1234, 77]  # 11 tokens: a partial last block


def engine(model_dir, engine_type="normal", **kw):
    kw.setdefault("block_size", 4)
    kw.setdefault("num_kv_blocks", 96)
    kw.setdefault("max_num_seqs", 8)
    return LLMEngine(EngineConfig(model_dir=model_dir, engine_type=engine_type, **kw))


def run(eng, limit=800):
    """Drain: tokens and finish reason by request id, handoffs, prompt steps run."""
    tokens: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    handoffs, prompt_steps = [], 0
    for _ in range(limit):
        if not eng.has_work():
            return tokens, finish, handoffs, prompt_steps
        step = eng.step()
        prompt_steps += step.kind == "prompt" and step.num_rows > 0
        for out in step.outputs:
            tokens.setdefault(out.attempt, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                assert out.attempt not in finish, f"{out.attempt} finished twice"
                finish[out.attempt] = out.finish_reason
        handoffs += step.handoffs
    raise AssertionError("engine did not drain")


def choices(sampling: SamplingParams, n: int):
    return [(f"c{i}", sampling.for_choice(i)) for i in range(1, n)]


def independent(model_dir, sampling: SamplingParams, n: int) -> dict[str, list[int]]:
    """Each choice as a request of its own (seed + i), one engine each."""
    want = {}
    for i in range(n):
        eng = engine(model_dir)
        eng.add_request("x", PROMPT, sampling.for_choice(i))
        toks, _, _, _ = run(eng)
        want["c0" if i == 0 else f"c{i}"] = toks["x"]
    return want


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=1.0, top_k=50, seed=7, ignore_eos=True)


@pytest.mark.parametrize("variant", ["llama", "mistral-swa"])
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_normal_engine_prefills_once_and_each_choice_equals_its_own_request(
        model_dirs, variant, sampling):
    model_dir = model_dirs[variant]
    eng = engine(model_dir)
    eng.add_request("c0", PROMPT, sampling, forks=choices(sampling, 4))
    tokens, finish, _, prompt_steps = run(eng)
    assert prompt_steps == 1  # the prompt ran once for the four choices
    assert finish == {f"c{i}": "length" for i in range(4)}
    assert tokens == independent(model_dir, sampling, 4)
    if sampling.seed is not None:  # seed + i: the choices differ
        assert len({tuple(t) for t in tokens.values()}) == 4
    eng.assert_drained()


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_one_payload_carries_every_choice_and_the_decode_side_forks_it(model_dirs, sampling):
    model_dir = model_dirs["mistral-swa"]
    prefill = engine(model_dir, "prompt")
    prefill.add_request("c0", PROMPT, sampling, forks=choices(sampling, 4))
    tokens, finish, handoffs, prompt_steps = run(prefill)
    prefill.assert_drained()
    assert prompt_steps == 1 and len(handoffs) == 1 and not finish
    handoff = handoffs[0]
    payload = KVPayload.from_bytes(handoff.payload)
    assert [f.attempt for f in payload.forks] == ["c1", "c2", "c3"]
    first = {"c0": handoff.first_token_id} | {f.attempt: f.first_token_id
                                               for f in handoff.forks}
    decode = engine(model_dir, "completion")
    decode.import_prefilled(handoff.payload)
    tokens, finish, _, _ = run(decode)
    decode.assert_drained()
    assert finish == {f"c{i}": "length" for i in range(4)}
    got = {rid: [first[rid]] + toks for rid, toks in tokens.items()}
    assert got == independent(model_dir, sampling, 4)


def test_first_tokens_that_end_every_choice_hand_nothing_off(model_dirs):
    prefill = engine(model_dirs["llama"], "prompt")
    one = SamplingParams(max_tokens=1, temperature=1.0, seed=3)
    prefill.add_request("c0", PROMPT, one, forks=choices(one, 3))
    tokens, finish, handoffs, _ = run(prefill)
    assert handoffs == []
    assert finish == {"c0": "length", "c1": "length", "c2": "length"}
    assert all(len(t) == 1 for t in tokens.values())
    prefill.assert_drained()


def test_the_lead_ending_at_its_first_token_leaves_the_forks_to_go_on(model_dirs):
    """The lead stops at once (its first token is a stop token); the forks, whose
    settings do not stop there, leave in one payload led by the first of them."""
    model_dir = model_dirs["llama"]
    probe = engine(model_dir, "prompt")
    probe.add_request("p", PROMPT, GREEDY)
    first = run(probe)[2][0].first_token_id
    lead = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(first,))
    prefill = engine(model_dir, "prompt")
    prefill.add_request("c0", PROMPT, lead, forks=[("c1", GREEDY), ("c2", GREEDY)])
    tokens, finish, handoffs, _ = run(prefill)
    assert finish == {"c0": "stop"} and tokens == {"c0": [first]}
    assert len(handoffs) == 1 and handoffs[0].attempt == "c1"
    assert [f.attempt for f in handoffs[0].forks] == ["c2"]
    prefill.assert_drained()
    decode = engine(model_dir, "completion")
    decode.import_prefilled(handoffs[0].payload)
    tokens, finish, _, _ = run(decode)
    assert finish == {"c1": "length", "c2": "length"} and tokens["c1"] == tokens["c2"]
    decode.assert_drained()


def test_aborts_before_the_fork_end_each_choice_once(model_dirs):
    eng = engine(model_dirs["llama"], max_num_batched_tokens=4, max_num_seqs=4,
                 chunked_prefill=True)
    eng.add_request("c0", PROMPT, GREEDY, forks=choices(GREEDY, 3))
    eng.add_request("d0", PROMPT, GREEDY, forks=[("d1", GREEDY)])
    eng.step()  # a first chunk: no fork yet
    assert eng.abort("c2")  # a fork not made yet
    assert eng.abort("d0")  # a lead whose prompt has not completed: its fork ends too
    tokens, finish, _, _ = run(eng)
    assert finish == {"c0": "length", "c1": "length", "c2": "abort", "d0": "abort",
                      "d1": "abort"}
    assert tokens["c0"] == tokens["c1"] and tokens["c2"] == []
    eng.assert_drained()


def test_aborting_a_queued_imports_lead_hands_the_payload_to_its_fork(model_dirs):
    model_dir = model_dirs["llama"]
    prefill = engine(model_dir, "prompt")
    prefill.add_request("c0", PROMPT, GREEDY, forks=choices(GREEDY, 3))
    handoff = run(prefill)[2][0]
    decode = engine(model_dir, "completion")
    decode.import_prefilled(handoff.payload)
    assert decode.abort("c0") and decode.abort("c2")  # still queued: nothing ran
    tokens, finish, _, _ = run(decode)
    assert finish == {"c0": "abort", "c1": "length", "c2": "abort"}
    assert len(tokens["c1"]) == GREEDY.max_tokens - 1  # the first came with the hand-off
    decode.assert_drained()


def test_a_failed_prompt_step_fails_every_choice_for_a_move(model_dirs):
    eng = engine(model_dirs["llama"])
    eng.add_request("c0", PROMPT, GREEDY, forks=choices(GREEDY, 3))

    def boom(rows):
        raise RuntimeError("device lost")

    eng.runner.execute_with_logprobs = boom
    step = eng.step()
    ended = {o.attempt: (o.finish_reason, o.step_failed) for o in step.outputs}
    assert ended == {rid: ("error", True) for rid in ("c0", "c1", "c2")}
    eng.assert_drained()


def test_no_room_for_a_forks_copies_recomputes_it(model_dirs):
    """Blocks run out exactly at the fork: the fork that cannot get its own copies is
    recomputed from its history (S30) and still equals its own request."""
    model_dir = model_dirs["llama"]
    # 11 prompt tokens in blocks of 4: 3 blocks, the last partial; 4 usable blocks
    # leave room for one fork's copy, none for the second's
    eng = engine(model_dir, num_kv_blocks=5, max_num_seqs=4, stop_preempted_request=False)
    short = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    four = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    eng.add_request("c0", PROMPT, short, forks=[("c1", four), ("c2", four)])
    tokens, finish, _, prompt_steps = run(eng)
    assert finish == {"c0": "length", "c1": "length", "c2": "length"}
    assert prompt_steps >= 2  # the second fork recomputed (preemptions may add more)
    assert tokens["c1"] == tokens["c2"] == independent(model_dir, four, 1)["c0"]
    eng.assert_drained()


def test_an_attempt_is_in_one_place_and_its_abort_reaches_that_place_once(model_dirs):
    """An attempt waits in one place (engine/attempts.py) and one abort ends it there: a
    second abort changes nothing, the id stays taken until its end is reported, and an
    id this engine never held is not aborted."""
    model_dir = model_dirs["llama"]
    eng = engine(model_dir, max_num_batched_tokens=4, max_num_seqs=4, chunked_prefill=True)
    assert not eng.abort("c0")  # never held here
    eng.add_request("c0", PROMPT, GREEDY, forks=[("c1", GREEDY)])
    eng.step()  # a first chunk: c0 in the scheduler, c1 a fork not made yet
    assert [eng.attempts.get(a).place.name for a in ("c0", "c1")] == ["SCHEDULER", "FORK"]
    assert eng.abort("c1") and eng.abort("c1")
    assert eng.attempts.get("c1").place.name == "ENDED"
    with pytest.raises(ValueError, match="already in flight"):
        eng.add_request("c1", PROMPT, GREEDY)
    tokens, finish, _, _ = run(eng)
    assert finish == {"c0": "length", "c1": "abort"} and tokens["c1"] == []
    eng.assert_drained()
    eng.add_request("c1", PROMPT, GREEDY)  # reported: free again
    assert run(eng)[1] == {"c1": "length"}
    prefill = engine(model_dir, "prompt")
    prefill.add_request("q0", PROMPT, GREEDY, forks=[("q1", GREEDY), ("q2", GREEDY)])
    decode = engine(model_dir, "completion")
    decode.import_prefilled(run(prefill)[2][0].payload)
    assert decode.abort("q1") and decode.abort("q1")
    assert run(decode)[1] == {"q0": "length", "q1": "abort", "q2": "length"}
    decode.assert_drained()
