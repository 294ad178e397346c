"""A lost step report is detected by the gap it leaves in the attempt's token count:
the request moves (recomputed from the tokens it did stream) and still ends with its
offline greedy tokens, none missing, none twice. A report lost with nothing after it
is caught by the stall bound."""

from __future__ import annotations

import pytest

from pdserve.rank.fault_injection import FaultyEngineFactory
from pdserve.router.client import Client


@pytest.fixture(scope="module")
def router(make_router):
    # Every decode rank drops the outputs of its 4th computing step.
    h = make_router(prefill=1, decode=1, engine_factory=FaultyEngineFactory(
        lose_reports_of_runs=frozenset({4}), engine_types=("completion",)),
        request_stall_timeout_s=5.0)
    yield h
    h.close()  # its ranks hold the session's pool resources


def test_a_gap_in_the_token_count_moves_the_request(router, reference):
    prompt = "lost report: the quick brown fox"
    want = reference([prompt], 30)[0]
    lost, moves = router.service.num_lost_reports, router.service.num_moves
    with Client(router.address, timeout=60) as client:
        out = client.generate(prompt, max_tokens=30, temperature=0)
    assert out.finish_reason in ("length", "stop"), out.error
    assert out.token_ids == want
    # exactly the one lost report was seen: the old attempt's later reports (several may
    # come in one poll) are stale the moment the request moves, so it moves once
    assert router.service.num_lost_reports == lost + 1
    assert router.service.num_moves == moves + 1
    router.assert_nothing_left()


def test_a_lost_last_report_is_caught_by_the_stall_bound(router, reference):
    """On a fresh decode rank (chosen: as free as the other, assigned nothing yet) a
    request of 5 tokens decodes tokens 2..5 in runs 1..4: its finish is lost with run 4,
    so no later report shows a gap. After 5 s without progress it moves, and the new
    attempt (history of 4 tokens, 1 left) finishes it."""
    with Client(router.address, timeout=60) as client:
        client.scale("decode", 2)
        prompt = "stall: hello world"
        want = reference([prompt], 5)[0]
        assert len(want) == 5
        moves = router.service.num_moves
        out = client.generate(prompt, max_tokens=5, temperature=0)
        assert router.service.num_moves == moves + 1
        assert out.token_ids == want and out.finish_reason in ("length", "stop"), out.error
        client.scale("decode", 1)
    router.assert_nothing_left()
