"""The grpc KV service authenticates every transfer (kv_transfer/grpc/).

Most tests build a ``GrpcEndpoint`` in this process with a fake importer and talk to it
over real gRPC; the last ones go through a real router with ``kv_transport="grpc"``.
"""

from __future__ import annotations

import pickle
import struct
import threading
import time

import grpc
import msgpack
import pytest

from pdserve.engine.kv.payload import VERSION
from pdserve.kv_transfer import make_transport
from pdserve.kv_transfer.base import KVSecret
from pdserve.kv_transfer.grpc.endpoint import GrpcEndpoint
from pdserve.kv_transfer.grpc.transport import GrpcBytesTransport
from pdserve.kv_transfer.grpc.wire import (
    ATTEMPT_KEY,
    AUTH_KEY,
    CHANNEL_OPTIONS,
    EXPIRES_KEY,
    FETCH,
    PUSH,
    auth_metadata,
)
from pdserve.rank.messages import ImportResult
from pdserve.rpc import kv_transfer_pb2 as pb
from pdserve.rpc import kv_transfer_pb2_grpc as pb_grpc

LIMIT = 64 << 10  # the in-process endpoint's push limit
CHUNK_TIMEOUT_S = 0.5
STREAM_TIMEOUT_S = 3.0


def fake_payload(attempt: str, tensor_bytes: int = 256) -> bytes:
    """A KV payload's framing (engine/kv/payload.py) with just the fields the endpoint
    reads before it hands the bytes on: the attempt and the size."""
    header = msgpack.packb({"attempt": attempt, "tensor_bytes": tensor_bytes},
                           use_bin_type=True)
    return struct.pack("<4sHI", b"PDKV", VERSION, len(header)) + header + b"\x07" * tensor_bytes


class FakeImporter:
    def __init__(self) -> None:
        self.imported: list[tuple[str, int]] = []
        self.lock = threading.Lock()

    def import_prefilled(self, data: bytes) -> ImportResult:
        header_len = struct.unpack("<4sHI", data[:10])[2]
        attempt = msgpack.unpackb(data[10:10 + header_len])["attempt"]
        with self.lock:
            self.imported.append((attempt, len(data)))
        return ImportResult(True, attempt=attempt)


@pytest.fixture(scope="module")
def secret():
    return KVSecret.generate()


@pytest.fixture(scope="module")
def endpoint(secret):
    ep = GrpcEndpoint(FakeImporter(), "127.0.0.1", secret, max_push_bytes=LIMIT,
                      chunk_timeout_s=CHUNK_TIMEOUT_S, stream_timeout_s=STREAM_TIMEOUT_S)
    yield ep
    ep.close()


@pytest.fixture(scope="module")
def stub(endpoint):
    channel = grpc.insecure_channel(endpoint.address, options=CHANNEL_OPTIONS)
    yield pb_grpc.KVTransferStub(channel)
    channel.close()


_seq = iter(range(10**9))


def fresh(name: str = "a") -> str:
    return f"{name}{next(_seq)}.1"


def push(stub, chunks, metadata, timeout: float = 20.0):
    """The reply's attempt, or (status code, details)."""
    try:
        return stub.Push(iter(chunks), metadata=metadata, timeout=timeout).attempt
    except grpc.RpcError as exc:
        return exc.code(), exc.details()


def fetch(stub, attempt, metadata, timeout: float = 20.0):
    try:
        return b"".join(c.data for c in stub.Fetch(pb.FetchRequest(attempt=attempt),
                                                   metadata=metadata, timeout=timeout))
    except grpc.RpcError as exc:
        return exc.code(), exc.details()


def one_chunk(attempt: str, data: bytes | None = None):
    return [pb.KVChunk(attempt=attempt, data=fake_payload(attempt) if data is None else data)]


# -- authentication ------------------------------------------------------------------


