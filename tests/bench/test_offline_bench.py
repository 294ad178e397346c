"""bench/offline.py end to end on the tiny model (a smoke run, not a measurement)."""

from __future__ import annotations

import json

import torch


def test_prefill_flops_count_the_trimmed_last_layer(tiny_model_dir):
    from pdserve.bench.offline import _prefill_matmul_flops
    from pdserve.engine.model.llama import load_model

    cfg, model = load_model(tiny_model_dir)
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    qkv = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    rest = cfg.num_heads * cfg.head_dim * h + 3 * h * i  # o, gate|up, down
    tokens, batch = 3 * 10, 3
    want = 2 * (tokens * (cfg.num_layers * qkv + (cfg.num_layers - 1) * rest)
                + batch * (rest + h * v))
    assert _prefill_matmul_flops(model, batch, 10) == want


def test_offline_bench_writes_ratios_identical_outputs_and_analysis(tiny_model_dir, tmp_path):
    from pdserve.bench.offline import main

    out = tmp_path / "offline.json"
    threads = torch.get_num_threads()
    try:
        main(["--model", tiny_model_dir, "--batch", "3", "--prompt-len", "12", "--max-tokens",
              "4", "--repeats", "1", "--hf-alt-threads", "0", "--analyse", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)  # main sets the process's thread count
    data = json.loads(out.read_text())
    (row,) = data["results"]
    assert row["identical_outputs"] == "3/3"
    assert row["batch"] == 3 and row["output_len"] == 4
    assert len(row["hf_seconds"]) == len(row["pdserve_seconds"]) == 1
    assert row["speedup"] > 0 and row["pdserve_output_tok_per_s"] > 0
    analysis = data["analysis"][row["model"]]
    assert analysis["decode_step_ms_median"] > 0 and analysis["prefill_step_ms"] > 0
    assert analysis["bandwidth"]["read_GBps"] > 0
    decode = analysis["decode_breakdown_ms_self_cpu"]
    # Matmuls are aten ops, or C calls (decode_step, skinny_gemm) that land outside them.
    assert decode["matmul"] + decode["outside_aten_ops"] > 0
    assert decode["profiled_step_wall"] >= decode["sum_of_ops"] > 0
    from pdserve.kernels import decode_step

    if decode_step.available():  # the C step's own phase times, and the rates they give
        phases = analysis["decode_kernel_phases_ms"]
        assert phases["steps"] >= 3 and set(phases["work"]) == set(decode_step.PHASES)
        assert all(v >= 0 for v in phases["work"].values()) and phases["work"]["gate_up"] > 0
        assert analysis["decode_kernel_matmul_GBps"] > 0
