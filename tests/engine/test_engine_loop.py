"""The engine loop parks without spinning and wakes within milliseconds of new work."""

import threading
import time

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.engine_loop import EngineLoop
from pdserve.scheduler.sampling_params import SamplingParams


def test_idle_loop_parks_and_wakes_fast(model_dirs):
    engine = LLMEngine(EngineConfig(model_dir=model_dirs["llama"], block_size=4, num_kv_blocks=64,
                                    max_num_seqs=4))
    first_step_at: list[float] = []
    done = threading.Event()

    def on_step(step):
        if not first_step_at:
            first_step_at.append(time.perf_counter())
        if any(o.finished for o in step.outputs):
            done.set()

    loop = EngineLoop(engine, on_step=on_step, park_timeout_s=5.0).start()
    try:
        time.sleep(0.3)
        assert engine.num_steps == 0
        assert loop.num_parks <= 2  # parked on its event, not spinning
        submitted = time.perf_counter()
        loop.call(lambda e: e.add_request("r", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0)))
        assert done.wait(10)
        assert first_step_at[0] - submitted < 0.05  # woken at once, not after park_timeout_s
        time.sleep(0.2)
        assert loop.num_parks <= 3
        with loop.lock:
            engine.assert_drained()
    finally:
        loop.stop()
    assert not loop.running and loop.error is None
