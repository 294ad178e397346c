"""Logprobs through a real router in disaggregated mode (the session's router: one
prefill and one decode rank): GenerateResponse.logprobs equal log_softmax of
transformers' fp32 logits (within 1e-4) for the first token (sampled on the prefill
rank, carried in its hand-off report) and the later ones (decode rank), for greedy and
seeded sampled requests; top-k ids most likely first; k = 0 gives only the chosen
token's; no logprobs unless asked; an out-of-range k is INVALID_ARGUMENT naming
``logprobs``; a moved request streams correct logprobs for its new tokens."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from pdserve.router.client import Client
from pdserve.router.requests import RequestState
from pdserve.router.validation import PreparedRequest
from pdserve.scheduler.sampling_params import SamplingParams

ATOL = 1e-4
PROMPT = [1, 327, 399, 81, 10, 90, 320]
_HF: dict = {}


@pytest.fixture(scope="module")
def router(shared_router):
    return shared_router


def hf_logprobs(model_dir: str, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """Row i: log_softmax of transformers' fp32 logits where ``generated[i]`` was drawn."""
    from transformers import AutoModelForCausalLM

    if model_dir not in _HF:
        _HF[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir,
                                                              dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = _HF[model_dir](torch.tensor([prompt + generated])).logits[0].float()
    return torch.log_softmax(logits, -1)[len(prompt) - 1:len(prompt) - 1 + len(generated)]


def check_against(ref: torch.Tensor, tokens: list[int], logprobs, k: int) -> None:
    assert len(logprobs) == len(tokens)
    for i, (tok, lp) in enumerate(zip(tokens, logprobs, strict=True)):
        row = ref[i]
        assert lp.logprob == pytest.approx(float(row[tok]), abs=ATOL), (i, tok)
        ids, vals = list(lp.top_token_ids), list(lp.top_logprobs)
        assert len(ids) == len(vals) == k
        if not k:
            continue
        assert all(a >= b for a, b in zip(vals, vals[1:], strict=False)), i  # most likely first
        assert vals == pytest.approx(row.topk(k).values.tolist(), abs=ATOL), i
        for tid, v, want in zip(ids, vals, row.topk(k).indices.tolist(), strict=True):
            assert v == pytest.approx(float(row[tid]), abs=ATOL), (i, tid)
            # the reference's id, or a neighbour closer than the tolerance
            assert tid == want or abs(float(row[tid]) - float(row[want])) < ATOL, (i, tid)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded-sampled"])
def test_logprobs_equal_transformers(router, tiny_model_dir, sampled):
    k = 3 if sampled else 5
    kw = dict(temperature=0.9, top_k=40, top_p=0.9, seed=77) if sampled else dict(temperature=0)
    with Client(router.address, timeout=60) as client:
        msgs = list(client.stream(PROMPT, max_tokens=8, ignore_eos=True, logprobs=k, **kw))
    assert msgs[-1].finish_reason == "length", msgs[-1].error
    tokens = [t for m in msgs for t in m.token_ids]
    logprobs = [lp for m in msgs for lp in m.logprobs]
    for m in msgs:
        assert len(m.logprobs) == len(m.token_ids)  # aligned message by message
    # the first message is the prefill rank's token alone, with its logprobs
    assert len(msgs[0].token_ids) == 1 and len(msgs[0].logprobs) == 1
    assert len(tokens) == 8
    check_against(hf_logprobs(tiny_model_dir, PROMPT, tokens), tokens, logprobs, k)
    if not sampled:
        assert [lp.top_token_ids[0] for lp in logprobs] == tokens
    router.assert_nothing_left()


def test_first_token_only_and_k_zero(router, tiny_model_dir):
    """max_tokens 1 ends at the hand-off (the prefill rank's report is all there is);
    k = 0 gives the chosen token's logprob and no alternatives."""
    with Client(router.address, timeout=60) as client:
        one = client.generate(PROMPT, max_tokens=1, temperature=0, logprobs=2)
        zero = client.generate(PROMPT, max_tokens=5, temperature=0, logprobs=0,
                               ignore_eos=True)
    assert one.finish_reason == "length" and len(one.token_ids) == 1
    check_against(hf_logprobs(tiny_model_dir, PROMPT, one.token_ids), one.token_ids,
                  one.logprobs, 2)
    assert zero.token_ids[0] == one.token_ids[0]
    check_against(hf_logprobs(tiny_model_dir, PROMPT, zero.token_ids), zero.token_ids,
                  zero.logprobs, 0)
    assert one.to_dict()["logprobs"][0]["top_token_ids"] == list(one.logprobs[0].top_token_ids)
    router.assert_nothing_left()


def test_no_logprobs_unless_asked(router, reference):
    with Client(router.address, timeout=60) as client:
        msgs = list(client.stream(PROMPT, max_tokens=6, temperature=0))
        out = client.generate(PROMPT, max_tokens=6, temperature=0)
    assert all(len(m.logprobs) == 0 for m in msgs)
    assert out.logprobs == [] and "logprobs" not in out.to_dict()
    assert out.token_ids == reference([PROMPT], 6)[0]


@pytest.mark.parametrize("bad", [-1, 21, 1000])
def test_out_of_range_k_is_invalid_argument(router, bad):
    with Client(router.address, timeout=30) as client, pytest.raises(grpc.RpcError) as err:
        client.generate(PROMPT, max_tokens=2, logprobs=bad)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "logprobs" in err.value.details()


def test_a_moved_request_streams_correct_logprobs(router, tiny_model_dir):
    """Moved right after its first token (its new attempt recomputes prompt + streamed
    tokens on a prefill rank): every token, old attempt's and new one's, has the
    reference's logprobs at its position, none missing, none twice."""
    svc = router.service
    moves = svc.num_moves

    async def move(label: str) -> bool:
        state = svc.tracker.by_label(label)
        if state is None or state.finished:
            return False
        svc.flow.move(state, "moved by the test")
        return True

    with Client(router.address, timeout=60) as client:
        msgs, moved = [], False
        for m in client.stream(PROMPT, request_id="lp-move", max_tokens=40, temperature=0,
                               ignore_eos=True, logprobs=4):
            msgs.append(m)
            if len(msgs) == 1:
                moved = router.call(move("lp-move"))
    assert moved and svc.num_moves == moves + 1
    assert msgs[-1].finish_reason == "length", msgs[-1].error
    tokens = [t for m in msgs for t in m.token_ids]
    logprobs = [lp for m in msgs for lp in m.logprobs]
    assert len(tokens) == 40
    check_against(hf_logprobs(tiny_model_dir, PROMPT, tokens), tokens, logprobs, 4)
    router.assert_nothing_left()


def test_tokens_past_max_tokens_drop_their_logprobs():
    """RequestState keeps logprobs aligned with what it streams."""
    sp = SamplingParams(max_tokens=3, logprobs=1)

    async def run():
        state = RequestState(PreparedRequest("", [1, 2], sp), rid="r", label="r")
        state.push([5, 6], ["a", "b"])
        state.push([7, 8, 9], ["c", "d", "e"])  # only one token left
        state.finish("length", token_ids=[10], logprobs=["f"])  # none left
        events = [state.events.get_nowait() for _ in range(3)]
        plain = RequestState(PreparedRequest("", [1, 2], SamplingParams(max_tokens=3)),
                             rid="p", label="p")
        plain.push([5, 6])
        return events, plain.events.get_nowait()

    events, plain = asyncio.run(run())
    assert [(e.token_ids, e.logprobs) for e in events] == [
        ([5, 6], ["a", "b"]), ([7], ["c"]), ([], [])]
    assert plain.logprobs is None
