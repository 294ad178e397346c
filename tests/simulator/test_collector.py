import argparse
import gc

from pdserve.simulator.cli import add_args
from pdserve.simulator.cluster import Cluster, SimConfig
from pdserve.simulator.collector import collector_paused
from pdserve.simulator.workload import workload_of


def test_pause_restores_the_collector_state():
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_run_leaves_no_cyclic_garbage(costs):
    # The run pauses the collector (collector.py): that is only free if what a run
    # drops is freed by reference counting, i.e. requests leave no cycles behind.
    p = argparse.ArgumentParser()
    add_args(p)
    args = p.parse_args(["--vocab-size", "4096", "--num-prompts", "200", "--request-rate",
                         "100", "--random-output-len", "8"])
    gc.collect()
    cluster = Cluster(SimConfig(prefill=2, decode=2), costs)
    sim = cluster.run(workload_of(args))
    assert len(sim.records) == 200
    # With the cluster alive: what the run dropped (its closures), not a cycle a request
    assert gc.collect() < 50  # made (400 requests leave the same 9 objects as 100)
