"""The committed generated code equals a fresh regeneration, and imports as pdserve.rpc."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_regenerating_changes_nothing(repo_module, tmp_path):
    gen = repo_module("protos/generate.py")
    fresh = gen.generate(tmp_path)
    assert {p.name for p in fresh} >= {"router_pb2.py", "router_pb2_grpc.py", "router_pb2.pyi"}
    for path in fresh:
        committed = REPO / "protos" / "pdserve" / "rpc" / path.name
        assert committed.exists(), f"{path.name} is not committed; run protos/generate.py"
        assert committed.read_bytes() == path.read_bytes(), (
            f"{path.name} differs from a fresh generation; run protos/generate.py"
        )


def test_generated_code_imports_as_pdserve_rpc():
    from pdserve.rpc import router_pb2, router_pb2_grpc

    req = router_pb2.GenerateRequest(text="hello", max_tokens=4)
    assert req.WhichOneof("prompt") == "text"
    assert req.HasField("max_tokens") and not req.HasField("temperature")
    assert hasattr(router_pb2_grpc, "RouterServicer")
    names = {m.name for m in router_pb2.DESCRIPTOR.services_by_name["Router"].methods}
    assert names == {"Generate", "Abort", "GetClusterState", "ScalePool", "GetTimeline"}
