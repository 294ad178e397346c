"""KVPayload.from_bytes under hostile input: mutated, truncated and bit-flipped payloads and
random msgpack headers decode to a well-formed payload or raise KVPayloadError, never
anything else, and never allocate much more than the payload's own size."""

from __future__ import annotations

import json
import math
import pickle
import random
import struct
import subprocess
import sys

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pdserve.engine.kv.payload import (
    MAX_HEADER_BYTES,
    MAX_TOKEN_IDS,
    VERSION,
    KVPayload,
    KVPayloadError,
)

FAST = settings(max_examples=200, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
PREFIX = struct.Struct("<4sHI")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Decoding parses the header into Python objects and copies each tensor once; anything far
# beyond a few times the payload's size means a length was trusted before it was checked
# (a claimed 2**16-element list alone is 512 KiB).
ALLOCATION_SLACK_BYTES = 1 << 20


def id_bytes(*ids: int) -> bytes:
    """token_ids as the header carries them (version 4): little-endian int64s."""
    return struct.pack(f"<{len(ids)}q", *ids)


def small_payload(token_ids=(5, 6, 7, 8)) -> KVPayload:
    gen = torch.Generator().manual_seed(0)
    return KVPayload(
        attempt="r1", model_fingerprint="fp", dtype="float32", block_size=4, num_layers=2,
        token_ids=list(token_ids), num_prompt_tokens=len(token_ids) - 1,
        sampling={"max_tokens": 4, "temperature": 0.0, "stop_token_ids": [2]},
        arrival_time=12.5, first_token_time=13.0,
        tensors={
            "k_blocks": torch.randn(2, 1, 4, 2, 2, generator=gen),
            "v_ring": torch.randn(2, 3, 2, generator=gen).to(torch.bfloat16),
            "empty": torch.zeros(0, 2, dtype=torch.float16),
        },
    )


BASE = small_payload().to_bytes()
HEADER_END = PREFIX.size + PREFIX.unpack(BASE[: PREFIX.size])[2]


def header_of(data: bytes) -> dict:
    return msgpack.unpackb(data[PREFIX.size:HEADER_END], raw=False)


def with_header(header, tensor_section: bytes = BASE[HEADER_END:]) -> bytes:
    packed = msgpack.packb(header, use_bin_type=True)
    return PREFIX.pack(b"PDKV", VERSION, len(packed)) + packed + tensor_section


def same(a: KVPayload, b: KVPayload) -> bool:
    """Field-by-field equality; tensors and sampling by their bytes (NaN is not == NaN)."""
    plain = ("attempt", "model_fingerprint", "dtype", "block_size", "num_layers",
             "token_ids", "num_prompt_tokens", "arrival_time", "first_token_time")
    if any(getattr(a, f) != getattr(b, f) for f in plain):
        return False
    if msgpack.packb(a.sampling) != msgpack.packb(b.sampling):
        return False
    if a.tensors.keys() != b.tensors.keys():
        return False
    return all(a.tensors[n].dtype == b.tensors[n].dtype and a.tensors[n].shape == b.tensors[n].shape
               and raw_bytes(a.tensors[n]).equal(raw_bytes(b.tensors[n])) for n in a.tensors)


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def decode_or_none(data: bytes, **kwargs) -> KVPayload | None:
    """from_bytes; None for a KVPayloadError (any other exception fails the test)."""
    try:
        return KVPayload.from_bytes(data, **kwargs)
    except KVPayloadError as exc:
        assert str(exc)
        return None


def assert_well_formed(payload: KVPayload, data: bytes) -> None:
    for name in ("attempt", "model_fingerprint", "dtype"):
        assert isinstance(getattr(payload, name), str)
    for value in (payload.block_size, payload.num_layers, payload.num_prompt_tokens):
        assert type(value) is int and value >= 0
    assert all(type(t) is int and t >= 0 for t in payload.token_ids)
    assert isinstance(payload.sampling, dict) and all(isinstance(k, str) for k in payload.sampling)
    assert math.isfinite(payload.arrival_time)
    assert payload.first_token_time is None or math.isfinite(payload.first_token_time)
    total = 0
    for tensor in payload.tensors.values():
        assert tensor.dtype in DTYPES
        total += tensor.numel() * tensor.element_size()
    assert total <= len(data)
    assert same(KVPayload.from_bytes(payload.to_bytes()), payload)  # re-encodes losslessly


# --- mutations of a real payload ---------------------------------------------------------

positions = st.one_of(st.integers(0, len(BASE) - 1), st.integers(0, HEADER_END - 1))


@st.composite
def mutated(draw) -> bytes:
    data = bytearray(BASE)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]))
        if not data:
            break
        pos = draw(positions) % len(data)
        if kind == "flip":
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set":
            data[pos] = draw(st.sampled_from([0x00, 0xff, 0xc0, 0xc1, 0xdc, 0xdd, 0xde, 0xdf,
                                              0x7f, 0x80, 0x90, 0xa0]) | st.integers(0, 255))
        elif kind == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "delete":
            del data[pos : pos + draw(st.integers(1, 16))]
        else:
            del data[pos:]
    return bytes(data)


