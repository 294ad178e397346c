"""Cluster simulator (`pdserve simulate`): the project's real scheduler, block pool and
step-kind votes on virtual time, one simulated rank per engine, with step costs from a
fitted model, the router's own routing functions and a hand-off cost model."""
