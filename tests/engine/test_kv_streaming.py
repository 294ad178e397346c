"""KV streaming between a PROMPT and a COMPLETION engine: the full blocks each prompt
chunk completes go ahead as "chunk" payloads, the hand-off carries only the rest, and
the decode side's reserved blocks are freed on every path."""

import pytest

from pdserve.engine import engine as engine_module
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import CacheMissError, LLMEngine, NoCapacityError
from pdserve.engine.kv.payload import KVPayload, KVPayloadError
from pdserve.scheduler.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
BLOCK = 4
PROMPT = [(7 * i + 3) % 250 + 1 for i in range(45)]  # 11 full blocks and a partial one


def engine(model_dir, engine_type, **kw):
    kw.setdefault("block_size", BLOCK)
    kw.setdefault("num_kv_blocks", 64)
    kw.setdefault("max_num_batched_tokens", 16)  # the prompt takes several steps
    kw.setdefault("max_num_seqs", 4)
    return LLMEngine(EngineConfig(model_dir=model_dir, engine_type=engine_type, **kw))


def prefill(model_dir, stream_kv=True, prompt=PROMPT, attempt="a", **kw):
    """Run a prompt to its hand-off: (its chunks in order, the hand-off)."""
    eng = engine(model_dir, "prompt", **kw)
    eng.add_request(attempt, prompt, GREEDY, stream_kv=stream_kv)
    chunks, handoffs = [], []
    while eng.has_work():
        out = eng.step()
        chunks += out.kv_chunks
        handoffs += out.handoffs
    eng.assert_drained()
    return chunks, handoffs[0]


def decode(eng):
    tokens = []
    while eng.has_work():
        tokens += [t for o in eng.step().outputs for t in o.new_token_ids]
    eng.assert_drained()
    return tokens


def test_a_streamed_prompt_decodes_the_same_tokens_with_a_smaller_hand_off(model_dirs):
    model = model_dirs["llama"]
    chunks, handoff = prefill(model)
    _, whole = prefill(model, stream_kv=False)
    assert len(chunks) >= 2 and chunks[0].first_block == 0
    for before, after in zip(chunks, chunks[1:], strict=False):  # contiguous, in order
        assert after.first_block == before.first_block + before.num_blocks
    streamed = chunks[-1].first_block + chunks[-1].num_blocks
    assert handoff.streamed_blocks == streamed and handoff.stream_of == "a"
    assert 0 < streamed <= len(PROMPT) // BLOCK
    assert len(handoff.payload) < len(whole.payload) * 0.6
    assert handoff.first_token_id == whole.first_token_id

    receiver = engine(model, "completion")
    free = receiver.scheduler.num_free_blocks
    for chunk in chunks:
        receiver.import_prefilled(bytearray(chunk.payload), borrowed=True)
    assert receiver.scheduler.num_free_blocks == free - streamed  # reserved as they came
    receiver.import_prefilled(handoff.payload)
    reference = engine(model, "completion")
    reference.import_prefilled(whole.payload)
    assert decode(receiver) == decode(reference)


def test_streamed_blocks_join_the_receivers_prefix_cache_as_a_whole_import_does(model_dirs):
    """The blocks a partial import holds are named in the decode rank's prefix cache, by
    the hashes a whole import would give them (made as the chunks came), and reported
    as cache events, so the router can route the prompt's next turn there."""
    from pdserve.scheduler.prefix_hash import cacheable_blocks, chain_hashes

    model = model_dirs["llama"]
    chunks, handoff = prefill(model)
    _, whole = prefill(model, stream_kv=False)
    full = cacheable_blocks(len(PROMPT) + 1, BLOCK)  # the prompt's full blocks
    hashes = chain_hashes(PROMPT, BLOCK, full)
    named = {}
    for stream in (True, False):
        receiver = engine(model, "completion")
        for chunk in chunks if stream else ():
            receiver.import_prefilled(bytearray(chunk.payload), borrowed=True)
        receiver.import_prefilled(handoff.payload if stream else whole.payload)
        events = receiver.step().cache_events
        assert len(receiver.scheduler.blocks.lookup(hashes)) == full, stream
        named[stream] = {h for added, h in events if added}
        decode(receiver)
    assert named[True] == named[False] and set(hashes) <= named[True]


