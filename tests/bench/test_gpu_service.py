"""The service check of `scripts/gpu_check.py --service` (bench/gpu_service.py), run on
the CPU: a random-weight model served 1P+1D by `pdserve serve` through Ray gives the
offline engine's greedy tokens, and the summary carries the hand-off and the load's
TTFT and ITL per concurrency. On a GPU only the shape and the device change."""

from __future__ import annotations


def test_the_service_check_runs_end_to_end_on_the_cpu():
    from pdserve.bench.gpu_service import service_check

    summary = service_check("cpu", "cpu-smoke", streams=(1, 4), per_stream=2, prompt_len=32,
                            out=8, greedy_prompts=3)
    assert summary["greedy_equal_offline"] and summary["greedy_equal"] == [True] * 3
    assert summary["handoff_ms"] > 0 and summary["kv_bytes"] > 0  # KV crossed ranks
    # every request's hand-off, by its path (ray on CPUs; cuda_ipc on one GPU)
    assert set(summary["kv_paths"]) == {"ray"}
    assert summary["kv_paths"]["ray"] >= 3 + sum(2 * s for s in (1, 4))
    assert [row["streams"] for row in summary["load"]] == [1, 4]
    for row in summary["load"]:
        assert row["requests"] == 2 * row["streams"]
        assert row["ttft_ms_median"] > 0 and row["itl_ms_median"] > 0 and row["output_tok_s"] > 0


def test_gpu_check_takes_the_service_flags(repo_module, monkeypatch):
    check = repo_module("scripts/gpu_check.py")
    monkeypatch.setattr("sys.argv", ["gpu_check.py", "--service", "--device", "cpu",
                                     "--streams", "1,2", "--no-transport"])
    args = check._parse_args()
    assert args.service and args.streams == "1,2" and args.no_transport
