"""`pdserve serve | generate | status | scale`: the service's command line.

Registered into `pdserve.cli` by `register_commands`. Heavy imports (ray, grpc)
happen inside the run functions so `pdserve --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from pdserve.engine.model_catalog import DEFAULT_MODEL, resolve_model

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 50051
DEFAULT_ADDRESS = f"{DEFAULT_HOST}:{DEFAULT_PORT}"
SELF_CHECK_CHAT = [{"role": "user", "content": "What is the capital of France?"}]
SELF_CHECK_PROMPT = "def add(x, y):"  # for a model without a chat template


# ---- serve -----------------------------------------------------------------------

def _add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="router config YAML (RouterConfig fields; pools under "
                   "prefill/decode/normal; see router/serve.example.yaml); flags override it")
    p.add_argument("--model", help="a Hugging Face folder, a GGUF file, or a built-in name: "
                   f"{DEFAULT_MODEL} (the default; from its installed package) or tiny (random "
                   "weights, generated on first use; for tests)")
    p.add_argument("--host", default=None, help=f"address to bind (default {DEFAULT_HOST})")
    p.add_argument("--port", type=int, default=None,
                   help=f"router port (default {DEFAULT_PORT}; 0 picks a free one)")
    p.add_argument("--prefill", type=int, default=None, help="prefill ranks (default 1)")
    p.add_argument("--decode", type=int, default=None, help="decode ranks (default 1)")
    p.add_argument("--normal", type=int, default=None, help="ranks of the normal pool "
                   "(--mode normal; default 1)")
    p.add_argument("--mode", choices=["disaggregated", "normal"], default=None,
                   help="default disaggregated")
    p.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (e.g. 'auto' on a `ray up` head); "
                   "default: start an embedded local Ray")
    p.add_argument("--dashboard", action="store_true",
                   help="embedded Ray only: start Ray's dashboard too (on 127.0.0.1; off by "
                   "default: it doubles Ray's processes)")
    p.add_argument("--kv-transport", choices=["auto", "ray", "device", "grpc"], default=None,
                   help="how KV reaches the decode ranks (default auto: device, GPU to GPU "
                   "over NCCL, when both pools have num_gpus > 0, else ray)")
    p.add_argument("--routing", choices=["cache_aware", "least_loaded"], default=None,
                   help="how a prompt's rank is chosen (default cache_aware: fewest prompt "
                   "tokens to compute before its first token, the rank's prefix cache "
                   "counted)")
    p.add_argument("--no-kv-streaming", action="store_true", default=None,
                   help="hand each prompt's KV off whole after its last chunk (default: "
                   "stream it to the decode rank chunk by chunk while it computes)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="ranks recompute every prompt from its first token")
    p.add_argument("--auth-token-file", default=None,
                   help="tenant tokens, one `<tenant> <token>` per line, mode 0600 (see "
                   "SECURITY.md); clients then need one. Re-read on SIGHUP")
    p.add_argument("--admin-token-file", default=None,
                   help="the admin token (ScalePool, GetClusterState, GetTimeline); without "
                   "one those are allowed from loopback peers only")
    p.add_argument("--tls-cert-file", default=None, help="PEM certificate chain: serve TLS")
    p.add_argument("--tls-key-file", default=None, help="PEM private key of --tls-cert-file")
    p.add_argument("--insecure", action="store_true", default=None,
                   help="allow plaintext on a non-loopback --host (a trusted network only)")
    p.add_argument("--tls-server-name", default=None,
                   help="name the self-check expects on the certificate (default localhost)")
    p.add_argument("--http-port", type=int, default=None,
                   help="OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                   "/v1/models; default: router port + 2; 0 turns it off)")
    p.add_argument("--served-model-name", default=None,
                   help="the model's id in the HTTP API (default: the model folder's name)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="Prometheus text endpoint (default: router port + 1; 0 turns it off)")
    p.add_argument("--max-queue-depth", type=int, default=None, help="default 256")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV blocks per rank (default: sized by the engine)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="default 32")
    p.add_argument("--num-cpus", type=float, default=None,
                   help="CPUs Ray reserves per rank (default 0.5)")
    p.add_argument("--num-gpus", type=float, default=None,
                   help="GPUs per rank (default 0: CPU ranks; > 0 puts the engines on CUDA)")
    p.add_argument("--autoscale", action="store_true", default=None,
                   help="the SLO planner sizes the prefill pool for --slo-ttft-ms and the "
                   "decode pool for --slo-itl-ms, within --min/--max-prefill and "
                   "--min/--max-decode (disaggregated mode; see README, Autoscaling)")
    p.add_argument("--slo-ttft-ms", type=float, default=None,
                   help="TTFT objective at slo_percentile (default 1000)")
    p.add_argument("--slo-itl-ms", type=float, default=None,
                   help="inter-token latency objective at slo_percentile (default 100)")
    for pool in ("prefill", "decode"):
        p.add_argument(f"--min-{pool}", type=int, default=None,
                       help=f"fewest {pool} ranks the planner keeps (default 1)")
        p.add_argument(f"--max-{pool}", type=int, default=None,
                       help=f"most {pool} ranks the planner asks for (default 4; at most "
                       "max_replicas)")
    p.add_argument("--no-self-check", action="store_true")
    p.add_argument("--exit-after-self-check", action="store_true",
                   help="stop once the self-check passed (for CI and `make serve` checks)")


# serve flags named exactly as their RouterConfig fields (--min-prefill: min_prefill)
PLANNER_FLAGS = ("autoscale", "slo_ttft_ms", "slo_itl_ms", "min_prefill", "max_prefill",
                 "min_decode", "max_decode")


def serve_config(args: argparse.Namespace):
    """RouterConfig from --config (if any) and the flags given (flags win)."""
    from pdserve.router.config import config_from_dict, load_config

    top = {"mode": args.mode, "host": args.host, "port": args.port,
           "kv_transport": args.kv_transport, "routing": args.routing,
           "max_queue_depth": args.max_queue_depth,
           "metrics_port": getattr(args, "metrics_port", None),
           "http_port": args.http_port, "served_model_name": args.served_model_name,
           "auth_token_file": args.auth_token_file, "admin_token_file": args.admin_token_file,
           "tls_cert_file": args.tls_cert_file, "tls_key_file": args.tls_key_file,
           "insecure": args.insecure,
           "kv_streaming": False if getattr(args, "no_kv_streaming", None) else None,
           **{name: getattr(args, name, None) for name in PLANNER_FLAGS}}
    if args.config:
        config = load_config(args.config)
    else:
        config = config_from_dict({"host": DEFAULT_HOST, "port": DEFAULT_PORT,
                                   "engine": {"max_num_seqs": 32}})
    for key, value in top.items():
        if value is not None:
            setattr(config, key, value)
    for pool in (config.prefill, config.decode, config.normal):
        replicas = getattr(args, pool.name)
        if replicas is not None:
            pool.replicas = replicas
        if args.num_cpus is not None:
            pool.num_cpus = args.num_cpus
        if args.num_gpus is not None:
            pool.num_gpus = args.num_gpus
        if args.max_num_seqs is not None:
            pool.engine.max_num_seqs = args.max_num_seqs
        if args.num_kv_blocks is not None:
            pool.engine.num_kv_blocks = args.num_kv_blocks
        if getattr(args, "no_prefix_caching", False):
            pool.engine.enable_prefix_caching = False
    # Checked here, before any Ray process starts: a bad model is one line and exit 2.
    resolved = resolve_model(args.model or config.model_dir or None)
    config.model_dir = resolved.path
    if config.served_model_name is None:
        config.served_model_name = resolved.name
    config.validate()
    return config


def _run_serve(args: argparse.Namespace) -> int:
    from pdserve.router.embedded_ray import idle_openmp_passively

    idle_openmp_passively()
    if not args.ray_address:  # embedded Ray, loopback only: set up before ray is imported
        from pdserve.router.embedded_ray import loopback_only

        loopback_only(getattr(args, "process_argv", None))  # re-executes this command once
    import asyncio
    import signal

    import ray

    from pdserve.router.auth import Authenticator
    from pdserve.router.server import server_credentials, start_router

    try:
        config = serve_config(args)
        # Bad token or TLS files fail here, before any Ray process starts.
        Authenticator(config.auth_token_file, config.admin_token_file)
        server_credentials(config)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    model = config.model_dir
    if args.ray_address:
        ray.init(address=args.ray_address, log_to_driver=False)
    else:
        # Embedded local Ray; room to scale each pool on this machine (and for the
        # planner to reach its maxima).
        room = 4 + max([p.replicas for p in config.pools()]
                       + ([config.max_prefill, config.max_decode] if config.autoscale else []))
        from pdserve.router.embedded_ray import start_embedded_ray

        dashboard = start_embedded_ray(
            num_cpus=max(os.cpu_count() or 2, room), resources={"prefill": room, "decode": room},
            temp_dir=os.environ.get("PDSERVE_RAY_TMP", "/tmp/pdserve-ray"),
            dashboard=args.dashboard)
        if dashboard:
            print(f"Ray dashboard on http://{dashboard}", flush=True)

    async def main() -> int:
        print(f"starting {config.mode} pools (model {model}) ...", flush=True)
        server = await start_router(config)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        address = f"{config.host}:{server.port}"
        print(f"pdserve router listening on {address}", flush=True)
        print(f"kv transport {server.service.transport.name}", flush=True)
        if config.autoscale:
            print(f"autoscale on: TTFT {config.slo_ttft_ms:g} ms and ITL {config.slo_itl_ms:g} "
                  f"ms at p{config.slo_percentile:g}; prefill {config.min_prefill}.."
                  f"{config.max_prefill}, decode {config.min_decode}..{config.max_decode} "
                  "ranks (pdserve status shows its decisions)", flush=True)
        if server.metrics_port:
            print(f"metrics on http://{config.host}:{server.metrics_port}/metrics", flush=True)
        if server.http_port:
            scheme = "https" if config.tls_cert_file else "http"
            print(f"OpenAI-compatible API on {scheme}://{config.host}:{server.http_port}/v1 "
                  f"(model {config.model_name!r})", flush=True)
        addr_flag = "" if address == DEFAULT_ADDRESS else f" --address {address}"
        print(f"try: pdserve chat{addr_flag}   or   pdserve generate{addr_flag} "
              "--max-tokens 32 'def add(x, y):'", flush=True)
        if server.auth is not None and (config.auth_token_file or config.admin_token_file):
            loop.add_signal_handler(signal.SIGHUP, _reload_tokens, server.auth)
        rc = 0
        if not args.no_self_check:
            rc = await _self_check(_local_address(config.host, server.port),
                                   token=self_check_token(config),
                                   tls_ca_file=config.tls_cert_file,
                                   tls_server_name=(args.tls_server_name or "localhost")
                                   if config.tls_cert_file else None,
                                   chat=server.service.chat_template is not None)
        if not args.exit_after_self_check and rc == 0:
            await stop.wait()
        print("shutting down ...", flush=True)
        await server.stop()
        return rc

    try:
        return asyncio.run(main())
    finally:
        ray.shutdown()


def _local_address(host: str, port: int) -> str:
    """Where this machine reaches a router bound to ``host`` (a wildcard: loopback)."""
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host in ("::", "[::]"):
        host = "[::1]"
    return f"{host}:{port}"


def self_check_token(config) -> str | None:
    """A token the self-check may use: the first tenant's, else the admin's (read here,
    in this process; never passed on)."""
    from pdserve.router.auth import read_client_token

    for path in (config.auth_token_file, config.admin_token_file):
        if path:
            return read_client_token(path)
    return None


def _reload_tokens(auth) -> None:
    try:
        auth.reload()
    except ValueError as exc:
        print(f"token reload FAILED, the old tokens stay in force: {exc}", flush=True)
        return
    print(f"tokens reloaded ({len(auth.tenants)} tenants)", flush=True)


async def _self_check(address: str, token: str | None = None, tls_ca_file: str | None = None,
                      tls_server_name: str | None = None, chat: bool = True) -> int:
    """One greedy request through the router: a chat question when the model has a
    chat template, else a text prompt. Passes when tokens come back and it ends."""
    from pdserve.router.client import AsyncClient

    prompt = SELF_CHECK_CHAT if chat else SELF_CHECK_PROMPT
    shown = SELF_CHECK_CHAT[-1]["content"] if chat else SELF_CHECK_PROMPT
    print(f"self-check: {shown!r} ->", end=" ", flush=True)
    try:
        async with AsyncClient(address, timeout=120, token=token, tls_ca_file=tls_ca_file,
                               tls_server_name=tls_server_name) as client:
            n, reason = 0, ""
            async for msg in client.stream(prompt, max_tokens=32, temperature=0):
                print(msg.text, end="", flush=True)
                n += len(msg.token_ids)
                reason = msg.finish_reason or reason
    except Exception as exc:
        print(f"\nself-check FAILED: {exc}", flush=True)
        return 1
    ok = n > 0 and reason in ("length", "stop")
    print(f"\nself-check {'passed' if ok else 'FAILED'} ({n} tokens, finish_reason={reason})",
          flush=True)
    return 0 if ok else 1


# ---- generate / status / scale -------------------------------------------------------

def add_client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=DEFAULT_ADDRESS, help="router (default %(default)s)")
    p.add_argument("--token-file", default=None,
                   help="file holding this client's token (default: $PDSERVE_TOKEN, if set)")
    p.add_argument("--tls-ca-file", default=None,
                   help="PEM CA certificate of a router serving TLS")
    p.add_argument("--tls-server-name", default=None,
                   help="name to expect on the router's certificate (default: the address')")


def client_options(args: argparse.Namespace) -> dict:
    """Client / AsyncClient keyword arguments from the common client flags."""
    from pdserve.router.auth import read_client_token

    return {"token": read_client_token(args.token_file), "tls_ca_file": args.tls_ca_file,
            "tls_server_name": args.tls_server_name}


def connect(args: argparse.Namespace, timeout: float | None = None):
    """A blocking Client from the common client flags."""
    from pdserve.router.client import Client

    return Client(args.address, timeout=timeout, **client_options(args))


def rpc_error(exc, address: str) -> int:
    import grpc

    if isinstance(exc, (ValueError, OSError)):  # a bad token file or CA file
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if isinstance(exc, grpc.RpcError):
        code = exc.code()
        if code == grpc.StatusCode.UNAVAILABLE:
            print(f"error: cannot reach the router at {address} ({exc.details()})", file=sys.stderr)
            return 2
        print(f"error: {code.name}: {exc.details()}", file=sys.stderr)
        return 1
    raise exc


def _add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="prompt text")
    add_client_args(p)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--request-id", default="")
    p.add_argument("--timeout", type=float, default=300.0, help="deadline in seconds")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (token_ids, text, finish_reason) at the end")


def _run_generate(args: argparse.Namespace) -> int:
    from pdserve.router.client import Completion

    out = Completion()
    try:
        with connect(args, timeout=args.timeout) as client:
            for msg in client.stream(args.prompt, request_id=args.request_id,
                                     max_tokens=args.max_tokens, temperature=args.temperature,
                                     top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                                     ignore_eos=args.ignore_eos):
                out.add(msg)
                if not args.json:
                    print(msg.text, end="", flush=True)
    except Exception as exc:
        if not args.json and out.num_messages:
            print()
        return rpc_error(exc, args.address)
    if args.json:
        print(json.dumps(out.to_dict()))
    else:
        print()
    if out.finish_reason == "error":
        print(f"error: {out.error}", file=sys.stderr)
        return 1
    return 0


def _add_status_args(p: argparse.ArgumentParser) -> None:
    add_client_args(p)
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--json", action="store_true", help="print the state as JSON")


def _run_status(args: argparse.Namespace) -> int:
    from google.protobuf.json_format import MessageToDict

    try:
        with connect(args) as client:
            state = client.cluster_state(timeout=args.timeout)
    except Exception as exc:
        return rpc_error(exc, args.address) or 2
    if args.json:
        print(json.dumps(MessageToDict(state, always_print_fields_with_no_presence=True)))
        return 0
    print(f"router {args.address}: mode {state.mode}, model {state.model}, "
          f"kv transport {state.kv_transport}, {state.num_inflight}/{state.max_queue_depth} "
          "requests in flight")
    for pool in state.pools:
        print(f"pool {pool.name}: {len(pool.ranks)} ranks (target {pool.target_replicas}, "
              f"group generation {pool.group_generation})")
        for r in pool.ranks:
            print(f"  rank {r.rank} [{r.state}] node {r.node_id[:12]}  waiting {r.num_waiting} "
                  f"running {r.num_running} prompted {r.num_prompted}  "
                  f"kv {r.num_total_blocks - r.num_free_blocks}/{r.num_total_blocks} blocks "
                  f"({100 * r.kv_usage:.0f}%)  in flight {r.num_inflight}  "
                  f"steps {r.num_steps} (empty {r.num_empty_steps})  prefix cache "
                  f"{_hit_rate(r)} hits, {r.num_cached_blocks} blocks, "
                  f"{r.cache_evictions} evictions")
    _print_planner(state.planner)
    return 0


def _print_planner(pl) -> None:
    print(f"recent latency (last {pl.window_s:g}s): TTFT p50/p90/p99 {pl.ttft_p50_ms:.0f}/"
          f"{pl.ttft_p90_ms:.0f}/{pl.ttft_p99_ms:.0f} ms, ITL {pl.itl_p50_ms:.0f}/"
          f"{pl.itl_p90_ms:.0f}/{pl.itl_p99_ms:.0f} ms")
    if not pl.enabled:
        print("planner: off (pdserve serve --autoscale turns it on)")
        return
    print(f"planner: on, objectives TTFT {pl.slo_ttft_ms:g} ms and ITL {pl.slo_itl_ms:g} ms "
          f"at p{pl.slo_percentile:g}; prefill {pl.min_prefill}..{pl.max_prefill}, decode "
          f"{pl.min_decode}..{pl.max_decode} ranks; {pl.num_looks} looks")
    for pool, note in sorted(pl.notes.items()):
        if note:
            print(f"  {pool}: {note}")
    for d in pl.decisions[-8:]:
        when = time.strftime("%H:%M:%S", time.localtime(d.at))
        error = f" ({d.error})" if d.error else ""
        print(f"  {when} {d.pool} {d.from_replicas} -> {d.to_replicas} [{d.outcome}]{error}: "
              f"{d.reason}")


def _hit_rate(r) -> str:
    if not r.cache_queried_tokens:
        return "-"
    return f"{100 * r.cache_hit_tokens / r.cache_queried_tokens:.0f}%"


def _add_scale_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("pool", choices=["prefill", "decode", "normal"])
    p.add_argument("replicas", type=int)
    add_client_args(p)
    p.add_argument("--timeout", type=float, default=600.0)


def _run_scale(args: argparse.Namespace) -> int:
    try:
        with connect(args) as client:
            reply = client.scale(args.pool, args.replicas, timeout=args.timeout)
    except Exception as exc:
        return rpc_error(exc, args.address)
    print(f"pool {reply.pool}: {reply.previous_replicas} -> {reply.replicas} ranks")
    return 0


def _add_make_tokens_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="folder to write `tokens` and `admin_token` into (mode 0600)")
    p.add_argument("--tenants", default="default",
                   help="comma-separated tenant names (default: one tenant, 'default')")


def _run_make_tokens(args: argparse.Namespace) -> int:
    from pdserve.router.auth import make_token_files

    try:
        tenant_path, admin_path = make_token_files(
            args.dir, [t.strip() for t in args.tenants.split(",") if t.strip()])
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {tenant_path} and {admin_path} (mode 0600; the tokens are only there)\n"
          f"serve:  pdserve serve --auth-token-file {tenant_path} "
          f"--admin-token-file {admin_path} ...\n"
          "client: give each tenant its own line's token (pdserve generate --token-file F, "
          "or PDSERVE_TOKEN)")
    return 0


def register_commands(register) -> None:
    register("make-tokens", "write tenant tokens and an admin token for `serve`",
             _add_make_tokens_args, _run_make_tokens)
    register("serve", "run the router and its Ray pools (embedded local Ray by default)",
             _add_serve_args, _run_serve)
    register("generate", "stream a completion from a running router", _add_generate_args,
             _run_generate)
    from pdserve.router.chat_cli import add_chat_args, run_chat

    register("chat", "chat with the served model in the terminal (streams; /reset, "
             "/system TEXT, /exit)", add_chat_args, run_chat)
    register("status", "show a router's pools, ranks, queues and KV usage", _add_status_args,
             _run_status)
    register("scale", "grow or shrink a pool: pdserve scale prefill|decode N", _add_scale_args,
             _run_scale)
