"""The ``grpc`` KV backend's rank side: a ``grpc.aio`` server that serves ``Fetch`` of the
rank's exported payloads and imports ``Push``ed ones into its host, every call
authenticated (steps 3 and 5 of this package's ``__init__``).
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from concurrent import futures
from typing import Any

import grpc

from pdserve.kv_transfer.base import (
    CACHE_MISS,
    CAPACITY,
    PAYLOAD_MAX_AGE_S,
    KVSecret,
    RankEndpoint,
    payload_without_prefix,
)
from pdserve.kv_transfer.grpc.wire import (
    ATTEMPT_KEY,
    AUTH_KEY,
    AUTH_VALIDITY_S,
    CHANNEL_OPTIONS,
    CHUNK_TIMEOUT_S,
    DEFAULT_MAX_PUSH_BYTES,
    EXPIRES_KEY,
    FETCH,
    MAX_CLOCK_SKEW_S,
    MAX_CONCURRENT_RPCS,
    PUSH,
    SERVICE,
    STREAM_TIMEOUT_S,
    PayloadRefused,
    decode_chunk,
    encoded_chunks,
    peek_header,
)
from pdserve.rpc import kv_transfer_pb2, kv_transfer_pb2_grpc

# -- the servicer --------------------------------------------------------------------------

class KVTransferServicer(kv_transfer_pb2_grpc.KVTransferServicer):
    """``Fetch`` serves the endpoint's payloads; ``Push`` imports into its importer (an
    object with ``import_prefilled(bytes) -> ImportResult``). Both authenticate first."""

    def __init__(self, endpoint: GrpcEndpoint) -> None:
        self.endpoint = endpoint

    async def Fetch(self, request, context):
        ep = self.endpoint
        attempt = request.attempt
        await ep.authenticate(context, FETCH, attempt)
        data = ep.get(attempt)
        if data is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"no KV payload for attempt {attempt!r} on this rank")
        if request.skip_blocks:  # the receiver's cache holds that prefix: it stays here
            data = await asyncio.get_running_loop().run_in_executor(
                None, payload_without_prefix, data, request.skip_blocks)
        deadline = asyncio.get_running_loop().time() + ep.stream_timeout_s
        for chunk in encoded_chunks(attempt, data):
            await ep.bounded(context, lambda chunk=chunk: context.write(chunk), deadline, "fetch",
                             "the next chunk was not taken")

    async def Push(self, request_iterator, context):
        ep = self.endpoint
        attempt = _metadata(context).get(ATTEMPT_KEY, "")
        await ep.authenticate(context, PUSH, attempt)
        if not ep.claim(attempt):
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"attempt {attempt!r} was already pushed to this rank: "
                                "a replayed push is refused")
        data = await self._receive(context, attempt)
        loop = asyncio.get_running_loop()
        result = await loop.run_in_executor(ep.imports, ep.importer.import_prefilled, data)
        if not result.ok:
            code = {CAPACITY: grpc.StatusCode.RESOURCE_EXHAUSTED,
                    CACHE_MISS: grpc.StatusCode.FAILED_PRECONDITION}.get(
                        result.kind, grpc.StatusCode.INVALID_ARGUMENT)
            await context.abort(code, result.error)
        return kv_transfer_pb2.PushResponse(attempt=result.attempt)

    async def _receive(self, context, attempt: str) -> bytearray:
        """The pushed payload whole, checked against the authorization and the limit; each
        chunk is read in place (``decode_chunk``) and copied once, onto the end of it."""
        ep = self.endpoint
        deadline = asyncio.get_running_loop().time() + ep.stream_timeout_s
        push = _PushedPayload(attempt, ep.max_push_bytes)
        try:
            while True:
                msg = await ep.bounded(context, context.read, deadline, "push",
                                       "no chunk arrived")
                if msg is grpc.aio.EOF:
                    break
                push.add(msg)
            push.check_whole()
        except PayloadRefused as refused:
            await context.abort(refused.code, refused.details)
        return push.payload


class _PushedPayload:
    """A pushed payload as its chunks arrive, checked as it grows: the attempt its chunks
    and header name, the rank's limit, and the size its header promises."""

    def __init__(self, attempt: str, limit: int) -> None:
        self.attempt, self.limit = attempt, limit
        self.payload = bytearray()  # grows by realloc (mremap for large sizes), no re-copy
        self.size = 0
        self._head: bytearray | None = bytearray()  # until the header is complete
        self.expected: int | None = None  # the whole size, once the header says it

    def _over(self) -> str:
        return (f"the pushed KV payload exceeds this rank's limit of {self.limit} bytes "
                f"(max_push_bytes: the largest sequence its KV blocks can hold, plus header)")

    def add(self, msg: bytes) -> None:
        bad = grpc.StatusCode.INVALID_ARGUMENT
        try:
            named, data = decode_chunk(msg)
        except ValueError as exc:
            raise PayloadRefused(bad, f"malformed KV chunk: {exc}") from None
        if named and named != self.attempt:
            raise PayloadRefused(bad, f"chunk names attempt {named!r}, the push "
                                      f"is authorized for {self.attempt!r}")
        self.size += len(data)
        if self.size > self.limit:
            raise PayloadRefused(grpc.StatusCode.RESOURCE_EXHAUSTED, self._over())
        self.payload += data
        if self._head is not None:
            self._read_header(data)
        if self.expected is not None and self.size > self.expected:
            raise PayloadRefused(bad, f"more KV payload bytes than its header promises "
                                      f"({self.expected})")

    def _read_header(self, data: memoryview) -> None:
        self._head += data
        found = peek_header(self._head)
        if found is None:
            return
        named, self.expected = found
        self._head = None
        if named != self.attempt:
            raise PayloadRefused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the payload's header names attempt {named!r}, the push is "
                f"authorized for {self.attempt!r}: refused")
        if self.expected > self.limit:
            raise PayloadRefused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 f"{self._over()}; its header promises {self.expected}")

    def check_whole(self) -> None:
        bad = grpc.StatusCode.INVALID_ARGUMENT
        if self.expected is None:
            raise PayloadRefused(bad, f"KV payload truncated: {self.size} bytes, no whole header")
        if self.size != self.expected:
            raise PayloadRefused(bad, f"KV payload truncated: {self.size} bytes, header "
                                      f"promises {self.expected}")


