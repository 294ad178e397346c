import argparse
import json

from pdserve.bench.serve_report import format_summary
from pdserve.simulator.cli import add_args, sim_config
from pdserve.simulator.cluster import Cluster, SimConfig
from pdserve.simulator.metrics import simulated_summary
from pdserve.simulator.workload import workload_of


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_args(p)
    return p.parse_args(["--vocab-size", "4096", *argv])


def simulate(costs, *argv: str, **config):
    args = parse(*argv)
    cfg = sim_config(args) if not config else SimConfig(**config)
    return Cluster(cfg, costs).run(workload_of(args))


def test_same_seed_same_results(costs):
    argv = ("--prefill", "2", "--num-prompts", "60", "--request-rate", "30",
            "--random-range-ratio", "0.5")
    a, b = simulate(costs, *argv), simulate(costs, *argv)
    assert [(r.send_time, r.chunk_times, r.finish_reason) for r in a.records] == \
        [(r.send_time, r.chunk_times, r.finish_reason) for r in b.records]
    c = simulate(costs, *argv, "--seed", "1")
    assert [r.chunk_times for r in a.records] != [r.chunk_times for r in c.records]


def test_one_request_timing_worked_by_hand(costs):
    # 1P+1D, one 128-token prompt, 4 tokens: a prompt step (0.002 + 128 * 2e-5), the
    # hand-off (0.003), then 3 decode steps of one row (0.004 + 1e-4 each).
    sim = simulate(costs, "--num-prompts", "1", "--random-input-len", "128",
                   "--random-output-len", "4")
    (rec,) = sim.records
    prompt_s = 0.002 + 128 * 2e-5
    assert abs(rec.ttft - prompt_s) < 1e-9
    assert rec.finish_reason == "length" and rec.output_len == 4
    gaps = rec.itls
    assert abs(gaps[0] - (0.003 + 0.0041)) < 1e-9
    assert all(abs(g - 0.0041) < 1e-9 for g in gaps[1:])


def test_ttft_grows_with_the_arrival_rate(costs):
    p90 = []
    for rate in ("20", "80", "200", "inf"):
        sim = simulate(costs, "--prefill", "2", "--num-prompts", "120", "--request-rate", rate,
                       "--random-input-len", "512", "--random-output-len", "8")
        r = simulated_summary(sim, percentiles=[90])
        assert r["completed"] == 120
        p90.append(r["p90_ttft_ms"])
    assert p90 == sorted(p90) and p90[-1] > 3 * p90[0]


def test_full_kv_pool_preempts_and_everything_is_freed(costs):
    # 10 decode blocks of 16 (9 usable): 4 requests of 32 + 40 tokens cannot all grow
    # there; COMPLETION engines stop preempted requests (S30, stop_preempted_request).
    cluster = Cluster(SimConfig(engine={"num_kv_blocks": 10, "enable_prefix_caching": False}),
                      costs)
    args = parse("--num-prompts", "4", "--random-input-len", "32", "--random-output-len", "40")
    sim = cluster.run(workload_of(args))
    reasons = sorted(r.finish_reason for r in sim.records)
    assert "insufficient_system_resource" in reasons and "length" in reasons
    assert sim.stats["pools"]["decode"]["preemptions"] == reasons.count(
        "insufficient_system_resource")
    for pool in cluster.pools:
        for rank in pool.ranks:
            assert not rank.has_work()
            rank.scheduler.assert_drained()  # S35


def test_summary_has_bench_serve_fields(costs):
    sim = simulate(costs, "--num-prompts", "10", "--request-rate", "50")
    r = simulated_summary(sim, slos={"ttft": 1000.0}, percentiles=[50, 99])
    for key in ("completed", "failed", "duration", "request_throughput", "output_throughput",
                "total_token_throughput", "request_goodput", "mean_ttft_ms", "median_ttft_ms",
                "p99_ttft_ms", "mean_tpot_ms", "p99_itl_ms", "median_e2el_ms", "ttfts", "itls",
                "input_lens", "output_lens"):
        assert key in r, key
    assert r["completed"] == 10 and r["request_goodput"] > 0
    assert "Serving Benchmark Result" in format_summary(r)
    assert "itls" not in simulated_summary(sim, summary_only=True)


def test_normal_mode_runs_the_votes(costs):
    sim = simulate(costs, "--mode", "normal", "--replicas", "2", "--num-prompts", "40",
                   "--request-rate", "100")
    assert all(r.success for r in sim.records)
    assert sim.stats["pools"]["normal"]["empty_rank_steps"] > 0  # idle ranks step along


def test_least_loaded_spreads_prompts(costs):
    cluster = Cluster(SimConfig(prefill=4, routing="least_loaded"), costs)
    cluster.run(workload_of(parse("--num-prompts", "8", "--request-rate", "inf")))
    assert [r.assigned for r in cluster.entry.ranks] == [2, 2, 2, 2]


def test_cli_smoke(tmp_path):
    from pdserve.cli import main

    out = tmp_path / "sim.json"
    assert main(["simulate", "--prefill", "2", "--decode", "1", "--num-prompts", "20",
                 "--request-rate", "40", "--vocab-size", "4096", "--disable-tqdm",
                 "--result-file", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["completed"] == 20 and r["failed"] == 0
    assert r["mean_ttft_ms"] > 0 and r["mean_itl_ms"] > 0 and len(r["ttfts"]) == 20
    assert r["simulation"]["pools"]["prefill"]["ranks"] == 2