def test_unauthenticated_fetch_and_push_are_refused(endpoint, stub):
    imported = len(endpoint.importer.imported)
    attempt = fresh()
    endpoint.export(attempt, fake_payload(attempt))
    try:
        for md in (None, ((ATTEMPT_KEY, attempt),)):
            code, details = fetch(stub, attempt, md)
            assert code == grpc.StatusCode.UNAUTHENTICATED, details
            code, details = push(stub, one_chunk(attempt), md)
            assert code == grpc.StatusCode.UNAUTHENTICATED, details
        assert len(endpoint.importer.imported) == imported  # nothing reached the importer
        assert endpoint.get(attempt) is not None  # nor touched the payload
    finally:
        endpoint.release(attempt)


def _forgeries(secret, attempt, address, op):
    other_attempt, other_address = fresh("other"), "10.9.8.7:5555"
    good = dict(auth_metadata(secret, op, attempt, address))
    expires = int(good[EXPIRES_KEY])
    other_op = FETCH if op == PUSH else PUSH
    stranger = KVSecret.generate()
    forged = {
        "random MAC": {**good, AUTH_KEY: "ab" * 32},
        "MAC under another key": dict(auth_metadata(stranger, op, attempt, address)),
        "MAC for another attempt": {**good, AUTH_KEY: secret.authorize(op, other_attempt,
                                                                      address, expires)},
        "MAC for another rank": {**good, AUTH_KEY: secret.authorize(op, attempt, other_address,
                                                                   expires)},
        "MAC for the other operation": {**good, AUTH_KEY: secret.authorize(other_op, attempt,
                                                                          address, expires)},
        "expiry moved": {**good, EXPIRES_KEY: str(expires + 30)},
        "expired": dict(auth_metadata(secret, op, attempt, address, validity_s=-3600)),
        "far future": dict(auth_metadata(secret, op, attempt, address, validity_s=86400)),
        "truncated MAC": {**good, AUTH_KEY: good[AUTH_KEY][:-2]},
        "non-hex MAC": {**good, AUTH_KEY: "zz" * 32},
    }
    return {why: tuple(md.items()) for why, md in forged.items()}


def test_forged_or_misdirected_macs_are_refused(endpoint, stub, secret):
    attempt = fresh()
    endpoint.export(attempt, fake_payload(attempt))
    try:
        for why, md in _forgeries(secret, attempt, endpoint.address, FETCH).items():
            code, details = fetch(stub, attempt, md)
            assert code == grpc.StatusCode.UNAUTHENTICATED, (why, details)
        push_attempt = fresh()
        for why, md in _forgeries(secret, push_attempt, endpoint.address, PUSH).items():
            code, details = push(stub, one_chunk(push_attempt), md)
            assert code == grpc.StatusCode.UNAUTHENTICATED, (why, details)
        assert all(a != push_attempt for a, _ in endpoint.importer.imported)
        # none of them used the attempt up: the router's own, real push still goes in
        assert push(stub, one_chunk(push_attempt),
                    auth_metadata(secret, PUSH, push_attempt, endpoint.address)) == push_attempt
        assert fetch(stub, attempt, auth_metadata(secret, FETCH, attempt, endpoint.address)) \
            == fake_payload(attempt)
    finally:
        endpoint.release(attempt)


def test_an_endpoint_without_a_key_refuses_everything():
    ep = GrpcEndpoint(FakeImporter(), "127.0.0.1", None)
    try:
        channel = grpc.insecure_channel(ep.address)
        s = pb_grpc.KVTransferStub(channel)
        md = auth_metadata(KVSecret.generate(), PUSH, "x.1", ep.address)
        code, details = push(s, one_chunk("x.1"), md)
        assert code == grpc.StatusCode.UNAUTHENTICATED and "no KV key" in details
        channel.close()
        assert ep.importer.imported == []
    finally:
        ep.close()


# -- what an authorized push may carry -------------------------------------------------


