"""The KV payload codec: round trips, and every way a payload can be wrong."""

import pytest
import torch

from pdserve.engine.kv.payload import KVPayload, KVPayloadError


def make_payload(dtype=torch.float32) -> KVPayload:
    gen = torch.Generator().manual_seed(0)
    return KVPayload(
        attempt="r1", model_fingerprint="fp", dtype="float32", block_size=4, num_layers=2,
        token_ids=[5, 6, 7, 8], num_prompt_tokens=3,
        sampling={"max_tokens": 4, "temperature": 0.0},
        tensors={
            "k_blocks": torch.randn(2, 1, 4, 2, 8, generator=gen).to(dtype),
            "v_blocks": torch.randn(2, 1, 4, 2, 8, generator=gen).to(dtype),
        },
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_bit_exact(dtype):
    payload = make_payload(dtype)
    back = KVPayload.from_bytes(payload.to_bytes())
    assert back.attempt == "r1" and back.token_ids == [5, 6, 7, 8]
    assert type(back.token_ids) is list and all(type(t) is int for t in back.token_ids)
    assert back.first_token_id == 8 and back.num_prompt_tokens == 3
    for name, tensor in payload.tensors.items():
        assert back.tensors[name].dtype == dtype
        assert torch.equal(back.tensors[name], tensor)


def test_truncated_payload_is_rejected_with_its_sizes():
    data = make_payload().to_bytes()
    with pytest.raises(KVPayloadError, match="truncated"):
        KVPayload.from_bytes(data[:-1])
    with pytest.raises(KVPayloadError, match="truncated"):
        KVPayload.from_bytes(data[:20])
    with pytest.raises(KVPayloadError, match="truncated"):
        KVPayload.from_bytes(data[:3])


def test_garbage_and_wrong_version_are_rejected():
    with pytest.raises(KVPayloadError, match="magic"):
        KVPayload.from_bytes(b"XXXX" + bytes(100))
    data = bytearray(make_payload().to_bytes())
    data[4] = 99
    with pytest.raises(KVPayloadError, match="version"):
        KVPayload.from_bytes(bytes(data))
    data[4] = 3  # token_ids as a list of ints: refused by version, not misread
    with pytest.raises(KVPayloadError, match="version 3 is not supported"):
        KVPayload.from_bytes(bytes(data))


@pytest.mark.parametrize("field,value", [
    ("model_fingerprint", "other"), ("dtype", "bfloat16"), ("block_size", 16), ("num_layers", 3)])
def test_mismatch_names_the_field(field, value):
    expected = dict(model_fingerprint="fp", dtype="float32", block_size=4, num_layers=2)
    expected[field] = value
    with pytest.raises(KVPayloadError, match=field):
        make_payload().check_compatible(**expected)
