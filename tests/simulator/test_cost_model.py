import random

from pdserve.simulator.cost_model import (
    CostModel,
    DecodeStepCost,
    PromptStepCost,
    fit_decode,
    fit_handoff,
    fit_prompt,
)


def test_prompt_fit_recovers_known_coefficients():
    true = PromptStepCost(0.003, 4e-5, 2e-8, 5e-9)
    rng = random.Random(1)
    samples = []
    for _ in range(60):
        rows = [(rng.randint(1, 1024), rng.choice([0, 256, 1024])) for _ in range(rng.randint(1, 4))]
        samples.append((rows, true.seconds(rows)))
    got = fit_prompt(samples)
    for name in ("a", "b", "d", "e"):
        assert abs(getattr(got, name) - getattr(true, name)) <= 1e-3 * getattr(true, name), name


def test_decode_and_handoff_fits_recover_known_coefficients():
    true = DecodeStepCost(0.005, 2e-4, 3e-7)
    samples = [(r, c, true.seconds(r, c)) for r in (1, 8, 32, 64) for c in (32, 5000, 90000)]
    got = fit_decode(samples)
    assert abs(got.a - 0.005) < 1e-6 and abs(got.b - 2e-4) < 1e-8 and abs(got.c - 3e-7) < 1e-11
    h = fit_handoff([(n, 0.004 + 1e-9 * n) for n in (1e5, 1e6, 1e7, 1e8)])
    assert abs(h.a - 0.004) < 1e-6 and abs(h.b - 1e-9) < 1e-13


def test_fit_keeps_coefficients_non_negative():
    # cost falls with rows: the unconstrained slope would be negative
    got = fit_decode([(1, 0, 0.010), (8, 0, 0.009), (64, 0, 0.008), (32, 0, 0.0085)])
    assert min(got.a, got.b, got.c) >= 0


def test_builtin_model_loads_and_round_trips(tmp_path):
    model = CostModel.load()
    assert model.prompt.seconds([(128, 0)]) > model.prompt.seconds([(16, 0)]) > 0
    assert model.decode.seconds(64, 64 * 512) > model.decode.seconds(1, 32) > 0
    assert CostModel.load(model.save(tmp_path / "m.json")) == model