def test_a_payload_naming_another_attempt_is_refused(endpoint, stub, secret):
    authorized, victim = fresh("x"), fresh("victim")
    md = auth_metadata(secret, PUSH, authorized, endpoint.address)
    code, details = push(stub, [pb.KVChunk(data=fake_payload(victim))], md)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert victim in details and authorized in details
    # a first chunk that names another attempt, too
    other = fresh("x")
    code, details = push(stub, one_chunk(victim, fake_payload(other)),
                         auth_metadata(secret, PUSH, other, endpoint.address))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert all(a not in (authorized, victim, other) for a, _ in endpoint.importer.imported)


def test_a_replayed_push_is_refused(endpoint, stub, secret):
    attempt = fresh()
    md = auth_metadata(secret, PUSH, attempt, endpoint.address)
    assert push(stub, one_chunk(attempt), md) == attempt
    for replay in (md, auth_metadata(secret, PUSH, attempt, endpoint.address)):
        code, details = push(stub, one_chunk(attempt), replay)
        assert code == grpc.StatusCode.ALREADY_EXISTS, details
        assert "replay" in details
    assert [a for a, _ in endpoint.importer.imported].count(attempt) == 1


def test_an_oversize_push_is_resource_exhausted(endpoint, stub, secret):
    # by what its header promises: refused on the first chunk
    attempt = fresh()
    big = fake_payload(attempt, tensor_bytes=LIMIT)
    started = time.monotonic()

    def chunks():
        yield pb.KVChunk(attempt=attempt, data=big[:1024])
        time.sleep(STREAM_TIMEOUT_S + 1)  # never needed: the header is enough
        yield pb.KVChunk(data=big[1024:])

    code, details = push(stub, chunks(), auth_metadata(secret, PUSH, attempt, endpoint.address))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
    assert str(LIMIT) in details and "limit" in details
    assert time.monotonic() - started < STREAM_TIMEOUT_S
    # by the bytes it sends (its header lies low)
    attempt = fresh()
    lying = fake_payload(attempt) + b"\0" * LIMIT
    code, details = push(stub, [pb.KVChunk(attempt=attempt, data=lying[i:i + 16384])
                                for i in range(0, len(lying), 16384)],
                         auth_metadata(secret, PUSH, attempt, endpoint.address))
    assert code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT), details
    assert all(a != attempt for a, _ in endpoint.importer.imported)


def test_the_router_maps_refusals_to_their_kinds(endpoint, secret):
    """RESOURCE_EXHAUSTED -> capacity, INVALID_ARGUMENT -> payload, others -> transport."""
    import asyncio

    class Rank:
        def __init__(self, address):
            self.info = type("Info", (), {"kv_address": address})()

    class Ticket:
        def __init__(self, attempt):
            self.locator = (endpoint.address, attempt)

    async def deliver(transport, attempt):
        try:
            return await transport.deliver(Ticket(attempt), Rank(endpoint.address),
                                           Rank(endpoint.address))
        finally:
            await transport.close()

    ok = fresh()
    endpoint.export(ok, fake_payload(ok))
    big = fresh()
    endpoint.export(big, fake_payload(big, tensor_bytes=LIMIT))
    forged = fresh()
    endpoint.export(forged, fake_payload(fresh("victim")))
    try:
        result = asyncio.run(deliver(GrpcBytesTransport(secret), ok))
        assert result.ok and result.attempt == ok, result
        assert asyncio.run(deliver(GrpcBytesTransport(secret), big)).kind == "capacity"
        assert asyncio.run(deliver(GrpcBytesTransport(secret), forged)).kind == "payload"
        assert asyncio.run(deliver(GrpcBytesTransport(secret), ok)).kind == "transport"  # replay
        result = asyncio.run(deliver(GrpcBytesTransport(KVSecret.generate()), fresh()))
        assert result.kind == "transport" and "authoriz" in result.error
    finally:
        for a in (ok, big, forged):
            endpoint.release(a)


