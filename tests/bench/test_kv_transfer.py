"""KV hand-off bandwidth through the router's real transports, on small payloads."""

from __future__ import annotations

import json

import pytest

from pdserve.bench import kv_transfer
from pdserve.bench.kv_handoff_share import format_share
from pdserve.bench.kv_payload_rank import BLOCK_BYTES, PayloadRank


def test_the_stand_in_ranks_move_real_kv_blocks_and_notice_a_change():
    src, dst = PayloadRank("in_process"), PayloadRank("in_process")
    ticket, took, sent = src.export("req-7", 40 * BLOCK_BYTES, "in_process")
    assert took > 0 and ticket.nbytes > 40 * BLOCK_BYTES  # the blocks plus the header
    payload = src.endpoint.get("req-7")
    assert dst.import_prefilled(payload).ok
    assert dst.checksum("req-7") == sent  # the blocks it scattered are the ones gathered
    changed = bytearray(payload)
    changed[-5] ^= 0xFF  # a byte of the last block
    assert dst.import_prefilled(changed).ok
    assert dst.checksum("req-7") != sent
    assert not dst.import_prefilled(b"not a payload").ok


def test_both_transports_beside_memcpy(ray_session, tmp_path):
    out = tmp_path / "kv.json"
    rc = kv_transfer.main(["--sizes", "0.25,1", "--repeats", "1", "--prompt-tokens", "none",
                           "--result-file", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["sizes_mib"] == [0.25, 1.0]
    assert r["copy_threads"] == 2  # an engine's default kv_copy_threads
    bw = r["bandwidth_mib_s"]
    assert set(bw) == {"memcpy", "memcpy_alloc", "ray_deliver", "ray_handoff", "grpc_deliver",
                       "grpc_handoff", "grpc_ceiling"}
    for name, values in bw.items():
        assert len(values) == 2 and all(v > 0 for v in values), name
    for name, ratios in r["ratio_to_memcpy"].items():
        assert ratios == pytest.approx([b / m for b, m in zip(bw[name], bw["memcpy"], strict=True)])
    # The hand-off adds the export to the delivery: never faster than delivery alone.
    for t in ("ray", "grpc"):
        assert all(h <= d * 1.0001 for h, d in zip(bw[f"{t}_handoff"], bw[f"{t}_deliver"],
                                                   strict=True))
    assert "grpc_ceiling" in kv_transfer.format_table(r)  # gRPC alone, beside the transport
    # one node: every ray payload was mapped from the sender's segment (2 sizes x the
    # warm-ups and the timed run)
    assert r["import_paths"]["ray"] == {"shared memory": 2 * (kv_transfer.WARMUPS + 1),
                                        "object": 0}
    assert len(r["seconds"]["grpc_ceiling"]) == 2 and all(len(s) == 1 for s in r["seconds"]["grpc_ceiling"])
    assert (tmp_path / "kv.png").stat().st_size > 10_000
    assert ray_session.is_initialized()  # the session's Ray was reused, not shut down


def test_across_nodes_on_one_node_is_refused_with_the_reason(ray_session, tmp_path, capsys):
    rc = kv_transfer.main(["--sizes", "1", "--repeats", "1", "--transports", "ray",
                           "--across-nodes", "--prompt-tokens", "none", "--no-plot",
                           "--result-file", str(tmp_path / "r.json")])
    assert rc == 1
    assert "--across-nodes needs a Ray cluster of two nodes or more" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_the_hand_off_share_through_two_services(ray_session, tmp_path):
    out = tmp_path / "share.json"
    rc = kv_transfer.main(["--sizes", "0.25", "--repeats", "1", "--transports", "ray",
                           "--prompt-tokens", "160", "--chunk-tokens", "32",
                           "--share-repeats", "1", "--no-plot", "--result-file", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["copies"]["ray"]["shared memory (one node)"] == 2
    share = r["handoff_share"]
    streamed, whole = share["modes"]["streamed"], share["modes"]["whole"]
    # 160 tokens in steps of 32: the last step's 2 blocks go with the hand-off, not 10
    assert 0 < streamed["kv_bytes"][0] < 0.4 * whole["kv_bytes"][0]
    for rows in (streamed, whole):
        assert 0 < rows["ttft_s"][0] < rows["ttst_s"][0]
        assert 0 < rows["handoff_share_of_ttst"][0] < 1
        assert rows["export_s"][0] > 0 and rows["deliver_s"][0] > 0
        # the span holds the export, then the report and the import (the router's delivery
        # also holds the import's answer coming back, which the span does not)
        assert rows["handoff_s"][0] > rows["export_s"][0]
    assert "/ its deliver alone" in format_share(share)
    assert len(streamed["requests"][0]) == 1 and streamed["requests"][0][0]["kv_bytes"] > 0
