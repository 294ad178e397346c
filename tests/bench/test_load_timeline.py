"""`bench serve --rate-schedule` and the pool timeline: the schedule's arithmetic on its
own, then a real run against the session's router (sampled over gRPC, drawn)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pdserve.bench.load_timeline import RateSchedule, attainment_bins
from pdserve.bench.serve_metrics import RequestRecord


@pytest.mark.parametrize("text, words", [
    ("60", "SECONDS:RATE"), ("a:1", "SECONDS:RATE"), ("10:x", "SECONDS:RATE"),
    ("0:1", "seconds must be > 0"), ("10:-1", "rate must be >= 0"), ("10:inf", "finite"),
    ("10:0,20:0", "nothing would be sent"), ("100000:1", "over the 86400 s limit"),
    ("60:6000", "over the 200000 limit")])
def test_a_bad_schedule_is_refused_naming_the_flag(text, words):
    with pytest.raises(ValueError, match="--rate-schedule") as err:
        RateSchedule.parse(text)
    assert words in str(err.value)


def test_sends_stay_inside_their_steps_and_follow_each_rate():
    s = RateSchedule.parse("200:2, 100:0, 200:10")
    assert s.total_s == 500 and s.rate_at(250) == 0 and s.rate_at(499.9) == 10
    assert s.rate_at(500) == 0
    offsets = s.offsets(seed=3)
    assert offsets == s.offsets(seed=3) and offsets != s.offsets(seed=4)
    assert offsets == sorted(offsets)
    first = [t for t in offsets if t < 200]
    last = [t for t in offsets if t >= 300]
    assert not [t for t in offsets if 200 <= t < 300]
    assert len(first) + len(last) == len(offsets) and max(offsets) < 500
    # Poisson counts: 400 and 2000 expected, 5 standard deviations either way
    assert abs(len(first) - 400) < 5 * 20 and abs(len(last) - 2000) < 5 * 45


def test_a_step_drawing_more_than_one_batch_keeps_its_rate():
    """0.1/s for 100 s draws 10 on average, in batches of 16: counts above 16 need a
    second batch; the mean over many seeds stays 10, bursty or not."""
    for burstiness in (1.0, 0.2):
        counts = [len(RateSchedule.parse("100:0.1").offsets(burstiness, seed))
                  for seed in range(400)]
        assert max(counts) > 16
        assert abs(np.mean(counts) - 10) < 0.2 * 10 / burstiness ** 0.5


def _record(send, ttft, tpot, ok=True):
    r = RequestRecord(prompt_len=4, send_time=send)
    if ok:
        r.chunk_times = [send + ttft, send + ttft + tpot, send + ttft + 2 * tpot]
        r.chunk_tokens = [1, 1, 1]
        r.finish_reason = "length"
    else:
        r.error = "UNAVAILABLE: no rank"
    return r


def test_attainment_counts_what_met_every_objective_per_bin():
    start = 100.0
    records = [_record(100.1, 0.2, 0.01), _record(100.9, 2.0, 0.01),  # bin 0: 1 of 2
               _record(101.5, 0.1, 0.5), _record(101.6, 0.1, 0.01, ok=False),  # bin 1: 0 of 2
               _record(103.2, 0.1, 0.01)]  # bin 3 (bin 2 empty)
    bins = attainment_bins(records, start, 1.0, {"ttft": 1000.0, "tpot": 100.0})
    assert [(b["sent"], b["met"], b["failed"]) for b in bins] == [(2, 1, 0), (2, 0, 1),
                                                                  (0, 0, 0), (1, 1, 0)]
    assert [b["attainment"] for b in bins] == [0.5, 0.0, None, 1.0]
    assert bins[0]["rate"] == 2.0
    assert all(b["attainment"] is None for b in attainment_bins(records, start, 1.0, {}))


def test_cli_rate_schedule_samples_and_draws_the_pools(router_address, tiny_model_dir,
                                                       tmp_path):
    from pdserve.bench.serve import main as serve_main

    out, png = tmp_path / "sched.json", tmp_path / "steps.png"
    rc = serve_main(["--address", router_address, "--model", tiny_model_dir,
                     "--rate-schedule", "1.5:6,1.5:0", "--sample-interval", "0.25",
                     "--random-input-len", "16", "--random-output-len", "3", "--seed", "5",
                     "--goodput", "ttft:60000", "--disable-tqdm", "--no-plot",
                     "--result-file", str(out), "--timeline", str(png)])
    assert rc == 0
    r = json.loads(out.read_text())
    planned = RateSchedule.parse("1.5:6,1.5:0").offsets(1.0, 5)
    assert r["num_prompts"] == r["completed"] == len(planned) > 0
    assert max(r["send_offsets"]) < 1.5 + 0.5
    tl = r["pool_timeline"]
    samples = tl["samples"]
    # the run lasts the schedule's 3 s: the quiet end is watched too
    assert samples[-1]["t"] >= 2.5 and len(samples) >= 6
    assert all(s["ready"] == {"prefill": 1, "decode": 1} for s in samples)
    assert all(s["target"] == {"prefill": 1, "decode": 1} for s in samples)
    assert tl["objectives_ms"] == {"ttft": 60000.0}
    assert sum(b["sent"] for b in tl["bins"]) == len(planned)
    assert all(b["attainment"] in (None, 1.0) for b in tl["bins"])
    assert tl["schedule"] == [{"duration_s": 1.5, "rate": 6.0}, {"duration_s": 1.5, "rate": 0.0}]
    assert tl["planner"]["enabled"] is False and tl["planner"]["decisions"] == []
    assert (tmp_path / "steps_pools.png").stat().st_size > 10_000


def test_cli_refuses_a_schedule_with_a_rate():
    from pdserve.bench.serve import main as serve_main

    with pytest.raises(SystemExit, match="drop --request-rate"):
        serve_main(["--address", "127.0.0.1:1", "--vocab-size", "100",
                    "--rate-schedule", "1:1", "--request-rate", "4"])
