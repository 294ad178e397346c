"""bench/decode_matmul.py on the tiny model (a smoke run, not a measurement)."""

from __future__ import annotations

import json


def test_decode_matmul_bench_times_every_layout_on_the_models_weights(tiny_model_dir, tmp_path):
    import torch

    from pdserve.bench.decode_matmul import decode_weights, main
    from pdserve.engine.model.llama import load_model
    from pdserve.kernels import skinny_gemm

    out = tmp_path / "dm.json"
    threads = torch.get_num_threads()
    try:
        main(["--model-dir", tiny_model_dir, "--rows", "3", "16", "--rounds", "2",
              "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    data = json.loads(out.read_text())
    _, model = load_model(tiny_model_dir)
    weights, quant = decode_weights(model)
    assert quant is None  # a folder model's matmuls are fp32
    cfg = model.cfg
    assert len(weights) == 4 * cfg.num_layers + 1  # qkv, o, gate|up, down per layer + head
    assert data["weight_bytes"] == sum(w.numel() * 4 for w in weights)
    want = {"linear", "transposed"} | ({"skinny_gemm"} if skinny_gemm.available() else set())
    for rows in ("3", "16"):
        cells = data["rows"][rows]
        assert want <= set(cells)
        assert all(c["best_ms"] > 0 and c["median_ms"] >= c["best_ms"] for c in cells.values())
        # the best torch layout of each round is 1.0 against itself, never below
        assert min(c["over_best_torch_layout_median"] for n, c in cells.items()
                   if n != "skinny_gemm") >= 1.0


def test_decode_matmul_bench_adds_a_quantized_files_panels(real_model_path, tmp_path):
    import torch

    from pdserve.bench.decode_matmul import main

    out = tmp_path / "dm.json"
    threads = torch.get_num_threads()
    try:
        main(["--model-dir", real_model_path, "--rows", "2", "--rounds", "1", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    cells = json.loads(out.read_text())["rows"]["2"]
    assert {"linear", "quant_panels"} <= set(cells)
    assert cells["quant_panels"]["best_ms"] > 0
