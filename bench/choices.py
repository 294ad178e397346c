"""n completions of one prompt: one request with n choices (forks) vs n separate requests.

    pdserve bench choices                        # disaggregated and normal, n = 4
    pdserve bench choices --n 8 --num-prompts 8 --prompt-len 1024 --modes disaggregated

Brings up a router in this process (embedded Ray, loopback only) per mode and serves
the same seeded work both ways, alternating, `--repeats` times: every prompt once with
`n` choices (`GenerateRequest.n`: one prefill, one KV hand-off, the choices forked), and
every prompt as `n` separate requests with seeds `seed + i` (what choice i samples
with, so both ways return the same tokens: checked). Reported per mode, medians over
the repeats: wall time, prompt tokens the prefill ranks computed and hand-offs (from the
ranks' step timelines), and separate / forked ratios measured side by side in one run.
Writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

from pdserve.bench.harness import RouterHarness, start_embedded_ray
from pdserve.bench.standalone import standalone_main
from pdserve.router.client import AsyncClient
from pdserve.router.config import PoolConfig, RouterConfig

MODES = ("disaggregated", "normal")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated: " + ", ".join(MODES))
    p.add_argument("--n", type=int, default=4, help="choices per prompt")
    p.add_argument("--num-prompts", type=int, default=6)
    p.add_argument("--prompt-len", type=int, default=768, help="prompt tokens")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="model folder (default: the built-in tiny)")
    p.add_argument("--result-file", default="results/bench_choices.json")


def _router_config(model: str, mode: str, n: int):
    engine = dict(num_kv_blocks=512, max_num_seqs=64, block_size=16)
    pools = dict(
        prefill=PoolConfig("prefill", replicas=1, num_cpus=0.5, resources={"prefill": 1},
                           engine=engine),
        decode=PoolConfig("decode", replicas=1, num_cpus=0.5, resources={"decode": 1},
                          engine=engine),
        normal=PoolConfig("normal", replicas=1, num_cpus=0.5, engine=engine))
    return RouterConfig(model_dir=model, port=0, http_port=0, mode=mode,
                        max_choices=max(n, 16), **pools)


async def _serve(address: str, prompts: list[list[int]], n: int, forked: bool,
                 settings: dict) -> list[list[int]]:
    async with AsyncClient(address, timeout=600) as client:
        if forked:
            outs = await asyncio.gather(*(client.generate_choices(p, n, **settings)
                                          for p in prompts))
            results = [o for group in outs for o in group]
        else:
            seed = settings["seed"]
            rest = {k: v for k, v in settings.items() if k != "seed"}
            results = await asyncio.gather(*(client.generate(p, seed=seed + i, **rest)
                                             for p in prompts for i in range(n)))
    bad = [r for r in results if r.finish_reason != "length"]
    if bad:
        raise RuntimeError(f"{len(bad)} requests did not finish: {bad[0].finish_reason} "
                           f"{bad[0].error}")
    return [list(r.token_ids) for r in results]


def _one_run(harness, prompts, n: int, forked: bool, settings: dict) -> tuple[dict, list]:
    t0_unix = time.time()
    started = time.perf_counter()
    tokens = asyncio.run(_serve(harness.address, prompts, n, forked, settings))
    wall = time.perf_counter() - started
    time.sleep(0.3)  # the ranks' last step records
    records = harness.call(harness.service.timeline(t0_unix))
    prompt_pool = "prefill" if harness.service.disaggregated else "normal"
    prompt_steps = [r for r in records if r["pool"] == prompt_pool and r["kind"] == "prompt"]
    return {
        "wall_s": wall,
        "prefill_tokens": sum(r["num_tokens"] for r in prompt_steps),
        "prompt_steps": len(prompt_steps),
        "handoffs": sum(r["num_handoffs"] for r in prompt_steps),
        "imports": sum(r["kind"] == "import" for r in records),
        "output_tokens_per_s": sum(len(t) for t in tokens) / wall,
    }, tokens


def _median(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def run(args: argparse.Namespace) -> int:
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown or args.n < 2:
        print(f"error: modes must be among {MODES} and n >= 2 (got {unknown or args.n})",
              file=sys.stderr)
        return 2
    model = start_embedded_ray(args.model)  # before ray is imported: it binds loopback then
    # lazy: ray after start_embedded_ray: Ray reads its loopback settings at import
    import ray

    rng = random.Random(args.seed)
    prompts = [[1] + [rng.randrange(3, 4000) for _ in range(args.prompt_len - 1)]
               for _ in range(args.num_prompts)]
    settings = dict(max_tokens=args.max_tokens, temperature=1.0, top_k=50, seed=args.seed + 17,
                    ignore_eos=True)
    report: dict = {"args": {k: v for k, v in vars(args).items() if not callable(v)},
                    "modes": {}}
    try:
        for mode in modes:
            harness = RouterHarness(_router_config(model, mode, args.n))
            try:
                _one_run(harness, prompts[:1], args.n, True, settings)  # warm up both paths
                _one_run(harness, prompts[:1], args.n, False, settings)
                runs: dict[str, list[dict]] = {"forked": [], "separate": []}
                outputs: dict[str, list] = {}
                for r in range(args.repeats):
                    order = ("forked", "separate") if r % 2 == 0 else ("separate", "forked")
                    for way in order:
                        stats, tokens = _one_run(harness, prompts, args.n, way == "forked",
                                                 settings)
                        runs[way].append(stats)
                        outputs[way] = tokens
                        print(f"[{mode} {r + 1}/{args.repeats}] {way:8s} "
                              f"{stats['wall_s']:6.2f}s  prefill tokens "
                              f"{stats['prefill_tokens']:6d}  hand-offs {stats['handoffs']:3d}",
                              flush=True)
            finally:
                harness.close()
            forked, separate = _median(runs["forked"]), _median(runs["separate"])
            report["modes"][mode] = {
                "forked": forked, "separate": separate, "runs": runs,
                "same_tokens": outputs["forked"] == outputs["separate"],
                "ratios_separate_over_forked": {
                    k: separate[k] / forked[k] for k in ("wall_s", "prefill_tokens",
                                                         "output_tokens_per_s")
                    if forked[k]},
            }
    finally:
        ray.shutdown()
    for mode, r in report["modes"].items():
        ratios = r["ratios_separate_over_forked"]
        print(f"{mode}: forked {r['forked']['wall_s']:.2f}s vs separate "
              f"{r['separate']['wall_s']:.2f}s (separate/forked wall {ratios['wall_s']:.2f}x, "
              f"prefill tokens {ratios['prefill_tokens']:.2f}x, "
              f"output tok/s {ratios['output_tokens_per_s']:.2f}x); "
              f"same tokens: {r['same_tokens']}")
    out = Path(args.result_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return 0 if all(r["same_tokens"] for r in report["modes"].values()) else 1


main = standalone_main(__doc__, add_args, run)


if __name__ == "__main__":
    sys.exit(main())
