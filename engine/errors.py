"""Why an engine refuses a request or a KV payload (beyond a malformed payload, which
is a ``KVPayloadError``)."""

from __future__ import annotations


class NoCapacityError(ValueError):
    """A request that can never fit this engine's KV pool."""


class CacheMissError(ValueError):
    """A payload that left out a prefix this engine's cache does not hold."""
