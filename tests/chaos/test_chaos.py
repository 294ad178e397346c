"""The chaos suite: seeded scenarios (bench/chaos.py) on both KV transports, each
followed by the invariants: every request ended exactly once, greedy tokens equal the
offline engine's, nothing left on any rank or in the router, pools back at size."""

from __future__ import annotations

import pytest

from pdserve.bench import chaos

# Seeds chosen so that each transport sees every kind of event exactly twice and every
# action (the whole seeded space is `python bench/chaos.py --scenarios 300`'s): each
# scenario costs ~5 s of the suite's 15 minutes.
SEEDS = [100, 101, 102, 103, 104, 105, 106, 107, 108, 111]


def test_the_seeds_cover_every_event():
    events = [chaos.make_scenario(s).event for s in SEEDS]
    for event in set(chaos.EVENTS):
        assert events.count(event) >= 2, (event, events)
    actions = [r.action for s in SEEDS for r in chaos.make_scenario(s).requests]
    assert set(actions) == set(chaos.ACTIONS)


@pytest.mark.parametrize("seed", SEEDS)
def test_scenario(chaos_router, reference, seed):
    plan = chaos.make_scenario(seed)
    result = chaos_router.call(chaos.run_scenario(chaos_router, reference, plan,
                                                  chaos_router.transport, chaos_router.sizes),
                               timeout=240)
    assert result.ok, f"seed {seed} ({plan.event}): " + "\n".join(result.problems)
