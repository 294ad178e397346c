"""The router's gRPC face (grpc.aio): Generate / Abort / GetClusterState / ScalePool,
plus the standard health service and server reflection (so grpcurl works).

Every Router method authenticates its caller first (router/auth.py): Generate and Abort
as a tenant, the others as the admin. Health and reflection stay open: load balancers
probe health, and the schema reflection serves is public."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.router.auth import Authenticator, AuthError, Principal
from pdserve.router.config import RouterConfig
from pdserve.router.embedded_ray import public_binds
from pdserve.router.rank_handle import RankHandle
from pdserve.router.request_error import RequestError
from pdserve.router.request_stream import merged_chunks
from pdserve.router.service import RouterService
from pdserve.router.validation import check_request_id, prepare
from pdserve.rpc import router_pb2, router_pb2_grpc

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 16 << 20
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]
SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, service: RouterService, auth: Authenticator | None = None) -> None:
        self.svc = service
        self.auth = auth or Authenticator()

    async def _caller(self, context, admin: bool = False) -> Principal | None:
        """The authenticated caller, or None after aborting the call with why not."""
        try:
            if admin:
                return self.auth.authorize_admin(context.invocation_metadata(), context.peer())
            return self.auth.authenticate(context.invocation_metadata())
        except AuthError as exc:
            await context.abort(exc.code, exc.message)
            return None

    async def Generate(self, request, context):
        svc = self.svc
        caller = await self._caller(context)
        if caller is None:
            return
        if isinstance(request, UndecodableRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            return
        try:
            # Tokenizing a long prompt takes a while; every other stream waits on this loop.
            prepared = await asyncio.to_thread(prepare, request, svc.tokenizer, svc.limits,
                                               svc.config.default_max_tokens,
                                               svc.chat_template)
            states = svc.admit(prepared, client_gone=context.cancelled, tenant=caller.tenant)
        except RequestError as exc:
            await context.abort(exc.code, exc.message)
            return
        label = states[0].label
        async with contextlib.aclosing(merged_chunks(svc, states)) as chunks:
            async for index, chunk in chunks:
                reply = router_pb2.GenerateResponse(request_id=label, token_ids=chunk.token_ids,
                                                    text=chunk.text, index=index)
                if chunk.finish_reason is not None:
                    reply.finish_reason = chunk.finish_reason
                    reply.error = chunk.error or ""
                    reply.usage.CopyFrom(router_pb2.Usage(
                        prompt_tokens=len(prepared.prompt_token_ids),
                        completion_tokens=chunk.num_completion_tokens,
                        cached_prompt_tokens=states[index].cached_tokens))
                    reply.timings.CopyFrom(timings_message(states[index]))
                if chunk.logprobs is not None:  # the request asked for them
                    reply.logprobs.extend(logprobs_message(chunk))
                yield reply

    async def Abort(self, request, context):
        caller = await self._caller(context)
        if caller is None:
            return
        if isinstance(request, UndecodableRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            return
        try:
            check_request_id(request.request_id)
        except RequestError as exc:
            await context.abort(exc.code, exc.message)
            return
        found = await self.svc.abort(request.request_id, tenant=caller.tenant)
        return router_pb2.AbortResponse(found=found)

    async def GetClusterState(self, request, context):
        if await self._caller(context, admin=True) is None:
            return
        await self.svc.refresh_stats()
        d = self.svc.cluster_state()
        pools = [router_pb2.PoolState(
            name=p["name"], target_replicas=p["target_replicas"],
            group_generation=p["group_generation"],
            ranks=[rank_message(r) for r in p["ranks"]]) for p in d.pop("pools")]
        return router_pb2.ClusterState(pools=pools, planner=planner_message(d.pop("planner")),
                                       **d)

    async def ScalePool(self, request, context):
        if await self._caller(context, admin=True) is None:
            return
        try:
            previous = await self.svc.scale(request.pool, request.replicas)
        except RequestError as exc:
            await context.abort(exc.code, exc.message)
            return
        except Exception as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"scaling {request.pool} failed: {exc}")
            return
        return router_pb2.ScalePoolResponse(pool=request.pool, replicas=request.replicas,
                                            previous_replicas=previous)

    async def GetTimeline(self, request, context):
        if await self._caller(context, admin=True) is None:
            return
        records = await self.svc.timeline(request.since)
        records.sort(key=lambda r: (r["start"], r["pool"], r["rank"]))
        return router_pb2.Timeline(steps=[
            router_pb2.StepRecord(**{k: v for k, v in r.items() if k != "seq"}) for r in records])


def rank_message(r: RankHandle) -> router_pb2.RankState:
    """ClusterState's entry for one rank: the router's view of it and the engine's stats
    from its latest poll (engine/outputs.py ``EngineStats``), the one place they become
    the proto."""
    st = r.stats
    return router_pb2.RankState(
        rank=r.rank, actor_id=r.actor._actor_id.hex() if r.actor else "",
        node_id=r.info.node_id if r.info else "", state=r.state,
        num_waiting=st.num_waiting, num_running=st.num_running,
        num_prompted=st.num_prompted, num_free_blocks=st.num_free_blocks,
        num_total_blocks=st.num_total_blocks or (r.info.num_total_blocks if r.info else 0),
        kv_usage=st.kv_usage, outstanding_prompt_tokens=st.outstanding_prompt_tokens,
        num_steps=st.num_steps, num_empty_steps=st.num_empty_steps,
        num_preemptions=st.num_preemptions, num_inflight=len(r.inflight),
        cache_queried_tokens=st.cache_queried_tokens, cache_hit_tokens=st.cache_hit_tokens,
        cache_evictions=st.cache_evictions, num_cached_blocks=st.num_cached_blocks,
        spec_drafts=st.spec_drafts, spec_draft_tokens=st.spec_draft_tokens,
        spec_accepted_tokens=st.spec_accepted_tokens,
        spec_accepted_per_pos=st.spec_accepted_per_pos)


def planner_message(state: dict) -> router_pb2.PlannerState:
    """ClusterState.planner from RouterService.planner_state()."""
    state = dict(state)
    decisions = [router_pb2.PlannerDecision(**d) for d in state.pop("decisions")]
    return router_pb2.PlannerState(decisions=decisions, **state)


def logprobs_message(chunk) -> list[router_pb2.TokenLogprob]:
    """GenerateResponse.logprobs: one TokenLogprob per token of ``chunk`` (an event or
    chunk whose ``logprobs`` holds rank/messages.py TokenLogprobs, aligned with its
    token_ids)."""
    return [router_pb2.TokenLogprob(logprob=lp.logprob, top_token_ids=lp.top_ids,
                                    top_logprobs=lp.top_logprobs) for lp in chunk.logprobs or ()]


def timings_message(state) -> router_pb2.Timings:
    """GenerateResponse.timings from what the router and the ranks measured (seconds)."""
    t = state.timings
    ttft = state.first_token_at - state.created if state.first_token_at is not None else 0.0
    return router_pb2.Timings(
        router_queue_ms=1e3 * t.get("router_queue_s", 0.0),
        prefill_queue_ms=1e3 * t.get("prefill_queue_s", 0.0),
        prefill_ms=1e3 * t.get("prefill_s", 0.0), kv_export_ms=1e3 * t.get("kv_export_s", 0.0),
        ttft_ms=1e3 * ttft, kv_handoff_ms=1e3 * t.get("kv_handoff_s", 0.0),
        decode_queue_ms=1e3 * t.get("decode_queue_s", 0.0), kv_bytes=int(t.get("kv_bytes", 0)),
        kv_handoff_span_ms=1e3 * _span(t.get("kv_ready_wall"), t.get("kv_imported_wall")),
        cached_prompt_tokens=state.cached_tokens, moves=state.num_moves)


def _span(start: float | None, end: float | None) -> float:
    """Seconds from ``start`` to ``end`` (two ranks' wall clocks); 0 if either is unknown."""
    return max(0.0, end - start) if start and end else 0.0


class RouterServer:
    """A started router: the service (pools and ranks) behind a bound gRPC port."""

    def __init__(self, service: RouterService, server: grpc.aio.Server, port: int,
                 auth: Authenticator | None = None) -> None:
        self.auth = auth
        self.service = service
        self.server = server
        self.port = port
        self.metrics_port: int | None = None  # the Prometheus endpoint's, when serving
        self.http = None  # the OpenAI-compatible front (http_api.HTTPServer), when serving
        self.http_port: int | None = None

    @property
    def address(self) -> str:
        host = self.service.config.host
        return f"{host}:{self.port}"

    async def wait(self) -> None:
        await self.server.wait_for_termination()

    async def stop(self, grace: float = 1.0) -> None:
        self.service.metrics.stop_server()
        if self.http is not None:
            await self.http.stop()
        await self.service.stop()
        await self.server.stop(grace)


class UndecodableRequest:
    """Stands in for a request protobuf could not parse, so the method answers
    INVALID_ARGUMENT instead of grpc's UNKNOWN for a deserializer that raised."""

    def __init__(self, type_name: str, reason: str) -> None:
        self.message = (f"the request is not a valid {type_name} (malformed protobuf, or "
                        f"invalid UTF-8 in a string field): {reason}")


def _tolerant_deserializer(message_type):
    def deserialize(data: bytes):
        try:
            return message_type.FromString(data)
        except DecodeError as exc:
            return UndecodableRequest(message_type.DESCRIPTOR.full_name, str(exc))

    return deserialize


def add_router_servicer(servicer: RouterServicer, server: grpc.aio.Server) -> None:
    """router_pb2_grpc.add_RouterServicer_to_server, except that Generate and Abort get an
    UndecodableRequest for bytes that do not parse (every other method is unchanged)."""
    pb = router_pb2
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=_tolerant_deserializer(pb.GenerateRequest),
            response_serializer=pb.GenerateResponse.SerializeToString),
        "Abort": grpc.unary_unary_rpc_method_handler(
            servicer.Abort, request_deserializer=_tolerant_deserializer(pb.AbortRequest),
            response_serializer=pb.AbortResponse.SerializeToString),
        "GetClusterState": grpc.unary_unary_rpc_method_handler(
            servicer.GetClusterState, request_deserializer=pb.ClusterStateRequest.FromString,
            response_serializer=pb.ClusterState.SerializeToString),
        "ScalePool": grpc.unary_unary_rpc_method_handler(
            servicer.ScalePool, request_deserializer=pb.ScalePoolRequest.FromString,
            response_serializer=pb.ScalePoolResponse.SerializeToString),
        "GetTimeline": grpc.unary_unary_rpc_method_handler(
            servicer.GetTimeline, request_deserializer=pb.TimelineRequest.FromString,
            response_serializer=pb.Timeline.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME,
                                                                          handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


async def start_router(config: RouterConfig) -> RouterServer:
    """Start the pools (Ray must be initialised), then serve gRPC on config.host:port."""
    auth = Authenticator(config.auth_token_file, config.admin_token_file)  # fails early
    credentials = server_credentials(config)
    service = RouterService(config)
    await service.start()
    server = grpc.aio.server(options=SERVER_OPTIONS)
    add_router_servicer(RouterServicer(service, auth), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"{config.host}:{config.port}"
    with public_binds(config.host):  # a non-loopback --host: past the loopback-bind shim
        port = (server.add_secure_port(address, credentials) if credentials is not None
                else server.add_insecure_port(address))
    if port == 0:
        await service.stop()
        raise RuntimeError(f"cannot bind the router to {config.host}:{config.port}")
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("router serving on %s:%d (%s, %s)", config.host, port,
             "TLS" if credentials is not None else "plaintext",
             f"tenants {', '.join(auth.tenants)}" if auth.requires_token else "no tokens")
    router = RouterServer(service, server, port, auth)
    metrics_port = config.metrics_port
    if metrics_port is None:  # default: the next port (a free one when the router's was)
        metrics_port = port + 1 if config.port else -1
    if metrics_port != 0:
        try:
            with public_binds(config.host):
                router.metrics_port = service.metrics.start_server(config.host,
                                                                   max(metrics_port, 0))
            log.info("metrics on http://%s:%d/metrics", config.host, router.metrics_port)
        except OSError as exc:
            if config.metrics_port is not None:  # asked for: starting without it is wrong
                await router.stop(0)
                raise RuntimeError(f"cannot bind the metrics endpoint to {config.host}:"
                                   f"{metrics_port}: {exc}") from exc
            log.warning("no metrics endpoint: cannot bind %s:%d (%s)", config.host,
                        metrics_port, exc)
    if config.http_port != 0:
        # lazy: http_api imports fastapi and uvicorn (heavy): only a router serving HTTP
        from pdserve.router.http_api import start_http

        try:
            router.http = await start_http(service, auth, config)
        except (OSError, RuntimeError) as exc:
            await router.stop(0)
            raise RuntimeError(f"cannot serve HTTP on {config.host}:{config.http_port}: "
                               f"{exc}") from exc
        router.http_port = router.http.port
        log.info("OpenAI-compatible HTTP on %s:%d", config.host, router.http_port)
    return router


def server_credentials(config: RouterConfig) -> grpc.ServerCredentials | None:
    """gRPC's SSL credentials from the PEM files, or None for plaintext."""
    if not config.tls_cert_file:
        return None
    try:
        cert = Path(config.tls_cert_file).read_bytes()
        key = Path(config.tls_key_file).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read the TLS certificate or key: {exc}") from exc
    return grpc.ssl_server_credentials([(key, cert)])


def run_forever(config: RouterConfig) -> None:
    async def main():
        server = await start_router(config)
        await server.wait()

    asyncio.run(main())
