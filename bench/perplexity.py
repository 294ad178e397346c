"""Perplexity of a model on a fixed English text, as llama.cpp's `llama-perplexity` scores
it: the text is tokenized once, cut into chunks of ``ctx`` tokens, each chunk is run from
its start, and only the second half of each chunk is scored (every scored token sees at
least ctx/2 tokens of context).

The text ships with Python (``pydoc_data.topics``: the language reference's topic
pages), so every machine scores the same tokens without a download.

    pdserve bench perplexity [--model M] [--ctx 512] [--chunks 16] [--decode-steps]
                             [--activation-precision auto|int8|fp32]
                             [--kv-precision auto|fp16|fp32]
                             [--transformers] [--llama-perplexity PATH/TO/llama-perplexity]

pdserve's figure comes from its own model runner (the same weights and kernels that
serve): each chunk in one forward pass (prefill's path: a GGUF file's quantized blocks
in place, where it has them, multiplied by int8 activations over an fp16 KV cache by
default); for a quantized file also the same with fp32 activations over an fp32 cache
(``activation_precision="fp32"``, ``kv_precision="fp32"``: what the rounded ones are
held to: its perplexity, with the ratio's standard error over the chunks, and the
mean KL divergence of the next-token distributions from it, the steadier figure) and on its weights dequantized
to fp32 (``quantization="none"``, the reference the quantized kernels are held to);
with ``--decode-steps`` also its scored half one token at a time through the
decode step, the path a served token takes; ``--transformers`` adds transformers' on
the same GGUF (fp32, dequantized), and
``--llama-perplexity`` adds llama.cpp's on the file (it multiplies quantized weights, so
it differs a little). Writes results/bench_perplexity.json.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from pydoc_data.topics import topics

from pdserve.engine.config import ACTIVATION_PRECISIONS, KV_PRECISIONS
from pdserve.engine.model.catalog import resolve_model
from pdserve.engine.model.tokenizer import Tokenizer


def reference_text() -> str:
    """A fixed English text from the standard library: pydoc's topic pages, in key order."""
    return "\n\n".join(topics[key] for key in sorted(topics))


