import argparse

from pdserve.simulator.plan import placements, search_rate, serve_command


def test_rate_search_finds_the_threshold():
    best, tried = search_rate(lambda rate: rate <= 37.0, start=1.0, steps=10)
    assert 36.9 < best <= 37.0
    assert all(ok == (rate <= 37.0) for rate, ok in tried)
    assert search_rate(lambda rate: False, 1.0, 5)[0] == 0.0


def test_placements_cover_every_split_and_normal():
    names = [p.name for p in placements(4)]
    assert names == ["1P+3D", "2P+2D", "3P+1D", "normal x4"]
    assert all(p.ranks == 4 for p in placements(4))


def test_the_best_placement_becomes_a_serve_command_the_cli_accepts():
    from pdserve.cli import build_parser
    from pdserve.router.serve_command import serve_config

    args = argparse.Namespace(slo_ttft_ms=800.0, slo_itl_ms=60.0)
    split = serve_command({"mode": "disaggregated", "prefill": 2, "decode": 3}, args)
    assert split == ("pdserve serve --prefill 2 --decode 3 --autoscale --slo-ttft-ms 800 "
                     "--slo-itl-ms 60 --min-prefill 2 --max-prefill 4 --min-decode 3 "
                     "--max-decode 6")
    p = build_parser()
    config = serve_config(p.parse_args(split.split()[1:]))
    assert (config.prefill.replicas, config.decode.replicas, config.autoscale) == (2, 3, True)
    assert (config.min_decode, config.max_decode, config.slo_ttft_ms) == (3, 6, 800.0)
    normal = serve_command({"mode": "normal", "replicas": 4}, args)
    config = serve_config(p.parse_args(normal.split()[1:]))
    assert config.mode == "normal" and config.normal.replicas == 4
