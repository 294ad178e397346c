"""The router's command line: `pdserve generate | status | scale | make-tokens`, and
`register_commands`, which registers them into `pdserve.cli` with `serve`
(``serve_command.py``) and `chat` (``chat_cli.py``). Heavy imports (ray, grpc) happen
inside the run functions so `pdserve --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from google.protobuf.json_format import MessageToDict

from pdserve.router.auth import make_token_files
from pdserve.router.chat_cli import add_chat_args, run_chat
from pdserve.router.client import Completion
from pdserve.router.client_args import add_client_args, connect, rpc_error
from pdserve.router.serve_command import add_serve_args, run_serve

# ---- generate / status / scale -------------------------------------------------------

def _add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="prompt text")
    add_client_args(p)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    add_control_args(p)
    p.add_argument("--request-id", default="")
    p.add_argument("--timeout", type=float, default=300.0, help="deadline in seconds")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (token_ids, text, finish_reason) at the end")


# the logits controls (vLLM's semantics; see router.proto): flag -> GenerateRequest field
CONTROL_FLAGS = (("--presence-penalty", float), ("--frequency-penalty", float),
                 ("--repetition-penalty", float), ("--min-tokens", int), ("--min-p", float))


def add_control_args(p: argparse.ArgumentParser) -> None:
    """The logits controls and one structured output (docs/serving.md)."""
    for flag, kind in CONTROL_FLAGS:
        p.add_argument(flag, type=kind, default=None)
    so = p.add_mutually_exclusive_group()
    so.add_argument("--json-schema", metavar="FILE",
                    help="structured output: the answer is JSON this schema (a file) accepts")
    so.add_argument("--regex", help="structured output: the answer matches this regex")
    so.add_argument("--choice", action="append",
                    help="structured output: the answer is one of these (repeat the flag)")
    so.add_argument("--grammar", metavar="FILE",
                    help="structured output: an EBNF grammar file (xgrammar's syntax, rule root)")
    p.add_argument("--loose-schema", action="store_true",
                   help="with --json-schema: keywords the grammar cannot enforce (uniqueItems, "
                   "not, ...) only advise instead of refusing the request")


def control_options(args: argparse.Namespace) -> dict:
    """``build_request`` keyword arguments from ``add_control_args``' flags; ValueError
    (one line) when a file cannot be read or the schema is not JSON."""
    out = {flag[2:].replace("-", "_"): getattr(args, flag[2:].replace("-", "_"))
           for flag, _ in CONTROL_FLAGS}
    if args.json_schema:
        text = _read_text(args.json_schema, "--json-schema")
        try:
            json.loads(text)
        except ValueError as exc:
            raise ValueError(f"--json-schema {args.json_schema}: not valid JSON: {exc}") from None
        out["structured_output"] = {"json_schema": text, "loose": args.loose_schema}
    elif args.grammar:
        out["structured_output"] = {"grammar": _read_text(args.grammar, "--grammar")}
    elif args.regex is not None:
        out["structured_output"] = {"regex": args.regex}
    elif args.choice:
        out["structured_output"] = {"choice": args.choice}
    return out


def _read_text(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{flag}: cannot read {path}: {exc}") from None


def _run_generate(args: argparse.Namespace) -> int:
    out = Completion()
    try:
        with connect(args, timeout=args.timeout) as client:
            for msg in client.stream(args.prompt, request_id=args.request_id,
                                     max_tokens=args.max_tokens, temperature=args.temperature,
                                     top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                                     ignore_eos=args.ignore_eos, **control_options(args)):
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
                  f"{r.cache_evictions} evictions{_speculation(r)}")
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


def _speculation(r) -> str:
    """Acceptance rate and mean accepted length, as vLLM reports them ('' when off)."""
    if not r.spec_drafts:
        return ""
    rate = r.spec_accepted_tokens / max(r.spec_draft_tokens, 1)
    return (f"  speculation: {100 * rate:.0f}% of drafted tokens accepted, mean accepted "
            f"length {r.spec_accepted_tokens / r.spec_drafts + 1:.2f}")


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
             add_serve_args, run_serve)
    register("generate", "stream a completion from a running router", _add_generate_args,
             _run_generate)
    register("chat", "chat with the served model in the terminal (streams; /reset, "
             "/system TEXT, /exit)", add_chat_args, run_chat)
    register("status", "show a router's pools, ranks, queues and KV usage", _add_status_args,
             _run_status)
    register("scale", "grow or shrink a pool: pdserve scale prefill|decode N", _add_scale_args,
             _run_scale)
