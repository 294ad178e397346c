from pdserve.simulator.clock import Clock


def test_events_run_in_time_order_ties_in_scheduling_order():
    clock, seen = Clock(), []
    clock.at(2.0, seen.append, "c")
    clock.at(1.0, seen.append, "a")
    clock.at(1.0, seen.append, "b")
    clock.at(1.0, lambda: clock.at(0.5, seen.append, "late"))  # never before now
    clock.run()
    assert seen == ["a", "b", "late", "c"]
    assert clock.now == 2.0
