"""Prefix caching through the service and cache-aware routing across 2 prefill ranks.

Requests sharing a long prefix land on the rank whose cache holds it (the rank reports
its cache's names in its step reports; the router matches prompts against them) and
report most of their prompt as cached (`Usage.cached_prompt_tokens`, the HTTP
`prompt_tokens_details.cached_tokens`, `GetClusterState`, Prometheus); outputs stay
the offline LLM's; afterwards every block is free or evictable."""

from __future__ import annotations

import random
import urllib.request

import pytest

from pdserve.router.client import Client

MAX_TOKENS = 6


def shared_prompts(num: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    system = [1] + [rng.randrange(3, 4000) for _ in range(400)]
    return [system + [rng.randrange(3, 4000) for _ in range(8 + i)] for i in range(num)]


@pytest.fixture(scope="module")
def routers(make_router):
    made = {}

    def get(routing: str):
        if routing not in made:
            made[routing] = make_router(prefill=2, decode=1, routing=routing)
        return made[routing]

    yield get
    for harness in made.values():
        harness.close()


def run_sequentially(router, prompts):
    with Client(router.address, timeout=60) as client:
        return [client.generate(p, max_tokens=MAX_TOKENS, temperature=0) for p in prompts]


def prefill_hits(router) -> dict[int, int]:
    stats = router.stats()["prefill"]
    return {r["rank"]: r["cache_hit_tokens"] for r in stats}


def test_cache_aware_routing_sends_a_shared_prefix_to_the_rank_that_holds_it(
        routers, reference):
    router = routers("cache_aware")
    prompts = shared_prompts(6)
    outs = run_sequentially(router, prompts)
    assert [o.token_ids for o in outs] == reference(prompts, MAX_TOKENS)
    assert outs[0].cached_prompt_tokens == 0
    for out, prompt in zip(outs[1:], prompts[1:], strict=True):
        assert out.cached_prompt_tokens >= 0.85 * len(prompt), out.cached_prompt_tokens
    hits = prefill_hits(router)
    assert sorted(hits.values())[0] == 0  # one rank served them all from its cache
    assert max(hits.values()) >= 5 * 400
    # the rank said what it holds: the router's index matches the prompt's blocks
    ranks = router.service.pools["prefill"].ready()
    assert max(r.cached_prefix_blocks(_hashes(prompts[0], router)) for r in ranks) >= 25
    # ... and so did the decode rank: the shared prefix crossed to it once
    assert router.service.num_kv_blocks_skipped >= 5 * 25
    assert_drained(router)


@pytest.mark.parametrize("transport", ["grpc", "ray"])
def test_a_shared_prefix_crosses_to_the_decode_rank_once(make_router, reference, transport):
    router = make_router(prefill=1, decode=1, kv_transport=transport)
    try:
        prompts = shared_prompts(3, seed=4)
        moved = []
        for prompt in prompts:
            before = router.service.transport.bytes_moved
            assert run_sequentially(router, [prompt])[0].token_ids == reference([prompt],
                                                                                 MAX_TOKENS)[0]
            moved.append(router.service.transport.bytes_moved - before)
        # 400 shared tokens = 25 full blocks the decode rank already holds
        assert router.service.num_kv_blocks_skipped == 2 * 25
        assert moved[1] < 0.2 * moved[0] and moved[2] < 0.2 * moved[0], moved
        assert_drained(router)
    finally:
        router.close()


def _hashes(prompt, router):
    from pdserve.router.routing import PromptBlocks

    return PromptBlocks.of(prompt, router.service.block_size).hashes


def test_least_loaded_routing_spreads_them_and_misses_more(routers, reference):
    router = routers("least_loaded")
    prompts = shared_prompts(6, seed=1)
    outs = run_sequentially(router, prompts)
    assert [o.token_ids for o in outs] == reference(prompts, MAX_TOKENS)
    hits = prefill_hits(router)
    assert min(hits.values()) > 0  # both ranks computed the prefix once, then hit it
    cached = sum(o.cached_prompt_tokens for o in outs)
    aware = routers("cache_aware")
    aware_outs = run_sequentially(aware, shared_prompts(6, seed=1))
    assert sum(o.cached_prompt_tokens for o in aware_outs) > cached
    assert_drained(router)
    assert_drained(aware)


def test_cached_tokens_are_visible_over_http_state_and_metrics(routers, tiny_model_dir):
    openai = pytest.importorskip("openai")
    from pathlib import Path

    router = routers("cache_aware")
    url = f"http://127.0.0.1:{router.server.http_port}/v1"
    prompt = shared_prompts(1, seed=2)[0]
    with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60) as client:
        model = Path(tiny_model_dir).name
        first = client.completions.create(model=model, prompt=prompt, max_tokens=2,
                                          temperature=0)
        again = client.completions.create(model=model, prompt=prompt, max_tokens=2,
                                          temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens >= 0.85 * len(prompt)
    assert again.choices[0].text == first.choices[0].text
    with Client(router.address, timeout=30) as client:
        state = client.cluster_state()
        last = list(client.stream(prompt, max_tokens=2, temperature=0))[-1]
    ranks = [r for p in state.pools if p.name == "prefill" for r in p.ranks]
    assert sum(r.cache_hit_tokens for r in ranks) > 0
    assert all(r.cache_queried_tokens >= r.cache_hit_tokens for r in ranks)
    assert last.timings.cached_prompt_tokens == last.usage.cached_prompt_tokens > 0
    metrics_port = router.server.metrics_port
    assert metrics_port
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                  timeout=10).read().decode()
    assert "pdserve_rank_prefix_cache_hit_tokens_total" in text
    assert_drained(router)


def assert_drained(router) -> None:
    stats = router.wait_drained()
    for ranks in stats.values():
        for r in ranks:
            assert r["num_free_blocks"] == r["num_total_blocks"], r  # free or evictable
    assert router.drained_errors() == []
