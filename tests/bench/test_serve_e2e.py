"""The serving benchmark against a real router on the tiny model, its numbers checked
against an independent count: a client wrapper that timestamps and counts on its own."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from pdserve.bench.datasets import arrival_offsets, random_requests
from pdserve.bench.serve import main as serve_main
from pdserve.bench.serve import run_benchmark
from pdserve.router.client import AsyncClient

VOCAB = 4096


class CountingClient(AsyncClient):
    """AsyncClient that records, per call, its own send time, message arrival times,
    tokens per message, the request id and the peak number of streams open."""

    def __init__(self, address: str) -> None:
        super().__init__(address)
        self.calls: list[dict] = []
        self.open = 0
        self.peak = 0

    async def stream(self, prompt, **kwargs):
        call = {"send": time.perf_counter(), "times": [], "tokens": [], "rid": "",
                "max_tokens": kwargs.get("max_tokens"), "finish": "", "usage": None}
        self.calls.append(call)
        self.open += 1
        self.peak = max(self.peak, self.open)
        try:
            async for msg in super().stream(prompt, **kwargs):
                call["times"].append(time.perf_counter())
                call["tokens"].append(len(msg.token_ids))
                call["rid"] = msg.request_id or call["rid"]
                if msg.finish_reason:
                    call["finish"] = msg.finish_reason
                    call["usage"] = msg.usage.completion_tokens
                yield msg
        finally:
            self.open -= 1


def run_counted(address, requests, **kwargs):
    async def go():
        client = CountingClient(address)
        try:
            result = await run_benchmark(address, requests, client=client, progress=False,
                                         **kwargs)
        finally:
            await client.close()
        return result, client

    return asyncio.run(go())


def test_numbers_match_an_independent_count(router_address):
    reqs = random_requests(6, 24, 6, vocab_size=VOCAB, range_ratio=0.5, seed=3)
    result, client = run_counted(router_address, reqs, max_concurrency=2,
                                 slos={"ttft": 60_000, "tpot": 60_000})
    assert result["completed"] == 6 and result["failed"] == 0, result["errors"]
    assert set(result["finish_reasons"]) == {"length"}
    calls = {c["rid"]: c for c in client.calls}
    assert len(client.calls) == 6 + 1  # plus the warm-up
    assert client.peak <= 2  # --max-concurrency held
    total = 0
    for i, rid in enumerate(result["request_ids"]):
        c = calls[rid]
        # Tokens: the wrapper's count = the benchmark's = the server's usage = max_tokens.
        n = sum(c["tokens"])
        total += n
        assert result["output_lens"][i] == n == c["usage"] == reqs[i].output_len
        assert result["usage_completion_tokens"][i] == n
        assert result["input_lens"][i] == reqs[i].prompt_len
        # TTFT: first token-bearing message minus send, as the wrapper saw them. The
        # benchmark's clock readings bracket the wrapper's (send before, arrival after).
        first = next(t for t, k in zip(c["times"], c["tokens"], strict=True) if k)
        own_ttft = first - c["send"]
        assert 0 <= result["ttfts"][i] - own_ttft < 0.05
        # One ITL per token-bearing message after the first.
        chunks = [k for k in c["tokens"] if k]
        assert len(result["itls"][i]) == len(chunks) - 1
        assert result["chunk_tokens"][i] == chunks
        own_e2el = c["times"][-1] - c["send"]
        assert 0 <= result["e2els"][i] - own_e2el < 0.05
        assert result["tpots"][i] == pytest.approx(
            (result["e2els"][i] - result["ttfts"][i]) / (n - 1))
    assert result["total_output_tokens"] == total
    assert result["total_input_tokens"] == sum(r.prompt_len for r in reqs)
    assert result["output_throughput"] == pytest.approx(total / result["duration"])
    assert result["request_goodput"] == pytest.approx(6 / result["duration"])
    assert result["max_concurrent_requests"] <= 2
    assert result["cluster"]["mode"] == "disaggregated"
    steps = result["rank_step_deltas"]
    assert steps["decode/0"]["num_steps"] > 0 and steps["prefill/0"]["num_steps"] > 0


def test_sends_follow_the_arrival_schedule(router_address):
    reqs = random_requests(5, 16, 3, vocab_size=VOCAB, seed=4)
    result, client = run_counted(router_address, reqs, request_rate=8.0, burstiness=1.0,
                                 seed=11, num_warmups=0)
    assert result["completed"] == 5
    planned = arrival_offsets(5, 8.0, 1.0, seed=11)
    for sent, plan in zip(result["send_offsets"], planned, strict=True):
        assert plan - 1e-3 <= sent < plan + 0.5
    assert result["request_rate"] == 8.0 and result["burstiness"] == 1.0


def test_cli_writes_json_and_pngs(router_address, tiny_model_dir, tmp_path):
    out = tmp_path / "serve.json"
    rc = serve_main(["--address", router_address, "--model", tiny_model_dir,
                     "--num-prompts", "3", "--random-input-len", "20",
                     "--random-output-len", "4", "--prompt-format", "text",
                     "--request-rate", "50", "--goodput", "ttft:60000", "e2el:60000",
                     "--disable-tqdm", "--result-file", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    for key in ("completed", "total_input_tokens", "total_output_tokens", "request_throughput",
                "output_throughput", "total_token_throughput", "request_goodput", "duration",
                "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms",
                "mean_itl_ms", "p99_itl_ms", "mean_e2el_ms", "p99_e2el_ms", "ttfts", "itls",
                "input_lens", "output_lens", "errors", "finish_reasons"):
        assert key in r, key
    assert r["completed"] == 3 and r["output_lens"] == [4, 4, 4]
    # Text prompts: the length recorded (re-encoded here) is the router's count.
    assert r["input_lens"] == r["usage_prompt_tokens"]
    assert (tmp_path / "serve.png").stat().st_size > 10_000

    sweep = tmp_path / "sweep.json"
    rc = serve_main(["--address", router_address, "--model", tiny_model_dir,
                     "--num-prompts", "2", "--random-input-len", "16", "--random-output-len",
                     "3", "--sweep-rates", "20,inf", "--disable-tqdm", "--result-file",
                     str(sweep)])
    assert rc == 0
    s = json.loads(sweep.read_text())
    assert s["sweep_rates"] == [20.0, "inf"]
    assert [run["completed"] for run in s["runs"]] == [2, 2]
    assert (tmp_path / "sweep.png").stat().st_size > 10_000
    assert (tmp_path / "sweep_cdf.png").stat().st_size > 10_000


def test_unreachable_router_is_a_clear_error(tmp_path):
    reqs = random_requests(1, 4, 2, vocab_size=VOCAB)
    with pytest.raises(RuntimeError, match="warm-up"):
        asyncio.run(run_benchmark("127.0.0.1:1", reqs, request_timeout=5, progress=False))
