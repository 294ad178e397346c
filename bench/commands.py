"""`pdserve bench BENCHMARK`: the subcommands, each a benchmark module's arguments and
run (`pdserve bench --help` lists them)."""

from __future__ import annotations

import argparse


def add_bench_args(p: argparse.ArgumentParser) -> None:
    # lazy: `import pdserve.cli` stays light: each benchmark loads when the parser is built
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
    for name, module, help_text in (  # each module has add_args(parser) and run(args)
        ("compare-modes", compare_modes, "same mixed workload: disaggregated vs normal"),
        ("kv-transfer", kv_transfer, "KV hand-off bandwidth per transport vs memcpy"),
        ("choices", choices, "n choices of a prompt: forks vs n separate requests"),
        ("perplexity", perplexity, "perplexity on a fixed text, beside transformers and "
         "llama.cpp"),
        ("peers", peers, "pdserve beside llama.cpp and vLLM on the same model, one run"),
        ("structured-output", structured_output, "16 streams, half under a JSON schema, "
         "beside all unconstrained; compile times"),
        ("speculative", speculative, "n-gram speculative decoding off vs on: ITL at 1 "
         "stream, tok/s at 8, copy-heavy and open chat; acceptance"),
        ("gpu", gpu, "decode and prefill on a GPU beside the bandwidth roofline and "
         "transformers (random-weight Llama shapes)"),
    ):
        parser = sub.add_parser(name, help=help_text, description=module.__doc__.splitlines()[0])
        module.add_args(parser)
        parser.set_defaults(_bench=module.run)


def run_bench(args: argparse.Namespace) -> int:
    return int(args._bench(args) or 0)


def register_commands(register) -> None:
    register("bench", "benchmarks: serve (load a router), compare-modes, kv-transfer, choices, "
             "perplexity, peers, structured-output, speculative, gpu",
             add_bench_args, run_bench)