@FAST
@given(mutated())
def test_mutated_payload_decodes_well_formed_or_raises_kv_payload_error(data):
    payload = decode_or_none(data)
    if payload is not None:
        assert_well_formed(payload, data)
    if data == BASE:
        assert payload is not None and same(payload, KVPayload.from_bytes(BASE))


@FAST
@given(st.integers(0, len(BASE) - 1))
def test_every_truncation_is_rejected(length):
    with pytest.raises(KVPayloadError):
        KVPayload.from_bytes(BASE[:length])


# --- random headers ------------------------------------------------------------------------

msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | st.text(max_size=12) | st.binary(max_size=12),
    lambda children: st.lists(children, max_size=6)
    | st.dictionaries(st.text(max_size=8), children, max_size=6),
    max_leaves=24)
HEADER_KEYS = sorted(set(header_of(BASE)) - {"pad"})  # "pad" (alignment) may be absent
tensor_entries = st.lists(
    st.one_of(
        st.tuples(st.text(max_size=4), st.sampled_from(["float32", "bfloat16", "float16", "int8"]),
                  st.lists(st.integers(-1, 5), max_size=4), st.integers(-1, 300),
                  st.integers(-1, 300)).map(list),
        msgpack_values),
    max_size=5)


@st.composite
def random_headers(draw) -> dict:
    header = header_of(BASE)
    for key in draw(st.lists(st.sampled_from(HEADER_KEYS), max_size=4, unique=True)):
        action = draw(st.sampled_from(["delete", "replace", "tensors"]))
        if action == "delete":
            del header[key]
        elif action == "tensors":
            header["tensors"] = draw(tensor_entries)
        else:
            header[key] = draw(msgpack_values)
    return header


@FAST
@given(st.one_of(random_headers(), msgpack_values),
       st.one_of(st.just(BASE[HEADER_END:]), st.binary(max_size=600)))
def test_random_header_decodes_well_formed_or_raises_kv_payload_error(header, tensor_section):
    data = with_header(header, tensor_section)
    assume(len(data) - PREFIX.size < MAX_HEADER_BYTES)
    payload = decode_or_none(data)
    if payload is not None:
        assert_well_formed(payload, data)


# --- valid payloads of every shape round trip; vocab_size bounds the token ids -----------------


@st.composite
def valid_payloads(draw) -> KVPayload:
    tensors = {}
    for name in draw(st.lists(st.text(min_size=1, max_size=8), max_size=4, unique=True)):
        shape = draw(st.lists(st.integers(0, 4), max_size=4))
        dtype = draw(st.sampled_from(DTYPES))
        raw = draw(st.binary(min_size=math.prod(shape) * dtype.itemsize,
                             max_size=math.prod(shape) * dtype.itemsize))
        tensors[name] = (torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape) if raw
                         else torch.empty(shape, dtype=dtype))
    token_ids = draw(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=40))
    return KVPayload(
        attempt=draw(st.text(max_size=40)), model_fingerprint=draw(st.text(max_size=20)),
        dtype=draw(st.sampled_from(["float32", "bfloat16", "float16"])),
        block_size=draw(st.integers(1, 64)), num_layers=draw(st.integers(1, 64)),
        token_ids=token_ids, num_prompt_tokens=len(token_ids) - 1,
        sampling={"max_tokens": draw(st.integers(1, 100)),
                  "temperature": draw(st.floats(0, 2)),
                  "stop_token_ids": draw(st.lists(st.integers(0, 99), max_size=4))},
        arrival_time=draw(st.floats(0, 1e9)),
        first_token_time=draw(st.none() | st.floats(0, 1e9)),
        tensors=tensors)


