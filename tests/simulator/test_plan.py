from pdserve.simulator.plan import placements, search_rate


def test_rate_search_finds_the_threshold():
    best, tried = search_rate(lambda rate: rate <= 37.0, start=1.0, steps=10)
    assert 36.9 < best <= 37.0
    assert all(ok == (rate <= 37.0) for rate, ok in tried)
    assert search_rate(lambda rate: False, 1.0, 5)[0] == 0.0


def test_placements_cover_every_split_and_normal():
    names = [p.name for p in placements(4)]
    assert names == ["1P+3D", "2P+2D", "3P+1D", "normal x4"]
    assert all(p.ranks == 4 for p in placements(4))
