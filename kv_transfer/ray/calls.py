"""The ray backend's calls from the router (or a prefill rank) to a rank's endpoint.

Each is sent as ``rank.kv_call.remote(call, *data)`` and answered by ``RayEndpoint``
(endpoint.py) by its type; a payload's ObjectRef travels in ``data``, where Ray resolves
it before the call runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ImportShared:
    """Decode rank: map the sender's segment at ``locator`` (``SharedPayload.as_tuple()``:
    plain values are cheaper for Ray than the dataclass) and import from it, leaving its
    first ``skip_blocks`` blocks out. Answers an ImportResult."""

    locator: tuple
    skip_blocks: int = 0


@dataclass(frozen=True)
class ObjectFor:
    """Prefill rank: ``attempt``'s staged payload (less ``skip_blocks``) as an array, for a
    receiver that cannot map it; Ray turns the answer into an object."""

    attempt: str
    skip_blocks: int = 0


@dataclass(frozen=True)
class WithoutPrefix:
    """Prefill rank: the payload given with the call (an object-store payload, resolved
    by Ray) without its first ``num_blocks`` blocks, as a new object."""

    num_blocks: int


@dataclass(frozen=True)
class HandOffTo:
    """Prefill rank: the streamed attempt ``stream_of`` decodes on ``decode_actor`` (None:
    the router delivers it after all); see ``RayEndpoint.hand_off_directly``."""

    stream_of: str
    decode_actor: Any = None
    wake_address: str = ""
    reply_address: str = ""
    reply_id: str = ""
