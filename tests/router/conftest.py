"""Shared fixtures: one embedded Ray for the session, the tiny model, routers in threads."""

from __future__ import annotations

import pytest
from pdserve.bench.harness import RouterHarness


def router_config(model_dir: str, **overrides):
    from pdserve.router.config import PoolConfig, RouterConfig

    engine = dict(num_kv_blocks=128, max_num_seqs=32, block_size=16)
    engine.update(overrides.pop("engine", {}))
    prefill = overrides.pop("prefill", 1)
    decode = overrides.pop("decode", 1)
    normal = overrides.pop("normal", 1)
    overrides.setdefault("collective_timeout_s", 10.0)
    return RouterConfig(
        model_dir=model_dir, port=0,
        prefill=PoolConfig("prefill", replicas=prefill, num_cpus=0.5,
                           resources={"prefill": 1}, engine=engine),
        decode=PoolConfig("decode", replicas=decode, num_cpus=0.5,
                          resources={"decode": 1}, engine=engine),
        normal=PoolConfig("normal", replicas=normal, num_cpus=0.5, engine=engine),
        **overrides)


@pytest.fixture(scope="session")
def make_router(ray_session, tiny_model_dir):
    started: list[RouterHarness] = []

    def make(**overrides) -> RouterHarness:
        harness = RouterHarness(router_config(tiny_model_dir, **overrides))
        started.append(harness)
        return harness

    yield make
    for h in started:
        try:
            h.close()
        except Exception:
            pass


@pytest.fixture(scope="session")
def shared_router(make_router):
    """One disaggregated router (1 prefill + 1 decode rank to start) for several modules."""
    return make_router(prefill=1, decode=1)


@pytest.fixture(scope="session")
def reference(tiny_model_dir):
    """Greedy outputs of the offline LLM(mode="normal"), memoised per (prompt, max_tokens)."""
    from pdserve.engine.llm import LLM
    from pdserve.scheduler.sampling_params import SamplingParams

    llm = LLM(tiny_model_dir, mode="normal")
    cache: dict = {}

    def ref(prompts: list, max_tokens: int) -> list[list[int]]:
        todo = [p for p in prompts if (repr(p), max_tokens) not in cache]
        if todo:
            texts = [p for p in todo if isinstance(p, str)]
            ids = [p for p in todo if not isinstance(p, str)]
            sp = SamplingParams(max_tokens=max_tokens, temperature=0.0)
            if texts:
                for p, out in zip(texts, llm.generate(texts, sp), strict=True):
                    cache[(repr(p), max_tokens)] = list(out.token_ids)
            if ids:
                for p, out in zip(ids, llm.generate(prompt_token_ids=ids, sampling_params=sp), strict=True):
                    cache[(repr(p), max_tokens)] = list(out.token_ids)
        return [cache[(repr(p), max_tokens)] for p in prompts]

    return ref