@FAST
@given(valid_payloads(), st.integers(1, 2**31))
def test_valid_payload_round_trips_and_vocab_size_bounds_its_tokens(payload, vocab_size):
    data = payload.to_bytes()
    assert same(KVPayload.from_bytes(data), payload)
    back = decode_or_none(data, vocab_size=vocab_size)
    if max(payload.token_ids) < vocab_size:
        assert back is not None and same(back, payload)
    else:
        assert back is None


# --- each check, by name ---------------------------------------------------------------


def replaced(**fields) -> bytes:
    header = header_of(BASE)
    header.update(fields)
    return with_header(header)


def spec(name, dtype, shape, offset, nbytes):
    return [name, dtype, shape, offset, nbytes]


K_SPEC, RING_SPEC, EMPTY_SPEC = header_of(BASE)["tensors"]


@pytest.mark.parametrize("fields,message", [
    (dict(block_size=True), "block_size"),
    (dict(block_size=0), "block_size"),
    (dict(num_layers="2"), "num_layers"),
    (dict(num_tokens=-1), "num_tokens"),
    (dict(attempt=7), "attempt"),
    (dict(model_fingerprint=None), "model_fingerprint"),
    (dict(token_ids=[1, 2]), "'token_ids' must be a bytes, got list"),  # version 3's list
    (dict(token_ids="abc"), "'token_ids' must be a bytes, got str"),
    (dict(token_ids=None), "'token_ids' must be a bytes"),
    (dict(token_ids=id_bytes(1, 2)[:-1]), "'token_ids'.*15 bytes is not a multiple of 8"),
    (dict(token_ids=b"\x01"), "'token_ids'.*1 bytes is not a multiple of 8"),
    (dict(token_ids=id_bytes(1, -3)), r"token_ids\[1\].*>= 0, got -3"),
    (dict(token_ids=id_bytes(-2**63)), r"token_ids\[0\].*>= 0"),
    (dict(sampling=[1]), "sampling"),
    (dict(arrival_time=float("inf")), "arrival_time"),
    (dict(first_token_time="soon"), "first_token_time"),
    (dict(tensors={}), "tensors"),
    (dict(tensor_bytes=-1), "tensor_bytes"),
    (dict(tensors=[K_SPEC, K_SPEC, EMPTY_SPEC]), "appears twice"),
    (dict(tensors=[K_SPEC, spec("v_ring", "bfloat16", [2, 3, 2], 100, 24), EMPTY_SPEC]),
     "overlaps"),
    (dict(tensors=[K_SPEC, spec("v_ring", "bfloat16", [2, 3, 2], 2**40, 24), EMPTY_SPEC]),
     "outside the tensor section"),
    (dict(tensors=[K_SPEC, spec("v_ring", "bfloat16", [2, 3, 3], 128, 24), EMPTY_SPEC]),
     "does not match shape"),
    (dict(tensors=[K_SPEC, spec("v_ring", "bfloat16", [2, -3, -2], 128, 24), EMPTY_SPEC]),
     "shape"),
    (dict(tensors=[K_SPEC, spec("v_ring", "int8", [2, 3, 2], 128, 12), EMPTY_SPEC]), "dtype"),
    (dict(tensors=[K_SPEC, spec("v_ring", "bfloat16", [2, 3, 2], 128, True), EMPTY_SPEC]),
     "nbytes"),
    (dict(tensors=[K_SPEC, ["v_ring", "bfloat16"], EMPTY_SPEC]), r"tensors\[1\]"),
    (dict(tensors=[K_SPEC, EMPTY_SPEC]), "tensor_bytes"),  # 24 bytes nobody claims
    (dict(forks={}), "forks"),
    (dict(forks=[["c1", 5]]), r"forks\[0\]"),
    (dict(forks=[[7, 5, {}]]), r"forks\[0\]\.attempt"),
    (dict(forks=[["c1", 5, {}], ["c1", 6, {}]]), r"forks\[1\]\.attempt"),
    (dict(forks=[["c1", -5, {}]]), r"forks\[0\]\.first_token_id"),
    (dict(forks=[["c1", True, {}]]), r"forks\[0\]\.first_token_id"),
    (dict(forks=[["c1", 5, [1]]]), r"forks\[0\]\.sampling"),
    (dict(forks=[["c1", 5, {}]] * 300), "more than 255"),
])
def test_each_bad_header_field_is_named(fields, message):
    with pytest.raises(KVPayloadError, match=message):
        KVPayload.from_bytes(replaced(**fields))


