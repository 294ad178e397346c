"""Engines of one data-parallel pool, in real processes on a real gloo group, take
the same kind of step at every step under uneven load, ranks with nothing to do
included, and the pool parks when no rank has work."""

import pytest

from pdserve.engine.rank_pool import RankPool

pytestmark = pytest.mark.timeout(240)


def lockstep_rank(ctx, model_dir: str, load: dict, engine_type: str):
    import torch

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.engine_loop import EngineLoop
    from pdserve.scheduler.sampling_params import SamplingParams

    torch.set_num_threads(1)
    comm = ctx.communicator(f"lockstep-{engine_type}", timeout=60.0)
    config = EngineConfig(model_dir=model_dir, engine_type=engine_type, block_size=4,
                          num_kv_blocks=128, max_num_seqs=4, max_num_batched_tokens=16,
                          prefill_attempt_interval=3, prefill_any_attempt_interval=5)
    engine = LLMEngine(config, communicator=comm if engine_type == "normal" else None)
    kinds, finished = [], {}

    def record(step):
        kinds.append("prompt" if step.kind in ("prompt", "empty_prompt") else step.kind)
        finished.update({o.attempt: o.finish_reason for o in step.outputs if o.finished})

    loop = EngineLoop(engine, on_step=record, communicator=comm)
    for i in range(load.get(ctx.rank, 0)):
        engine.add_request(f"rank{ctx.rank}-{i}", [5 + i] * (3 + 11 * i),
                           SamplingParams(max_tokens=4 + 3 * i, temperature=0.0, ignore_eos=True))
    while loop.turn() is not None:
        pass
    engine.assert_drained()
    return kinds, finished, engine.num_empty_steps


@pytest.mark.parametrize("world_size,load", [(2, {0: 3}), (4, {0: 2, 2: 4, 3: 1})])
def test_normal_ranks_take_identical_step_kinds(model_dirs, world_size, load):
    with RankPool(world_size) as pool:
        results = pool.run(lockstep_rank, model_dirs["llama"], load, "normal", timeout=200)
    kinds = [r[0] for r in results]
    assert all(k == kinds[0] for k in kinds), kinds
    assert "prompt" in kinds[0] and "decode" in kinds[0]
    for rank, (_, finished, empty_steps) in enumerate(results):
        assert len(finished) == load.get(rank, 0)
        assert set(finished.values()) <= {"length"}
        if load.get(rank, 0) == 0:
            assert empty_steps == len(kinds[0])  # an idle rank only ever steps empty