def chunks(token_ids: list[int], ctx: int, count: int) -> list[list[int]]:
    n = min(count, len(token_ids) // ctx)
    return [token_ids[i * ctx:(i + 1) * ctx] for i in range(n)]


def score(logits, chunk: list[int]) -> tuple[float, int]:
    """(sum of negative log-likelihoods, tokens scored) over the chunk's second half;
    ``logits`` [len(chunk), vocab] predict each next token (or only the rows that
    predict the scored half: [len(chunk) - len(chunk) // 2, vocab])."""
    # lazy: torch, only for pdserve's and transformers' runs (not llama.cpp's)
    import torch

    first = len(chunk) // 2
    if len(logits) == len(chunk):
        logits = logits[first - 1:len(chunk) - 1]
    logp = torch.log_softmax(logits.float(), dim=-1)
    target = torch.tensor(chunk[first:])
    nll = -logp.gather(1, target[:, None]).sum().item()
    return nll, len(target)


def pdserve_logits(runner, chunk: list[int]):
    """Every position's logits for one chunk run from its start on pdserve's runner."""
    # lazy: engine.model_runner imports torch
    from pdserve.engine.model_runner import RunnerRow

    bs = runner.block_size
    table = list(range(1, (len(chunk) + bs - 1) // bs + 1))
    tokens, positions, meta, _ = runner.prepare([RunnerRow(chunk, 0, table, 0)])
    hidden = runner.model(tokens, positions, runner.kv_cache, meta)
    return runner.model.compute_logits(hidden)


def pdserve_decode_logits(runner, chunk: list[int]):
    """The rows predicting the chunk's scored half: its first half in one prefill, then
    each next token as a single-row decode step (a served stream's path)."""
    # lazy: torch and the runner, only for pdserve's runs
    import torch

    from pdserve.engine.model_runner import RunnerRow

    bs, first = runner.block_size, len(chunk) // 2
    table = list(range(1, (len(chunk) + bs - 1) // bs + 1))
    rows = [runner.compute_logits([RunnerRow(chunk[:first], 0, table, 0)])[0]]
    for pos in range(first, len(chunk) - 1):
        rows.append(runner.compute_logits([RunnerRow([chunk[pos]], pos, table, 0)])[0])
    return torch.stack(rows)


def perplexity(logits_of, token_chunks: list[list[int]]) -> float:
    total, count = 0.0, 0
    for chunk in token_chunks:
        nll, n = score(logits_of(chunk), chunk)
        total, count = total + nll, count + n
    return math.exp(total / count)


def divergence(reference, logits, chunk: list[int]) -> tuple[float, int]:
    """(sum of KL(reference || logits) over the chunk's scored rows, rows): how far
    one model's next-token distributions are from another's, whatever the text's tokens
    (``score``'s rows)."""
    # lazy: torch, only for pdserve's runs
    import torch

    first = len(chunk) // 2
    ref = torch.log_softmax(reference[first - 1:len(chunk) - 1].float(), dim=-1)
    got = torch.log_softmax(logits[first - 1:len(chunk) - 1].float(), dim=-1)
    return float((ref.exp() * (ref - got)).sum()), len(ref)


def paired_perplexity(runner, reference, token_chunks: list[list[int]]) -> dict:
    """``runner``'s and ``reference``'s perplexity over the same chunks (one forward
    pass each), and the mean KL divergence of runner's next-token distributions from
    reference's (``compare``)."""
    return compare((pdserve_logits(runner, c), pdserve_logits(reference, c), c)
                   for c in token_chunks)


def compare(chunk_logits) -> dict:
    """From (ours, reference's logits, chunk) per chunk: both perplexities ("ppl",
    "reference_ppl") and the mean KL divergence of ours from the reference ("kl"). The
    KL is the steadier figure: rounding moves each token's log-likelihood up or down, so
    a perplexity difference of a few hundredths of a percent changes sign from one
    equally exact rounding to another (docs/models.md), while the divergence only adds
    up."""
    totals = {"ppl": [0.0, 0], "reference_ppl": [0.0, 0], "kl": [0.0, 0]}  # sum, rows
    differences = []  # per chunk: ours' mean log-likelihood loss less the reference's
    for ours, theirs, chunk in chunk_logits:
        (nll, n), (reference_nll, _) = score(ours, chunk), score(theirs, chunk)
        for key, (total, rows) in (("ppl", (nll, n)), ("reference_ppl", (reference_nll, n)),
                                   ("kl", divergence(theirs, ours, chunk))):
            totals[key][0] += total
            totals[key][1] += rows
        differences.append((nll - reference_nll) / n)
    mean = {key: total / n for key, (total, n) in totals.items()}
    return {"ppl": math.exp(mean["ppl"]), "reference_ppl": math.exp(mean["reference_ppl"]),
            "kl": mean["kl"], "ratio_se": ratio_standard_error(differences)}


def ratio_standard_error(differences: list[float]) -> float | None:
    """The standard error of ln(ppl / reference ppl) from its per-chunk values (chunks
    of one length): how far the ratio could move on another text of as many chunks. Per
    chunk, not per token: a chunk's tokens share their context, so their errors are not
    independent. None below two chunks."""
    if len(differences) < 2:
        return None
    return statistics.stdev(differences) / math.sqrt(len(differences))


def pdserve_runner(model: str, token_chunks: list[list[int]], quantization: str = "auto",
                   activation_precision: str = "auto", kv_precision: str = "auto"):
    # lazy: engine.model_runner imports torch
    from pdserve.engine.model_runner import ModelRunner

    ctx = max(len(c) for c in token_chunks)
    return ModelRunner(model, block_size=16, num_kv_blocks=ctx // 16 + 2, num_state_slots=1,
                       quantization=quantization, activation_precision=activation_precision,
                       kv_precision=kv_precision)


def pdserve_perplexity(model: str, token_chunks: list[list[int]],
                       decode_steps: bool = False, runner=None) -> float:
    """One forward pass per chunk, or (``decode_steps``) the scored half a token at a
    time through the decode step."""
    runner = runner or pdserve_runner(model, token_chunks)
    logits_of = pdserve_decode_logits if decode_steps else pdserve_logits
    return perplexity(lambda c: logits_of(runner, c), token_chunks)


def transformers_perplexity(hf_model, token_chunks: list[list[int]]) -> float:
    # lazy: torch, only for transformers' run
    import torch

    def logits_of(chunk):
        with torch.inference_mode():
            return hf_model(torch.tensor([chunk])).logits[0]

    return perplexity(logits_of, token_chunks)


def load_transformers(model: str):
    # lazy: torch and transformers, only for transformers' run
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(model)
    if path.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                    dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()


def llama_cpp_perplexity(binary: str, model: str, text: str, ctx: int, count: int) -> float:
    """llama.cpp's `llama-perplexity` on the same text (its own tokenizer and chunks)."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write(text)
        f.flush()
        out = subprocess.run([binary, "-m", model, "-f", f.name, "-c", str(ctx),
                              "--chunks", str(count), "-t", "2", "-b", str(ctx)],
                             capture_output=True, text=True, timeout=3600)
    found = re.findall(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
    if not found:
        raise RuntimeError(f"llama-perplexity gave no estimate: {out.stderr[-2000:]}")
    return float(found[-1])


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model (default: the default model)")
    p.add_argument("--ctx", type=int, default=512, help="tokens per chunk (default 512)")
    p.add_argument("--chunks", type=int, default=16, help="chunks scored (default 16)")
    p.add_argument("--activation-precision", default="auto", choices=ACTIVATION_PRECISIONS,
                   help="what pdserve's matmuls multiply (default auto); a quantized "
                        "file's figure is also held to fp32 activations': perplexity and "
                        "mean KL divergence")
    p.add_argument("--kv-precision", default="auto", choices=KV_PRECISIONS,
                   help="what pdserve's KV cache holds (default auto: fp16 where the "
                        "activations are int8); the exact figure beside it keeps fp32")
    p.add_argument("--decode-steps", action="store_true",
                   help="also score each chunk's second half one decode step at a time "
                        "(the quantized decode step, where the file is quantized)")
    p.add_argument("--transformers", action="store_true",
                   help="also score with transformers (fp32) on the same file")
    p.add_argument("--llama-perplexity", default=None,
                   help="path of llama.cpp's llama-perplexity: also score with it")
    p.add_argument("--out", default="results/bench_perplexity.json")


def _held_to_fp32_activations(result: dict, pair: dict, precision: str) -> None:
    """Record and print the figure against fp32 activations' (``paired_perplexity``)."""
    result["pdserve_fp32_activations"] = pair["reference_ppl"]
    result["vs_fp32_activations"] = result["pdserve"] / pair["reference_ppl"] - 1
    result["vs_fp32_activations_se"] = pair["ratio_se"]
    result["kl_vs_fp32_activations"] = pair["kl"]
    se = ("" if pair["ratio_se"] is None else
          f" ± {100 * pair['ratio_se']:.4f}% (a standard error over the chunks)")
    print(f"pdserve fp32 activations PPL {pair['reference_ppl']:.4f}  "
          f"({precision} {100 * result['vs_fp32_activations']:+.4f}%{se}; "
          f"mean KL from it {pair['kl']:.2e} nats a token)", flush=True)


def run(args: argparse.Namespace) -> int:
    model = resolve_model(args.model).path
    text = reference_text()
    ids = Tokenizer.from_model(model).encode(text, add_special_tokens=False)
    token_chunks = chunks(ids, args.ctx, args.chunks)
    result: dict = {"model": model, "ctx": args.ctx, "chunks": len(token_chunks),
                    "text": "pydoc_data.topics", "text_tokens": len(ids)}
    runner = pdserve_runner(model, token_chunks, activation_precision=args.activation_precision,
                            kv_precision=args.kv_precision)
    result["activation_precision"] = args.activation_precision
    result["kv_cache_dtype"] = str(runner.kv_cache.dtype).removeprefix("torch.")
    quantized = runner.model.matmul_quantized()
    # held to fp32 activations over an fp32 cache where either is rounded
    beside = quantized and (args.activation_precision != "fp32"
                            or runner.kv_cache.dtype != runner.dtype)
    t0 = time.perf_counter()
    if beside:  # each chunk beside fp32 activations' (a second runner)
        exact = pdserve_runner(model, token_chunks, activation_precision="fp32",
                               kv_precision="fp32")
        pair = paired_perplexity(runner, exact, token_chunks)
        del exact
        result["pdserve"] = pair["ppl"]
    else:
        result["pdserve"] = pdserve_perplexity(model, token_chunks, runner=runner)
    result["pdserve_s"] = round(time.perf_counter() - t0, 2)
    print(f"pdserve      PPL {result['pdserve']:.4f}  ({result['pdserve_s']} s"
          f"{', fp32 activations beside' if beside else ''}; "
          f"activation_precision={args.activation_precision}, "
          f"KV cache {result['kv_cache_dtype']})", flush=True)
    reference = result["pdserve"]
    if beside:
        _held_to_fp32_activations(result, pair, args.activation_precision)
    if quantized:
        fp32 = pdserve_runner(model, token_chunks, quantization="none")
        reference = result["pdserve_fp32"] = pdserve_perplexity(model, token_chunks, runner=fp32)
        result["pdserve_vs_fp32"] = result["pdserve"] / reference - 1
        print(f"pdserve fp32 PPL {reference:.4f}  (the quantized weights "
              f"{100 * result['pdserve_vs_fp32']:+.4f}%)", flush=True)
    if args.decode_steps:
        t0 = time.perf_counter()
        result["pdserve_decode_steps"] = pdserve_perplexity(model, token_chunks, True, runner)
        result["decode_steps_vs_reference"] = result["pdserve_decode_steps"] / reference - 1
        print(f"pdserve decode steps PPL {result['pdserve_decode_steps']:.4f}  "
              f"({100 * result['decode_steps_vs_reference']:+.4f}% against one forward pass"
              f"{' on fp32' if 'pdserve_fp32' in result else ''}; "
              f"{time.perf_counter() - t0:.1f} s)", flush=True)
    if args.transformers:
        t0 = time.perf_counter()
        result["transformers"] = transformers_perplexity(load_transformers(model), token_chunks)
        result["pdserve_vs_transformers"] = result["pdserve"] / result["transformers"] - 1
        print(f"transformers PPL {result['transformers']:.4f}  (pdserve "
              f"{100 * result['pdserve_vs_transformers']:+.3f}%; "
              f"{time.perf_counter() - t0:.1f} s)", flush=True)
    if args.llama_perplexity:
        result["llama_cpp"] = llama_cpp_perplexity(args.llama_perplexity, model, text,
                                                   args.ctx, len(token_chunks))
        result["pdserve_vs_llama_cpp"] = result["pdserve"] / result["llama_cpp"] - 1
        print(f"llama.cpp    PPL {result['llama_cpp']:.4f}  (pdserve "
              f"{100 * result['pdserve_vs_llama_cpp']:+.3f}%)", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0