def test_chunks_on_the_wire_are_kvchunk_messages():
    """encode_chunk/decode_chunk speak kv_transfer.proto's KVChunk exactly."""
    from pdserve.kv_transfer.grpc.wire import decode_chunk, encode_chunk, encoded_chunks

    for attempt, data in (("a7.1", b"\x00\x01" * 300), ("", b"x" * 200_000), ("\u00e9.2", b""),
                          ("", b"")):
        raw = encode_chunk(attempt, data)
        assert raw == pb.KVChunk(attempt=attempt, data=data).SerializeToString()
        assert decode_chunk(raw) == (attempt, data)
    # as the protobuf runtime reads it: unknown fields skipped, the last occurrence wins
    unknown = b"\x18\x05" + b"\x25\x00\x00\x00\x00" + b"\x29" + b"\x00" * 8 + b"\x32\x02hi"
    raw = encode_chunk("old.1", b"first") + unknown + encode_chunk("new.1", b"second")
    parsed = pb.KVChunk.FromString(raw)
    assert decode_chunk(raw) == (parsed.attempt, parsed.data) == ("new.1", b"second")
    for bad in (b"\x12\x05abc", b"\x12", b"\x0a\x02\xff\xfe", b"\x00\x00", b"\x1b",
                b"\x12" + b"\xff" * 11, b"\x25\x00"):
        with pytest.raises(ValueError):
            decode_chunk(bad)
    with pytest.raises(ValueError, match="wire type"):  # stricter: the runtime keeps it unknown
        decode_chunk(b"\x10\x01")  # field 2 (data) as a varint
    data = bytes(range(256)) * 20_000  # 5 MB: 5 chunks, the last one short
    pieces = list(encoded_chunks("big.1", data))
    assert len(pieces) == 5 and [decode_chunk(c)[0] for c in pieces] == ["big.1", "", "", "", ""]
    assert b"".join(bytes(decode_chunk(c)[1]) for c in pieces) == data