def add_servicer(servicer: KVTransferServicer, server) -> None:
    """Serve ``servicer`` on ``server`` as the generated ``add_KVTransferServicer_to_server``
    does, except that chunks cross the gRPC boundary serialized (``encoded_chunks`` out of
    ``Fetch``, ``decode_chunk`` inside ``Push``) instead of as protobuf messages."""
    handlers = {
        "Fetch": grpc.unary_stream_rpc_method_handler(
            servicer.Fetch, request_deserializer=kv_transfer_pb2.FetchRequest.FromString,
            response_serializer=None),
        "Push": grpc.stream_unary_rpc_method_handler(
            servicer.Push, request_deserializer=None,
            response_serializer=kv_transfer_pb2.PushResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


def _metadata(context) -> dict[str, str]:
    return {m.key: m.value for m in context.invocation_metadata() or ()
            if isinstance(m.value, str)}


class GrpcEndpoint(RankEndpoint):
    """Keeps exported payloads and serves them (and imports) on a port of its own: a
    ``grpc.aio`` server on an event loop in a background thread.

    ``secret``: the cluster's ``KVSecret`` (without one, every call is refused).
    ``max_push_bytes``: the largest payload a push may carry. ``stream_timeout_s`` and
    ``chunk_timeout_s`` bound every stream (see the module docstring)."""

    def __init__(self, importer: Any, host: str, secret: KVSecret | None = None, *,
                 max_age_s: float = PAYLOAD_MAX_AGE_S, max_push_bytes: int | None = None,
                 stream_timeout_s: float = STREAM_TIMEOUT_S,
                 chunk_timeout_s: float = CHUNK_TIMEOUT_S,
                 max_concurrent_rpcs: int = MAX_CONCURRENT_RPCS,
                 import_threads: int = 2) -> None:
        super().__init__(max_age_s)
        self.importer = importer
        self._secret = secret
        self.max_push_bytes = int(max_push_bytes or DEFAULT_MAX_PUSH_BYTES)
        self.stream_timeout_s = float(stream_timeout_s)
        self.chunk_timeout_s = float(chunk_timeout_s)
        self._pushed: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._pushed_lock = threading.Lock()
        self.imports = futures.ThreadPoolExecutor(max_workers=import_threads,
                                                  thread_name_prefix="kv-import")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kv-grpc",
                                        daemon=True)
        self._thread.start()
        self._closed = False
        bind = f"[{host}]" if ":" in host else host
        try:
            self.server, port = asyncio.run_coroutine_threadsafe(
                self._start(bind, max_concurrent_rpcs), self._loop).result(30)
        except BaseException:
            self._stop_loop()
            raise
        self.address = f"{bind}:{port}"

    async def _start(self, bind: str, max_concurrent_rpcs: int):
        server = grpc.aio.server(options=CHANNEL_OPTIONS,
                                 maximum_concurrent_rpcs=max_concurrent_rpcs)
        add_servicer(KVTransferServicer(self), server)
        port = server.add_insecure_port(f"{bind}:0")
        await server.start()
        return server, port

    # -- checks (on the server's loop) ---------------------------------------------------

    def check_authorization(self, metadata: dict[str, str], operation: str,
                            attempt: str) -> str | None:
        """None if ``metadata`` authorizes ``operation`` on ``attempt`` at this rank, else
        why not."""
        if self._secret is None:
            return "this rank holds no KV key: every transfer is refused"
        mac, expires = metadata.get(AUTH_KEY), metadata.get(EXPIRES_KEY)
        if not mac or not expires or not attempt:
            return "missing KV authorization"
        try:
            expires_at = int(expires)
        except ValueError:
            return "malformed KV authorization"
        now = time.time()
        if not now - MAX_CLOCK_SKEW_S <= expires_at <= now + AUTH_VALIDITY_S + MAX_CLOCK_SKEW_S:
            return "the KV authorization has expired (or its clock is far off)"
        if not self._secret.verify(operation, attempt, self.address, expires_at, mac):
            return "invalid KV authorization"
        return None

    async def authenticate(self, context, operation: str, attempt: str) -> None:
        why = self.check_authorization(_metadata(context), operation, attempt)
        if why is not None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

    def claim(self, attempt: str) -> bool:
        """True once per attempt (for as long as an authorization for it can be valid)."""
        now = time.time()
        with self._pushed_lock:
            while self._pushed:
                first, until = next(iter(self._pushed.items()))
                if until >= now:
                    break
                del self._pushed[first]
            if attempt in self._pushed:
                return False
            self._pushed[attempt] = now + AUTH_VALIDITY_S + 2 * MAX_CLOCK_SKEW_S
            return True

    async def bounded(self, context, step, deadline: float, what: str, stalled: str):
        """``await step()`` within the chunk timeout and the stream's deadline, else abort."""
        remaining = deadline - asyncio.get_running_loop().time()
        timeout = min(self.chunk_timeout_s, remaining)
        if timeout > 0:
            try:
                return await asyncio.wait_for(step(), timeout)
            except asyncio.TimeoutError:
                pass
        if remaining <= self.chunk_timeout_s:
            why = f"the {what} stream ran longer than {self.stream_timeout_s:g}s"
        else:
            why = f"{stalled} within {self.chunk_timeout_s:g}s: the {what} stream is aborted"
        await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, why)

    # -- rank side ---------------------------------------------------------------------

    def export(self, attempt: str, payload: bytes) -> Any:
        super().export(attempt, payload)
        return (self.address, attempt)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            asyncio.run_coroutine_threadsafe(self.server.stop(None), self._loop).result(10)
        except Exception:  # a loop that is gone already
            pass
        self._stop_loop()
        super().close()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()
        self.imports.shutdown(wait=False, cancel_futures=True)

    def __repr__(self) -> str:
        return f"GrpcEndpoint({getattr(self, 'address', None)}, {len(self)} payloads, key hidden)"