def test_missing_header_field_is_named():
    for key in HEADER_KEYS:
        header = header_of(BASE)
        del header[key]
        with pytest.raises(KVPayloadError, match=key):
            KVPayload.from_bytes(with_header(header))


def with_raw_header(packed: bytes) -> bytes:
    return PREFIX.pack(b"PDKV", VERSION, len(packed)) + packed


# msgpack lengths that claim 2**32 - 1 elements or bytes, in a header a few bytes long
LENGTH_CLAIMS = [bytes([kind]) + b"\xff\xff\xff\xff" + b"\x00"
                 for kind in (0xdd, 0xdf, 0xdb, 0xc6, 0xc9)]
SHAPE_CLAIM = replaced(tensors=[spec("k_blocks", "float32", [2**40, 2**40], 0, 128),
                                RING_SPEC, EMPTY_SPEC])


def test_huge_claims_are_refused():
    with pytest.raises(KVPayloadError, match="header length"):
        KVPayload.from_bytes(PREFIX.pack(b"PDKV", VERSION, 2**32 - 1) + bytes(16))
    for claim in LENGTH_CLAIMS:
        with pytest.raises(KVPayloadError, match="not valid msgpack"):
            KVPayload.from_bytes(with_raw_header(claim))
    with pytest.raises(KVPayloadError, match="k_blocks.*does not match shape"):
        KVPayload.from_bytes(SHAPE_CLAIM)