def test_chunks_out_of_order_or_from_another_prompt_are_refused_and_take_nothing(model_dirs):
    model = model_dirs["llama"]
    chunks, _ = prefill(model)
    receiver = engine(model, "completion")
    free = receiver.scheduler.num_free_blocks
    with pytest.raises(KVPayloadError, match="starts at block"):
        receiver.import_prefilled(chunks[1].payload)
    receiver.import_prefilled(chunks[0].payload)
    other, _ = prefill(model, prompt=[5] * len(PROMPT))
    forged = KVPayload.from_bytes(other[1].payload)
    forged.skipped_blocks = chunks[1].first_block  # same place, another prompt's tokens
    forged.token_ids = [5] * len(forged.token_ids)
    with pytest.raises(KVPayloadError, match="tokens differ"):
        receiver.import_prefilled(forged.to_bytes())
    assert receiver.scheduler.num_free_blocks == free - chunks[0].num_blocks
    assert receiver.abort("a")  # the request ended before its hand-off
    assert receiver.scheduler.num_free_blocks == free
    receiver.assert_drained()


def test_a_hand_off_whose_chunks_never_arrived_is_a_cache_miss(model_dirs):
    model = model_dirs["llama"]
    chunks, handoff = prefill(model)
    receiver = engine(model, "completion", enable_prefix_caching=False)
    with pytest.raises(CacheMissError, match="streamed chunks"):
        receiver.import_prefilled(handoff.payload)
    free = receiver.scheduler.num_free_blocks
    receiver.import_prefilled(chunks[0].payload)  # only some of them: still a miss
    with pytest.raises(CacheMissError):
        receiver.import_prefilled(handoff.payload)
    assert receiver.scheduler.num_free_blocks == free  # ... and those went: send them all
    for chunk in chunks:
        receiver.import_prefilled(chunk.payload)
    receiver.import_prefilled(handoff.payload)  # now whole
    assert len(decode(receiver)) == GREEDY.max_tokens - 1


def test_streamed_blocks_nobody_continues_expire(model_dirs, monkeypatch):
    model = model_dirs["llama"]
    chunks, _ = prefill(model)
    receiver = engine(model, "completion")
    free = receiver.scheduler.num_free_blocks
    receiver.import_prefilled(chunks[0].payload)
    assert receiver.scheduler.num_free_blocks < free
    monkeypatch.setattr(engine_module, "PARTIAL_IMPORT_MAX_AGE_S", -1.0)
    receiver.step()
    assert receiver.scheduler.num_free_blocks == free
    receiver.assert_drained()


def test_no_room_for_a_chunk_is_a_capacity_refusal(model_dirs):
    model = model_dirs["llama"]
    chunks, _ = prefill(model)
    receiver = engine(model, "completion", num_kv_blocks=chunks[0].num_blocks)
    with pytest.raises(NoCapacityError):
        receiver.import_prefilled(chunks[0].payload)
    receiver.assert_drained()


def test_a_sliding_window_model_does_not_stream(model_dirs):
    chunks, handoff = prefill(model_dirs["mistral-swa"])
    assert chunks == [] and handoff.streamed_blocks == 0


def test_an_aborted_streaming_prompt_leaves_nothing_behind(model_dirs):
    eng = engine(model_dirs["llama"], "prompt")
    eng.add_request("a", PROMPT, GREEDY, stream_kv=True)
    out = eng.step()
    assert out.kv_chunks and out.kv_chunks[0].stream_of == "a"
    eng.abort("a")
    while eng.has_work():
        eng.step()
    eng.assert_drained()  # the stream is forgotten with its request
