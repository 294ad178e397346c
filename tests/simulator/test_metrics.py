"""The simulator's summary (numpy over the client log's columns) is bench serve's
``summarize`` of the same requests as ``RequestRecord``s, field for field."""

import argparse
import math

import pytest

from pdserve.bench.serve_client import Run
from pdserve.bench.serve_report import summarize
from pdserve.simulator.cli import add_args, sim_config
from pdserve.simulator.cluster import Cluster
from pdserve.simulator.metrics import PER_REQUEST_KEYS, simulated_summary
from pdserve.simulator.workload import workload_of

SUMMARY_ARGS = dict(label="x", request_rate=300.0, burstiness=1.0, max_concurrency=None,
                    seed=0, percentiles=[50, 90, 99, 99.9])


def run(costs, *argv: str):
    p = argparse.ArgumentParser()
    add_args(p)
    args = p.parse_args(["--vocab-size", "4096", *argv])
    return Cluster(sim_config(args), costs).run(workload_of(args))


def bench_serve_summary(sim, slos) -> dict:
    """What the simulator's summary used to be: summarize over RequestRecords."""
    r = summarize([Run(sim.records, start=0.0, duration=sim.duration)], address="simulated",
                  slos=slos, **SUMMARY_ARGS)
    r["backend"] = "pdserve-simulated"
    r["simulation"] = sim.stats
    return r


def assert_same(got, want, path="result"):
    """Equal structure, counts and strings; floats within float tolerance."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), path
        for key in want:
            if key != "date":
                assert_same(got[key], want[key], f"{path}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{path}[{i}]")
    elif isinstance(want, float):
        assert isinstance(got, float) and math.isclose(got, want, rel_tol=1e-12,
                                                       abs_tol=1e-12), (path, got, want)
    else:
        assert type(got) is type(want) and got == want, (path, got, want)


@pytest.mark.parametrize("argv, slos", [
    # two kinds, a tight decode pool (preempted requests fail), goodput SLOs
    (("--prefill", "2", "--decode", "2", "--num-prompts", "160", "--request-rate", "300",
      "--dataset-name", "mixed", "--num-kv-blocks", "80", "--random-range-ratio", "0.5"),
     {"ttft": 40.0, "tpot": 20.0, "e2el": 900.0}),
    # conversations (turns wait for the last one) under a concurrency cap, normal mode
    (("--mode", "normal", "--replicas", "2", "--num-prompts", "60", "--request-rate", "inf",
      "--dataset-name", "prefix", "--prefix-system-len", "64", "--max-concurrency", "8"),
     None),
])
def test_summary_is_bench_serves(costs, argv, slos):
    sim = run(costs, *argv)
    got = simulated_summary(sim, slos=slos, **SUMMARY_ARGS)
    assert_same(got, bench_serve_summary(sim, slos))
    if "mixed" in argv:
        assert 0 < got["failed"] < got["num_prompts"] and len(got["by_kind"]) == 2


def test_summary_only_drops_every_per_request_list(costs):
    sim = run(costs, "--prefill", "2", "--num-prompts", "40", "--request-rate", "200")
    full = simulated_summary(sim, **SUMMARY_ARGS)
    short = simulated_summary(sim, summary_only=True, **SUMMARY_ARGS)
    assert set(full) - set(short) == set(PER_REQUEST_KEYS)
    assert not any(isinstance(v, list) and len(v) == 40 for v in short.values())
    assert_same(short, {k: v for k, v in full.items() if k not in PER_REQUEST_KEYS})