def test_a_payload_of_many_chunks_is_relayed_intact(secret):
    """A payload several times CHUNK_BYTES goes prefill rank -> router -> decode rank
    byte for byte; the same push over the decode rank's limit is still refused."""
    import asyncio
    import hashlib

    from pdserve.kv_transfer.grpc.wire import CHUNK_BYTES

    class Keeper(FakeImporter):
        def import_prefilled(self, data):
            self.digest = hashlib.sha256(data).hexdigest()
            return super().import_prefilled(data)

    class Rank:
        def __init__(self, address):
            self.info = type("Info", (), {"kv_address": address})()

    class Ticket:
        def __init__(self, address, attempt):
            self.locator = (address, attempt)

    size = 5 * CHUNK_BYTES + 12_345
    src = GrpcEndpoint(FakeImporter(), "127.0.0.1", secret)
    dst = GrpcEndpoint(Keeper(), "127.0.0.1", secret, max_push_bytes=size + 4096)
    small = GrpcEndpoint(Keeper(), "127.0.0.1", secret, max_push_bytes=size // 2)

    async def deliver(to, attempt):
        transport = GrpcBytesTransport(secret)
        try:
            return await transport.deliver(Ticket(src.address, attempt), Rank(src.address),
                                           Rank(to.address))
        finally:
            await transport.close()

    try:
        attempt = fresh("big")
        body = bytes(range(251)) * (size // 251 + 1)
        header = msgpack.packb({"attempt": attempt, "tensor_bytes": size}, use_bin_type=True)
        payload = struct.pack("<4sHI", b"PDKV", VERSION, len(header)) + header + body[:size]
        src.export(attempt, payload)
        result = asyncio.run(deliver(dst, attempt))
        assert result.ok and result.attempt == attempt and result.nbytes == len(payload), result
        assert dst.importer.imported == [(attempt, len(payload))]
        assert dst.importer.digest == hashlib.sha256(payload).hexdigest()
        refused = asyncio.run(deliver(small, attempt))  # by what the header promises
        assert not refused.ok and small.importer.imported == [], refused
        # (an abort while the router still has chunks in flight can reach it as gRPC's own
        # INTERNAL now and then, then reported as a transport failure)
        if refused.kind == "capacity":
            assert str(size // 2) in refused.error, refused
        else:
            assert refused.kind == "transport", refused
    finally:
        for ep in (src, dst, small):
            ep.close()


def test_a_malformed_chunk_is_refused_before_the_importer(endpoint, secret):
    attempt = fresh()
    channel = grpc.insecure_channel(endpoint.address, options=CHANNEL_OPTIONS)
    raw_push = channel.stream_unary("/pdserve.rpc.KVTransfer/Push", request_serializer=None,
                                    response_deserializer=pb.PushResponse.FromString)
    try:
        raw_push(iter([b"\x12\x40" + b"short"]), timeout=20,
                 metadata=auth_metadata(secret, PUSH, attempt, endpoint.address))
    except grpc.RpcError as exc:
        code, details = exc.code(), exc.details()
    else:
        code, details = None, ""
    finally:
        channel.close()
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "malformed" in details, details
    assert all(a != attempt for a, _ in endpoint.importer.imported)


# -- limits on streams -----------------------------------------------------------------


def test_a_stalled_push_or_fetch_is_aborted_after_its_deadline(endpoint, stub, secret):
    # a push whose next chunk does not come
    attempt = fresh()
    gone = threading.Event()

    def stall():
        yield pb.KVChunk(attempt=attempt, data=fake_payload(attempt)[:16])
        gone.wait(10)

    started = time.monotonic()
    code, details = push(stub, stall(), auth_metadata(secret, PUSH, attempt, endpoint.address))
    took = time.monotonic() - started
    gone.set()
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED, details
    assert CHUNK_TIMEOUT_S * 0.8 <= took < CHUNK_TIMEOUT_S + 2, took
    # a push that trickles (each chunk in time) but runs past the stream's bound
    attempt = fresh()
    data = fake_payload(attempt, tensor_bytes=4096)

    def trickle():
        for i in range(0, len(data), 64):
            yield pb.KVChunk(attempt=attempt if i == 0 else "", data=data[i:i + 64])
            time.sleep(CHUNK_TIMEOUT_S / 3)

    started = time.monotonic()
    code, details = push(stub, trickle(), auth_metadata(secret, PUSH, attempt, endpoint.address))
    took = time.monotonic() - started
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED, details
    assert STREAM_TIMEOUT_S * 0.8 <= took < STREAM_TIMEOUT_S + 2, took
    # a fetch whose reader stops reading (the payload is larger than the flow-control
    # windows, so the rank's writes block)
    attempt = fresh()
    endpoint.export(attempt, b"\x01" * (48 << 20))
    try:
        reply = stub.Fetch(pb.FetchRequest(attempt=attempt), timeout=30,
                           metadata=auth_metadata(secret, FETCH, attempt, endpoint.address))
        next(reply)
        time.sleep(CHUNK_TIMEOUT_S + 1.5)
        with pytest.raises(grpc.RpcError) as err:
            for _ in reply:
                pass
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value.details()
    finally:
        endpoint.release(attempt)
    assert all(a not in (attempt,) for a, _ in endpoint.importer.imported)


def _hold_idle_pushes(stub, secret, address, n, authorized=True):
    """``n`` Push streams that send nothing and wait; returns (futures, release)."""
    gone = threading.Event()

    def nothing():
        gone.wait(30)
        return
        yield  # pragma: no cover

    calls = []
    for _ in range(n):
        attempt = fresh("idle")
        md = auth_metadata(secret, PUSH, attempt, address) if authorized else None
        calls.append(stub.Push.future(nothing(), metadata=md, timeout=30))
    return calls, gone


def test_idle_push_streams_do_not_block_a_push(endpoint, stub, secret):
    idle, gone = _hold_idle_pushes(stub, secret, endpoint.address, 8)
    strangers, gone2 = _hold_idle_pushes(stub, secret, endpoint.address, 8, authorized=False)
    try:
        time.sleep(0.2)  # they are all open on the rank now
        for _ in range(3):
            attempt = fresh()
            started = time.monotonic()
            assert push(stub, one_chunk(attempt),
                        auth_metadata(secret, PUSH, attempt, endpoint.address)) == attempt
            assert time.monotonic() - started < CHUNK_TIMEOUT_S  # well before any idle one ends
        assert not any(f.done() for f in idle)  # still held open meanwhile
        for f in strangers:  # the unauthenticated ones never held anything
            assert f.exception(5).code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        gone.set()
        gone2.set()
        for f in idle:
            f.cancel()


# -- the key ---------------------------------------------------------------------------


def test_the_key_is_hidden_and_required(secret, endpoint):
    raw = secret._key
    for thing in (secret, endpoint, GrpcBytesTransport(secret)):
        assert raw.hex() not in repr(thing) and repr(raw) not in repr(thing)
        assert "hidden" in repr(thing)
    assert str(secret) == repr(secret) == "KVSecret(<hidden>)"
    copy = pickle.loads(pickle.dumps(secret))  # what Ray does with the actor argument
    assert copy.authorize(PUSH, "a.1", "h:1", 5) == secret.authorize(PUSH, "a.1", "h:1", 5)
    with pytest.raises(TypeError, match="KVSecret"):
        make_transport("grpc")
    with pytest.raises(ValueError):
        KVSecret(b"short")
    assert make_transport("ray").name == "ray"  # the others need none
    assert make_transport("in_process").name == "in_process"


# -- through a real router -------------------------------------------------------------


PROMPTS = ["def foo(x):", "the quick brown fox jumps over"]


@pytest.fixture(scope="module")
def grpc_router(make_router):
    router = make_router(kv_transport="grpc")
    yield router
    router.close()  # its ranks hold the session's pool resources


def _rank_stub(address):
    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    return channel, pb_grpc.KVTransferStub(channel)


def _generate(router, prompt, max_tokens=8):
    from pdserve.router.client import Client

    with Client(router.address, timeout=60) as client:
        return client.generate(prompt, max_tokens=max_tokens, temperature=0)


def test_router_ranks_refuse_strangers_and_forgeries(grpc_router, reference):
    service = grpc_router.service
    secret = service._kv_secret
    assert isinstance(secret, KVSecret) and "hidden" in repr(service.pools["decode"].kv_secret)
    prefill = service.pools["prefill"].ranks[0].info.kv_address
    decode = service.pools["decode"].ranks[0].info.kv_address
    pch, prefill_stub = _rank_stub(prefill)
    dch, decode_stub = _rank_stub(decode)
    want = reference(PROMPTS, 8)
    try:
        # strangers, and MACs made for the other rank
        code, _ = fetch(prefill_stub, "r.1", None)
        assert code == grpc.StatusCode.UNAUTHENTICATED
        code, _ = push(decode_stub, one_chunk("r.1"), None)
        assert code == grpc.StatusCode.UNAUTHENTICATED
        code, _ = push(decode_stub, one_chunk("r.1"), auth_metadata(secret, PUSH, "r.1", prefill))
        assert code == grpc.StatusCode.UNAUTHENTICATED
        code, _ = fetch(prefill_stub, "r.1", auth_metadata(secret, FETCH, "r.1", decode))
        assert code == grpc.StatusCode.UNAUTHENTICATED
        # a forged payload (authorized as X, its header names Y) while real requests run
        results: dict = {}

        def real(i):
            results[i] = _generate(grpc_router, PROMPTS[i % 2]).token_ids

        threads = [threading.Thread(target=real, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 5
        while not len(service.tracker) and time.monotonic() < deadline:
            time.sleep(0.005)
        # their attempts are what a forger would want to inject KV for
        victims = [s.attempt_key for s in service.tracker.states()] or [fresh("victim")]
        refusals = []
        for victim in victims[:4]:
            forged = fresh("forged")
            refusals.append(push(decode_stub, one_chunk(forged, fake_payload(victim)),
                                 auth_metadata(secret, PUSH, forged, decode)))
        for t in threads:
            t.join(60)
        assert all(r[0] == grpc.StatusCode.INVALID_ARGUMENT for r in refusals), refusals
        assert [results[i] for i in range(4)] == [want[i % 2] for i in range(4)]
    finally:
        pch.close()
        dch.close()
    grpc_router.assert_nothing_left()  # no blocks taken, nothing queued by the forgeries
    assert grpc_router.drained_errors() == []


def test_idle_push_streams_on_a_decode_rank_do_not_delay_hand_offs(grpc_router, reference):
    service = grpc_router.service
    decode = service.pools["decode"].ranks[0].info.kv_address
    generation = service.pools["decode"].generation
    channel, decode_stub = _rank_stub(decode)
    want = reference(PROMPTS, 8)
    _generate(grpc_router, PROMPTS[0])  # warm
    idle, gone = _hold_idle_pushes(decode_stub, service._kv_secret, decode, 6)
    try:
        time.sleep(0.3)
        for prompt, tokens in zip(PROMPTS, want, strict=True):
            from pdserve.router.client import Client

            started = time.monotonic()
            with Client(grpc_router.address, timeout=60) as client:
                msgs = list(client.stream(prompt, max_tokens=8, temperature=0))
            took = time.monotonic() - started
            assert [t for m in msgs for t in m.token_ids] == tokens
            # the rank aborts an idle push after 10 s (CHUNK_TIMEOUT_S); a blocked hand-off
            # would have waited for that
            assert took < 6.0, took
            assert 0 < msgs[-1].timings.kv_handoff_ms < 5000, msgs[-1].timings
        assert not any(f.done() for f in idle)  # all held open the whole time
    finally:
        gone.set()
        for f in idle:
            f.cancel()
        channel.close()
    assert service.pools["decode"].generation == generation
    grpc_router.assert_nothing_left()


def test_a_formed_decode_group_has_a_nonce_and_no_open_store(grpc_router, reference):
    """Router level (Task B): growing the decode pool to two ranks forms a group whose
    store keys carry a fresh nonce, and rank 0 closed its store once both joined; the
    group then serves without re-forming. Runs last: it leaves two decode ranks."""
    import ray

    service = grpc_router.service
    pool = service.pools["decode"]
    grpc_router.call(pool.scale(2), timeout=180)
    generation = pool.generation
    ranks = pool.ready()
    assert len(ranks) == 2

    def group_of(rank):
        return (rank.rank, rank._group_store is None, rank._hosted_store is None,
                rank._comm.prefix, rank._comm.name, repr(rank._comm), rank.generation)

    states = ray.get([r.actor.__ray_call__.remote(group_of) for r in ranks], timeout=60)
    for _, store_closed, nothing_hosted, prefix, name, shown, gen in states:
        assert store_closed and nothing_hosted and gen == generation
        nonce = prefix.rsplit("/", 1)[-1]
        assert prefix == f"{name}/{nonce}" and len(nonce) == 32
        int(nonce, 16)
        assert nonce not in shown and nonce not in name
    assert len({s[3] for s in states}) == 1  # one group, one prefix
    want = reference(PROMPTS, 8)
    for _ in range(2):
        assert [_generate(grpc_router, p).token_ids for p in PROMPTS] == want
    assert pool.generation == generation  # no re-form since
    grpc_router.assert_nothing_left()
