"""KV hand-off bandwidth through the router's real transports, on small payloads."""

from __future__ import annotations

import json

import pytest
from pdserve.bench import kv_transfer
from pdserve.bench.kv_transfer import HEADER, STRIDE, check_payload, make_payload


def test_payload_is_checked_end_to_end():
    p = make_payload("req-7", 1 << 16)
    framing = len(p) - (1 << 16)  # the KV payload prefix and header around the body
    assert 0 < framing < 128 and check_payload(p) == "req-7"
    from pdserve.kv_transfer.grpc_bytes import peek_header

    assert peek_header(p) == ("req-7", len(p))  # what the gRPC KV service checks
    bad = bytearray(p)
    bad[framing + HEADER + 3 * STRIDE] ^= 0xFF
    with pytest.raises(ValueError, match="checksum"):
        check_payload(bytes(bad))
    with pytest.raises(ValueError, match="arrived"):
        check_payload(p[:-1])
    with pytest.raises(ValueError):
        check_payload(b"not a payload" * 10)


def test_both_transports_beside_memcpy(ray_session, tmp_path):
    out = tmp_path / "kv.json"
    rc = kv_transfer.main(["--sizes", "0.25,1", "--repeats", "1", "--result-file", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["sizes_mib"] == [0.25, 1.0]
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
    assert len(r["seconds"]["grpc_ceiling"]) == 2 and all(len(s) == 1 for s in r["seconds"]["grpc_ceiling"])
    assert (tmp_path / "kv.png").stat().st_size > 10_000
    assert ray_session.is_initialized()  # the session's Ray was reused, not shut down
