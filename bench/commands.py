"""`pdserve bench BENCHMARK`: the subcommands, each a benchmark module's arguments and
run (`pdserve bench --help` lists them)."""

from __future__ import annotations

import argparse


def add_bench_args(p: argparse.ArgumentParser) -> None:
    from pdserve.bench import (
        choices,
        compare_modes,
        gpu,
        kv_transfer,
        peers,
        perplexity,
        serve,
        speculative,
        structured_output,
    )

    sub = p.add_subparsers(dest="bench", metavar="BENCHMARK")
    sub.required = True
    s = sub.add_parser("serve", help="load a running router (vllm bench serve's metrics)",
                       description=serve.__doc__.splitlines()[0])
    serve.add_serve_args(s)
    s.set_defaults(_bench=serve.run_serve)
    c = sub.add_parser("compare-modes", help="same mixed workload: disaggregated vs normal",
                       description=compare_modes.__doc__.splitlines()[0])
    compare_modes.add_args(c)
    c.set_defaults(_bench=compare_modes.run)
    k = sub.add_parser("kv-transfer", help="KV hand-off bandwidth per transport vs memcpy",
                       description=kv_transfer.__doc__.splitlines()[0])
    kv_transfer.add_args(k)
    k.set_defaults(_bench=kv_transfer.run)
    n = sub.add_parser("choices", help="n choices of a prompt: forks vs n separate requests",
                       description=choices.__doc__.splitlines()[0])
    choices.add_args(n)
    n.set_defaults(_bench=choices.run)
    x = sub.add_parser("perplexity", help="perplexity on a fixed text, beside transformers "
                       "and llama.cpp", description=perplexity.__doc__.splitlines()[0])
    perplexity.add_args(x)
    x.set_defaults(_bench=perplexity.run)
    q = sub.add_parser("peers", help="pdserve beside llama.cpp and vLLM on the same model, "
                       "one run", description=peers.__doc__.splitlines()[0])
    peers.add_args(q)
    q.set_defaults(_bench=peers.run)
    g = sub.add_parser("structured-output", help="16 streams, half under a JSON schema, "
                       "beside all unconstrained; compile times",
                       description=structured_output.__doc__.splitlines()[0])
    structured_output.add_args(g)
    g.set_defaults(_bench=structured_output.run)
    d = sub.add_parser("speculative", help="n-gram speculative decoding off vs on: ITL at 1 "
                       "stream, tok/s at 8, copy-heavy and open chat; acceptance",
                       description=speculative.__doc__.splitlines()[0])
    speculative.add_args(d)
    d.set_defaults(_bench=speculative.run)
    u = sub.add_parser("gpu", help="decode and prefill on a GPU beside the bandwidth roofline "
                       "and transformers (random-weight Llama shapes)",
                       description=gpu.__doc__.splitlines()[0])
    gpu.add_args(u)
    u.set_defaults(_bench=gpu.run)


def run_bench(args: argparse.Namespace) -> int:
    return int(args._bench(args) or 0)


def register_commands(register) -> None:
    register("bench", "benchmarks: serve (load a router), compare-modes, kv-transfer, choices, "
             "perplexity, peers, structured-output, speculative, gpu",
             add_bench_args, run_bench)
