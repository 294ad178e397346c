"""KV export/import between a PROMPT and a COMPLETION engine, and the COMPLETION
engine's behaviour when its pool runs out."""

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine, NoCapacityError
from pdserve.engine.kv.payload import KVPayload, KVPayloadError
from pdserve.scheduler.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def engine(model_dir, engine_type, **kw):
    kw.setdefault("block_size", 4)
    kw.setdefault("num_kv_blocks", 64)
    kw.setdefault("max_num_seqs", 8)
    return LLMEngine(EngineConfig(model_dir=model_dir, engine_type=engine_type, **kw))


def drain(eng, limit=500):
    outputs, handoffs = [], []
    for _ in range(limit):
        if not eng.has_work():
            return outputs, handoffs
        step = eng.step()
        outputs += step.outputs
        handoffs += step.handoffs
    raise AssertionError("engine did not drain")


def prefill(model_dir, prompts, **kw):
    prompt_engine = engine(model_dir, "prompt", **kw)
    for i, ids in enumerate(prompts):
        prompt_engine.add_request(f"r{i}", ids, GREEDY)
    outputs, handoffs = drain(prompt_engine)
    prompt_engine.assert_drained()  # blocks freed once the payload exists (S35)
    assert outputs == []  # nothing finished on the prompt side with these settings
    return handoffs


@pytest.fixture(scope="module")
def handoffs(model_dirs, mixed_prompts):
    return prefill(model_dirs["mistral-swa"], mixed_prompts[:4])


def test_payload_carries_first_token_and_history(handoffs, mixed_prompts):
    for h in handoffs:
        payload = KVPayload.from_bytes(h.payload)
        assert payload.attempt == h.attempt
        index = int(h.attempt[1:])
        assert payload.token_ids == mixed_prompts[index] + [h.first_token_id]
        assert payload.num_prompt_tokens == len(mixed_prompts[index])


@pytest.mark.parametrize("mutate,field", [
    (lambda p: setattr(p, "model_fingerprint", "x"), "model_fingerprint"),
    (lambda p: setattr(p, "block_size", 8), "block_size"),
    (lambda p: setattr(p, "dtype", "bfloat16"), "dtype"),
])
def test_mismatched_payload_is_refused_and_allocates_nothing(model_dirs, handoffs, mutate, field):
    completion = engine(model_dirs["mistral-swa"], "completion")
    free_before = completion.scheduler.num_free_blocks
    payload = KVPayload.from_bytes(handoffs[0].payload)
    mutate(payload)
    with pytest.raises(KVPayloadError, match=field):
        completion.import_prefilled(payload.to_bytes())
    assert completion.scheduler.num_free_blocks == free_before
    assert not completion.has_work()
    completion.assert_drained()


def test_truncated_payload_is_refused(model_dirs, handoffs):
    completion = engine(model_dirs["mistral-swa"], "completion")
    with pytest.raises(KVPayloadError, match="truncated"):
        completion.import_prefilled(handoffs[0].payload[:-10])
    completion.assert_drained()


def test_payload_that_can_never_fit_is_rejected(model_dirs, handoffs):
    completion = engine(model_dirs["mistral-swa"], "completion", num_kv_blocks=4)
    longest = max(handoffs, key=lambda h: h.num_prompt_tokens)
    with pytest.raises(NoCapacityError):
        completion.import_prefilled(longest.payload)
    completion.assert_drained()


def test_import_waits_for_blocks_then_completes(model_dirs, handoffs):
    # Room for about one request at a time: later imports wait in FIFO order.
    completion = engine(model_dirs["mistral-swa"], "completion", num_kv_blocks=32)
    for h in handoffs:
        completion.import_prefilled(h.payload)
    outputs, _ = drain(completion)
    finished = {o.attempt: o.finish_reason for o in outputs if o.finished}
    assert set(finished) == {h.attempt for h in handoffs}
    stats = completion.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_prompted) == (0, 0, 0)
    assert stats.num_free_blocks == stats.num_total_blocks
    completion.assert_drained()


def test_completion_engine_out_of_blocks_terminates_victim(model_dirs, mixed_prompts):
    # Two long prompts whose decode outgrows a pool that holds both prompts.
    prompts = [mixed_prompts[3], mixed_prompts[6]]  # 70 and 100 tokens
    long_params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompt_engine = engine(model_dirs["llama"], "prompt", num_kv_blocks=128)
    for i, ids in enumerate(prompts):
        prompt_engine.add_request(f"r{i}", ids, long_params)
    _, handoffs = drain(prompt_engine)
    completion = engine(model_dirs["llama"], "completion", num_kv_blocks=47)  # 46 usable
    for h in handoffs:
        completion.import_prefilled(h.payload)
    outputs, _ = drain(completion)
    reasons = {o.attempt: o.finish_reason for o in outputs if o.finished}
    assert sorted(reasons.values()) == ["insufficient_system_resource", "length"]
    assert completion.scheduler.num_preemptions == 1
    completion.assert_drained()


def test_completion_engine_refuses_recompute_setting(model_dirs):
    with pytest.raises(ValueError, match="stop_preempted_request"):
        engine(model_dirs["llama"], "completion", stop_preempted_request=False)


def test_abort_of_pending_import_reports_abort(model_dirs, handoffs):
    completion = engine(model_dirs["mistral-swa"], "completion", num_kv_blocks=32)
    for h in handoffs:
        completion.import_prefilled(h.payload)
    assert completion.abort(handoffs[-1].attempt)
    assert not completion.abort("unknown-id")
    outputs, _ = drain(completion)
    reasons = {o.attempt: o.finish_reason for o in outputs if o.finished}
    assert reasons[handoffs[-1].attempt] == "abort"
    completion.assert_drained()


def tokens_by_request(outputs):
    tokens = {}
    for o in outputs:
        tokens.setdefault(o.attempt, []).extend(o.new_token_ids)
    return tokens


def test_an_import_with_room_is_written_into_its_blocks_at_once(model_dirs, handoffs):
    completion = engine(model_dirs["mistral-swa"], "completion")
    free_before = completion.scheduler.num_free_blocks
    data = bytearray(handoffs[0].payload)
    completion.import_prefilled(data, borrowed=True)
    assert not completion._pending_imports  # admitted: nothing refers to the bytes now
    assert completion.scheduler.num_free_blocks < free_before
    data[:] = bytes(len(data))  # the sender reuses its buffer
    reference = engine(model_dirs["mistral-swa"], "completion")
    reference.import_prefilled(handoffs[0].payload)
    got, want = (tokens_by_request(drain(e)[0]) for e in (completion, reference))
    assert got == want and len(want[handoffs[0].attempt]) == GREEDY.max_tokens - 1
    completion.assert_drained()


def test_a_borrowed_import_that_must_wait_keeps_a_copy_of_its_bytes(model_dirs, handoffs):
    # Room for about one request at a time: the later ones wait, and their senders'
    # buffers are overwritten right after each import returns.
    completion = engine(model_dirs["mistral-swa"], "completion", num_kv_blocks=32)
    reference = engine(model_dirs["mistral-swa"], "completion", num_kv_blocks=32)
    for h in handoffs:
        data = bytearray(h.payload)
        completion.import_prefilled(data, borrowed=True)
        data[:] = bytes(len(data))
        reference.import_prefilled(h.payload)
    assert len(completion._pending_imports) >= 1
    got, want = (tokens_by_request(drain(e)[0]) for e in (completion, reference))
    assert got == want and set(got) == {h.attempt for h in handoffs}
    completion.assert_drained()
