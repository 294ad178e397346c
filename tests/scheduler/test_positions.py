"""Section 8: positions and sliding-window ring destinations (S36, S37)."""

from __future__ import annotations

from pdserve.scheduler import EngineType, query_positions, ring_destinations


def test_s36_seqlen_k_counts_processed_in_flight_and_query(kit):
    s = kit.sched(max_num_batched_tokens=16, max_num_seqs=8)
    a = kit.seq("A", 20)
    s.add(a)
    out = s.schedule()
    row = out.scheduled[0]
    assert (row.query_len, row.seqlen_k, row.positions) == (16, 16, range(0, 16))
    s.process_outputs(out, [None])
    row = s.schedule().scheduled[0]
    assert (row.query_len, row.seqlen_k, row.positions) == (4, 20, range(16, 20))

    d = kit.sched(EngineType.COMPLETION)
    b = kit.running(d, "B", 6, 1)  # processed 6
    first = d.schedule().scheduled[0]
    second = d.schedule().scheduled[0]  # overlapped: the first step is still in flight
    assert (first.seqlen_k, second.seqlen_k) == (7, 8)
    assert second.positions == range(7, 8) and b.in_flight == 2
    assert query_positions(8, 1) == range(7, 8)


def test_s37_worked_example_300_token_prompt(kit):
    s = kit.sched(block_size=128, num_blocks=8, num_state_slots=4, max_model_len=512,
                  max_num_batched_tokens=128, max_num_seqs=4)
    s.states.allocate(1)  # slot 1 is taken, so the request gets slot 2
    a = kit.seq("A", 300)
    s.add(a)
    chunks = []
    while a.processed < 300:
        out, _ = kit.step(s)
        row = out.scheduled[0]
        chunks.append((a.processed - row.query_len, row.query_len, row.seqlen_k))
        if len(chunks) == 1:
            assert len(a.block_table) == 3  # ceil(300 / 128) at first admission
        if len(chunks) == 2:
            second = ring_destinations(row.seqlen_k, row.query_len, a.state_slot, s.config.ring_len)
    assert a.state_slot == 2
    assert chunks == [(0, 128, 128), (128, 128, 256), (256, 44, 300)]
    assert second[0] == 396 and second[6] == 268
    assert second == [268 + (128 + j) % 134 for j in range(128)]


def test_s37_only_the_last_ring_positions_of_a_long_chunk_are_kept():
    dest = ring_destinations(200, 200, 1, 134)
    assert dest[:66] == [-1] * 66
    assert dest[66:] == [134 + p % 134 for p in range(66, 200)]
    assert len(set(dest[66:])) == 134  # the kept rows fill the ring exactly once
    assert ring_destinations(10, 3, 0, 4) == [3, 0, 1]