def random_mutations(count: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        data = bytearray(BASE)
        pos = rng.randrange(HEADER_END if rng.random() < 0.7 else len(data))
        kind = rng.randrange(3)
        if kind == 0:
            data[pos] ^= 1 << rng.randrange(8)
        elif kind == 1:
            data[pos] = rng.choice([0x00, 0xff, 0xdc, 0xdd, 0xde, 0xdf, 0xc6, 0xdb])
        else:
            data[pos:pos] = rng.randbytes(rng.randint(1, 8))
        out.append(bytes(data))
    return out


# Measured in a fresh interpreter: tracemalloc counts every thread's allocations, and turning
# it on and off per example while Ray's native threads (started by other tests) ran crashed
# the interpreter here (CPython 3.11).
_MEASURE_PEAKS = """
import json, pickle, sys, tracemalloc
from pdserve.engine.kv.payload import KVPayload, KVPayloadError
with open(sys.argv[1], "rb") as f:
    inputs = pickle.load(f)
tracemalloc.start()
peaks = []
for data in inputs:
    tracemalloc.reset_peak()
    before = tracemalloc.get_traced_memory()[0]
    try:
        KVPayload.from_bytes(data)
    except KVPayloadError:
        pass
    peaks.append(tracemalloc.get_traced_memory()[1] - before)
print(json.dumps(peaks))
"""


def test_hostile_payloads_allocate_little(tmp_path):
    inputs = [BASE, SHAPE_CLAIM, *map(with_raw_header, LENGTH_CLAIMS), *random_mutations(300)]
    path = tmp_path / "inputs.pickle"
    path.write_bytes(pickle.dumps(inputs))
    out = subprocess.run([sys.executable, "-c", _MEASURE_PEAKS, str(path)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    peaks = json.loads(out.stdout)
    for data, peak in zip(inputs, peaks, strict=True):
        assert peak < 8 * len(data) + ALLOCATION_SLACK_BYTES, (peak, data[:64])


def test_more_token_ids_than_any_model_takes_are_refused_by_their_length(tmp_path):
    header = header_of(BASE)
    header["token_ids"] = id_bytes(1) * (MAX_TOKEN_IDS + 1)
    data = with_header(header)
    with pytest.raises(KVPayloadError,
                       match=f"'token_ids' holds {MAX_TOKEN_IDS + 1} ids, more than {MAX_TOKEN_IDS}"):
        KVPayload.from_bytes(data)
    # msgpack's copy of the bin, and nothing more: no array or list of ids (a list of that
    # many ids alone would be as large again)
    path = tmp_path / "inputs.pickle"
    path.write_bytes(pickle.dumps([data]))
    out = subprocess.run([sys.executable, "-c", _MEASURE_PEAKS, str(path)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    [peak] = json.loads(out.stdout)
    assert peak < 1.25 * len(data) + ALLOCATION_SLACK_BYTES, (peak, len(data))


class _NoNumpy:
    def __getattr__(self, name):
        raise AssertionError(f"numpy.{name} used before the token ids were sized")


def test_token_ids_are_sized_before_anything_is_converted(monkeypatch):
    from pdserve.engine.kv import payload as kv_payload

    monkeypatch.setattr(kv_payload, "MAX_TOKEN_IDS", 4)
    assert KVPayload.from_bytes(small_payload([1, 2, 3, 4]).to_bytes()).token_ids == [1, 2, 3, 4]
    monkeypatch.setattr(kv_payload, "np", _NoNumpy())
    for bad, message in ((small_payload([1, 2, 3, 4, 5]).to_bytes(), "holds 5 ids, more than 4"),
                         (replaced(token_ids=bytes(33)), "not a multiple of 8")):
        with pytest.raises(KVPayloadError, match=message):
            KVPayload.from_bytes(bad)


def test_token_ids_travel_as_little_endian_int64s_and_come_back_a_list_of_ints():
    ids = [0, 1, 255, 256, 2**31, 2**32 + 7, 2**63 - 1, 5]
    data = small_payload(ids).to_bytes()
    header = msgpack.unpackb(data[PREFIX.size:PREFIX.size + PREFIX.unpack(data[:PREFIX.size])[2]])
    assert header["token_ids"] == id_bytes(*ids) == b"".join(t.to_bytes(8, "little") for t in ids)
    back = KVPayload.from_bytes(data)
    assert type(back.token_ids) is list and all(type(t) is int for t in back.token_ids)
    assert back.token_ids == ids and back.first_token_id == 5
    assert KVPayload.from_bytes(small_payload([7]).to_bytes()).token_ids == [7]
    empty = replaced(token_ids=b"")
    assert KVPayload.from_bytes(empty, vocab_size=1).token_ids == []


def test_a_token_id_the_sender_cannot_carry_is_named():
    for ids in ([1, 2**63], [1, -2**63 - 1], [1, 2.0]):
        with pytest.raises(KVPayloadError, match="token_ids cannot be carried as int64s"):
            small_payload(ids).to_bytes()


def test_vocab_size_names_the_first_token_outside_it():
    with pytest.raises(KVPayloadError, match=r"token_ids\[2\].*\[0, 7\), got 7"):
        KVPayload.from_bytes(small_payload([1, 2, 7, 3]).to_bytes(), vocab_size=7)
    with pytest.raises(KVPayloadError, match=r"token_ids\[1\].*\[0, 7\), got 99"):
        KVPayload.from_bytes(small_payload([1, 99, 7, 3]).to_bytes(), vocab_size=7)
    assert KVPayload.from_bytes(small_payload([1, 2, 6, 3]).to_bytes(), vocab_size=7)
    assert KVPayload.from_bytes(small_payload([1, 2, 7, 3]).to_bytes()).token_ids == [1, 2, 7, 3]


def test_a_negative_token_id_is_named_with_or_without_vocab_size():
    data = small_payload([1, 2, -1, 3]).to_bytes()
    with pytest.raises(KVPayloadError, match=r"token_ids\[2\].*must be an int >= 0, got -1"):
        KVPayload.from_bytes(data)
    with pytest.raises(KVPayloadError, match=r"token_ids\[2\].*\[0, 7\), got -1"):
        KVPayload.from_bytes(data, vocab_size=7)
