"""`pdserve serve`: its flags, the RouterConfig they make, and the serving itself.

Ray (embedded and loopback-only by default, or a cluster to join), the router, and a
self-check request once it listens; Ctrl-C / SIGTERM stop it, SIGHUP re-reads the
token files. ray, and router.server which imports it, are imported inside the functions:
after the embedded Ray's loopback settings, and so that `pdserve --help` stays fast.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

from pdserve.engine.config import (
    ACTIVATION_PRECISIONS,
    KERNEL_ISAS,
    KV_PRECISIONS,
    QUANTIZATIONS,
    SPECULATIVE_METHODS,
)
from pdserve.engine.model.catalog import DEFAULT_MODEL, resolve_model
from pdserve.router.auth import Authenticator, read_client_token
from pdserve.router.client import AsyncClient
from pdserve.router.config import config_from_dict, load_config
from pdserve.router.embedded_ray import (
    idle_openmp_passively,
    loopback_only,
    start_embedded_ray,
)
from pdserve.router.gpu_share import give_pools_gpus

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 50051
DEFAULT_ADDRESS = f"{DEFAULT_HOST}:{DEFAULT_PORT}"
SELF_CHECK_CHAT = [{"role": "user", "content": "What is the capital of France?"}]
SELF_CHECK_PROMPT = "def add(x, y):"  # for a model without a chat template


# ---- flags ------------------------------------------------------------------------------

def add_serve_args(p: argparse.ArgumentParser) -> None:
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
    p.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                   help="weights the decode step reads (default auto: a GGUF file's Q8_0/"
                   "Q4_0/Q4_1/Q4_K/Q6_K blocks in place; int8: every other matmul quantized "
                   "at load; bf16: every other matmul rounded to bf16, exact for a bf16 "
                   "checkpoint; none: fp32; see docs/models.md)")
    p.add_argument("--activation-precision", choices=ACTIVATION_PRECISIONS, default=None,
                   help="what the quantized matmuls multiply (default auto: int8 rows "
                   "against a GGUF file's blocks but the attention's q|k|v, fp32 for "
                   "those and weights quantized at load; int8: all; fp32: exact rows "
                   "everywhere; see docs/models.md)")
    p.add_argument("--kv-precision", choices=KV_PRECISIONS, default=None,
                   help="what the KV cache holds on the CPU (default auto: fp16 where the "
                   "matmuls multiply int8 activations, as llama.cpp's f16 cache, else fp32; "
                   "fp16: half the bytes and twice the blocks; fp32: exact; see "
                   "docs/models.md)")
    p.add_argument("--kernel-isa", choices=KERNEL_ISAS, default=None,
                   help="the C kernels' build (default auto: the widest this CPU runs; "
                   "avx2 or generic to run a narrower one, e.g. to compare builds)")
    p.add_argument("--speculative", choices=SPECULATIVE_METHODS, default=None,
                   help="speculative decoding on the ranks that decode (default off; ngram: "
                   "drafts by prompt lookup over each request's history, used where they "
                   "pay; see docs/serving.md)")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="the most tokens one draft proposes (default 5)")
    p.add_argument("--draft-model", default=None,
                   help="with --speculative draft: a smaller model sharing the served "
                   "model's tokenizer (a folder, a GGUF file or a built-in name)")
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
                   help="GPUs per rank, whole or a fraction (default: with --device auto, an "
                   "equal share of the cluster's GPUs, none without any)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default=None,
                   help="where the engines run (default auto: the GPUs where the Ray cluster "
                   "has any, bf16 there; cpu or cuda to force)")
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
    flags = _router_flags(args)
    if args.config:
        config = load_config(args.config)
    else:
        config = config_from_dict({"host": DEFAULT_HOST, "port": DEFAULT_PORT,
                                   "engine": {"max_num_seqs": 32}})
    for key, value in flags.items():
        if value is not None:
            setattr(config, key, value)
    for pool in (config.prefill, config.decode, config.normal):
        _apply_pool_flags(pool, args)
    # Checked here, before any Ray process starts: a bad model is one line and exit 2.
    resolved = resolve_model(args.model or config.model_dir or None)
    config.model_dir = resolved.path
    if config.served_model_name is None:
        config.served_model_name = resolved.name
    config.validate()
    return config


def _router_flags(args: argparse.Namespace) -> dict:
    """The RouterConfig fields the flags set (None: not given)."""
    return {"mode": args.mode, "host": args.host, "port": args.port,
            "kv_transport": args.kv_transport, "routing": args.routing,
            "max_queue_depth": args.max_queue_depth,
            "metrics_port": getattr(args, "metrics_port", None),
            "http_port": args.http_port, "served_model_name": args.served_model_name,
            "auth_token_file": args.auth_token_file, "admin_token_file": args.admin_token_file,
            "tls_cert_file": args.tls_cert_file, "tls_key_file": args.tls_key_file,
            "insecure": args.insecure,
            "kv_streaming": False if getattr(args, "no_kv_streaming", None) else None,
            **{name: getattr(args, name, None) for name in PLANNER_FLAGS}}


def _apply_pool_flags(pool, args: argparse.Namespace) -> None:
    replicas = getattr(args, pool.name)
    if replicas is not None:
        pool.replicas = replicas
    if args.num_cpus is not None:
        pool.num_cpus = args.num_cpus
    if args.num_gpus is not None:
        pool.num_gpus = args.num_gpus
    if getattr(args, "device", None) is not None:
        pool.engine.device = args.device
    if args.max_num_seqs is not None:
        pool.engine.max_num_seqs = args.max_num_seqs
    if args.num_kv_blocks is not None:
        pool.engine.num_kv_blocks = args.num_kv_blocks
    if getattr(args, "no_prefix_caching", False):
        pool.engine.enable_prefix_caching = False
    for name in ("quantization", "activation_precision", "kv_precision", "kernel_isa", "speculative", "num_speculative_tokens",
                 "draft_model"):
        if getattr(args, name, None) is not None:
            setattr(pool.engine, name, getattr(args, name))


def run_serve(args: argparse.Namespace) -> int:
    idle_openmp_passively()
    if not args.ray_address:  # embedded Ray, loopback only: set up before ray is imported
        loopback_only(getattr(args, "process_argv", None))  # re-executes this command once
    # lazy: ray, and router.server which imports it, only after loopback_only (read at import)
    import ray

    from pdserve.router.server import server_credentials

    try:
        config = serve_config(args)
        # Bad token or TLS files fail here, before any Ray process starts.
        Authenticator(config.auth_token_file, config.admin_token_file)
        server_credentials(config)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    _start_ray(args, config)
    try:
        decided = give_pools_gpus(config, ray.cluster_resources().get("GPU", 0.0))
        config.validate()
        config.check_kv_dtypes()
    except ValueError as exc:
        ray.shutdown()
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if decided:
        print(decided, flush=True)
    try:
        return asyncio.run(_serve(args, config))
    finally:
        ray.shutdown()


def _start_ray(args: argparse.Namespace, config) -> None:
    import ray  # lazy: Ray reads its loopback settings at import: only after loopback_only

    if args.ray_address:
        ray.init(address=args.ray_address, log_to_driver=False)
        return
    # Embedded local Ray; room to scale each pool on this machine (and for the planner
    # to reach its maxima).
    room = 4 + max([p.replicas for p in config.pools()]
                   + ([config.max_prefill, config.max_decode] if config.autoscale else []))
    dashboard = start_embedded_ray(
        num_cpus=max(os.cpu_count() or 2, room), resources={"prefill": room, "decode": room},
        temp_dir=os.environ.get("PDSERVE_RAY_TMP", "/tmp/pdserve-ray"),
        dashboard=args.dashboard)
    if dashboard:
        print(f"Ray dashboard on http://{dashboard}", flush=True)


async def _serve(args: argparse.Namespace, config) -> int:
    """Start the router, self-check it, and serve until a stop signal (or, with
    --exit-after-self-check, until the self-check passed)."""
    # lazy: router.server imports ray, which must wait for loopback_only (run_serve)
    from pdserve.router.server import start_router

    print(f"starting {config.mode} pools (model {config.model_dir}) ...", flush=True)
    try:
        server = await start_router(config)
    except RuntimeError as exc:  # ranks that did not start, or cannot work together
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    _announce(config, server)
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


def _announce(config, server) -> None:
    """Where the router listens and what it serves, and how to try it."""
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
