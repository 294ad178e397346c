"""bench/peer_vllm.py: it skips without a vLLM environment, and its side-by-side harness
(a worker process of another interpreter spoken to over stdin/stdout, alternating pairs,
outputs compared) works, here against a stand-in worker that answers with
transformers' greedy tokens (a test double for vLLM's LLM, which is not installed)."""

from __future__ import annotations

import sys
import time

import pytest

from pdserve.bench import peer_vllm

# The worker protocol, answered with HF generate (shift: tokens made wrong on purpose).
STAND_IN = r"""
import json, sys, time, torch
from transformers import AutoModelForCausalLM
args = json.loads(sys.argv[1])
model = AutoModelForCausalLM.from_pretrained(args["model"], dtype=torch.float32).eval()
model.generation_config.eos_token_id = None
model.generation_config.pad_token_id = 0
print("a line vLLM might print", flush=True)
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    ids = torch.tensor(req["prompts"])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=req["max_tokens"], do_sample=False)
    tokens = out[:, ids.shape[1]:].tolist()
    if SHIFT:
        tokens = [[t + 1 for t in row] for row in tokens]
    print(json.dumps({"seconds": time.perf_counter() - start, "tokens": tokens}), flush=True)
"""


def test_without_a_vllm_environment_it_says_so_and_measures_nothing(tmp_path, capsys,
                                                                    monkeypatch):
    monkeypatch.delenv("PDSERVE_VLLM_PYTHON", raising=False)
    out = tmp_path / "peer.json"
    assert peer_vllm.main(["--result-file", str(out)]) == 0
    assert "skipped: no vLLM environment" in capsys.readouterr().out
    assert not out.exists()
    assert "cannot import vllm" in peer_vllm.vllm_available(sys.executable)


@pytest.mark.parametrize("shift", [0, 1])
def test_the_harness_alternates_pairs_and_compares_tokens(tiny_model_dir, tmp_path, shift):
    from pdserve.bench.offline import HFSide, make_prompts

    prompts = make_prompts(4096, 2, 16)
    hf_tokens = HFSide(tiny_model_dir).run(prompts, 4)[1]
    worker = peer_vllm.VLLMWorker(sys.executable, tiny_model_dir, 64, 2, str(tmp_path),
                                  worker=STAND_IN.replace("SHIFT", str(shift)))
    try:
        row = peer_vllm.run_model("tiny", tiny_model_dir, worker, prompts, 4, 2, hf_tokens)
    finally:
        worker.close()
    assert worker.proc.poll() is not None
    assert len(row["ratio_per_pair"]) == 2 and all(r > 0 for r in row["ratio_per_pair"])
    assert row["pdserve_equals_hf"]
    assert row["outputs_identical"] == row["vllm_equals_hf"] == (shift == 0)
    assert "tiny" in peer_vllm.format_rows([row])
    from pdserve.kernels import cbuild, decode_step

    assert row["kernel_isa"] == cbuild.host_isa()
    assert row["decode_kernel"] == decode_step.available()


# Spawns a child that outlives its parent (as vLLM's engine-core process does) and
# ignores the end of input; reports its pid through a file.
LINGERING = r"""
import json, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(PID_FILE, "w").write(str(child.pid))
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    pass
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()
    except FileNotFoundError:
        return False


def test_close_ends_the_workers_children_too(tmp_path, monkeypatch):
    """A worker whose child lingers: close() ends it too (vLLM's engine-core processes,
    left behind by a killed worker, spun on the CPU through every later measurement)."""
    monkeypatch.setattr(peer_vllm, "CLOSE_TIMEOUT_S", 5.0)
    pid_file = tmp_path / "child.pid"
    worker = peer_vllm.VLLMWorker(sys.executable, "unused", 64, 2, str(tmp_path),
                                  worker=LINGERING.replace("PID_FILE", repr(str(pid_file))))
    child = int(pid_file.read_text())
    assert _alive(child)
    worker.close()
    assert worker.proc.poll() is not None
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)
