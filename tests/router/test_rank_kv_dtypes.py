"""The service refuses to serve pools whose ranks' KV caches hold different dtypes (what
only the ranks know: a dtype follows the model file and the device too), and stops the
ranks it started."""

from __future__ import annotations

import asyncio

from pdserve.rank.fault_injection import SkewedEngineFactory


def _config(model_dir: str, kv_precision: str, prefill_kv_precision: str):
    from pdserve.router.config import PoolConfig, RouterConfig

    engine = dict(num_kv_blocks=64, max_num_seqs=8, block_size=16, kv_precision=kv_precision)
    return RouterConfig(
        model_dir=model_dir, port=0, collective_timeout_s=10.0,
        prefill=PoolConfig("prefill", replicas=1, num_cpus=0.5, resources={"prefill": 1},
                           engine=engine),
        decode=PoolConfig("decode", replicas=1, num_cpus=0.5, resources={"decode": 1},
                          engine=engine),
        engine_factory=SkewedEngineFactory((("kv_precision", prefill_kv_precision),)))


def _start(config):
    """(the service, start's RuntimeError or None, each started rank's (pool, kv_dtype,
    device)); a service that started is stopped."""
    from pdserve.router.service import RouterService

    service = RouterService(config)

    async def start():
        try:
            await service.start()
        except RuntimeError as exc:
            return exc, []
        said = [(r.info.pool, r.info.kv_dtype, r.info.device)
                for p in service.pools.values() for r in p.ranks]
        await service.stop()
        return None, said

    return service, *asyncio.run(start())


def test_fp16_prefill_ranks_beside_fp32_decode_ranks_are_refused_and_stopped(
        ray_session, tiny_model_dir):
    service, error, _ = _start(_config(tiny_model_dir, "fp32", "fp16"))
    assert error is not None
    message = str(error)
    assert "the prefill ranks' float16 (on cpu) and the decode ranks' float32 (on cpu)" \
        in message, message
    assert "every hand-off would be refused" in message
    assert all(not pool.ranks for pool in service.pools.values())  # stopped with the error


def test_ranks_whose_caches_agree_start_and_say_what_they_hold(ray_session, tiny_model_dir):
    _, error, said = _start(_config(tiny_model_dir, "fp16", "fp16"))
    assert error is None
    assert sorted(said) == [("decode", "float16", "cpu"), ("prefill", "float16", "cpu")]
    _, error, said = _start(_config(tiny_model_dir, "fp32", "fp32"))
    assert error is None
    assert sorted(said) == [("decode", "float32", "cpu"), ("prefill", "float32", "cpu")]
