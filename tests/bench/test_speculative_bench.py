"""bench speculative without a server: its command line, the two chat workloads (the copy
prompts hold the text their answers copy), the off/on alternation, the acceptance
figures from the engines' (or vLLM's) counters, and the summary of synthetic runs."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.bench import speculative as spec


def test_cli_is_registered_with_the_issue_defaults():
    from pdserve.cli import build_parser

    args = build_parser().parse_args(["bench", "speculative"])
    assert args.mode == "disaggregated" and args.rounds == 2 and args.max_tokens == 128
    assert args.streams == 8 and args.num_speculative_tokens == 5
    assert not args.ignore_eos and not args.vllm
    assert args.result_file == "results/bench_speculative.json"
    args = build_parser().parse_args(["bench", "speculative", "--mode", "normal",
                                      "--rounds", "3", "--vllm", "--ignore-eos"])
    assert args.mode == "normal" and args.rounds == 3 and args.vllm and args.ignore_eos
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "speculative", "--mode", "both"])


def test_workloads_are_varied_chat_turns_and_copy_prompts_hold_their_text():
    copy, open_ = spec.build_workload("copy"), spec.build_workload("open")
    for convs in (copy, open_):
        assert 8 <= len(convs) <= 16
        assert all(len(c) == 1 and c[0]["role"] == "user" for c in convs)
        assert len({c[0]["content"] for c in convs}) == len(convs)
    texts = [c[0]["content"] for c in copy]
    for source in (*spec.PARAGRAPHS, *spec.CODE):
        assert any(source in t for t in texts)
    assert not any(p[:40] in c[0]["content"] for c in open_ for p in spec.PARAGRAPHS)


def test_rounds_alternate_off_on_on_off():
    assert spec.alternate(1) == [False, True]
    assert spec.alternate(2) == [False, True, True, False]
    assert spec.alternate(3) == [False, True, True, False, False, True]


def test_acceptance_from_counters_summed_and_differenced():
    def rank(drafts, drafted, accepted, per_pos, state="alive"):
        return {"spec_drafts": drafts, "spec_draft_tokens": drafted,
                "spec_accepted_tokens": accepted, "spec_accepted_per_pos": per_pos,
                "state": state}

    before = spec.spec_counters({"prefill": [rank(0, 0, 0, [])],
                                 "decode": [rank(2, 6, 3, [2, 1])]})
    after = spec.spec_counters({"prefill": [rank(0, 0, 0, [])],
                                "decode": [rank(6, 20, 11, [5, 4, 2]), rank(9, 9, 9, [9], "dead")]})
    delta = spec.combine(after, before, -1)
    assert delta == {"spec_drafts": 4, "spec_draft_tokens": 14, "spec_accepted_tokens": 8,
                     "spec_accepted_per_pos": [3, 3, 2]}
    a = spec.acceptance(delta)
    assert a["rate"] == 8 / 14 and a["mean_accepted_len"] == 8 / 4 + 1
    assert a["rate_per_pos"] == [0.75, 0.75, 0.5]
    assert spec.acceptance(None) is None
    assert spec.spec_counters({"decode": [{"num_steps": 3, "state": "alive"}]}) is None


def test_vllm_metrics_parse():
    text = "\n".join([
        "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="peer"} 10.0',
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="peer"} 50.0',
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="peer"} 20.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="1"} 5.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 8.0',
        'vllm:num_requests_running{engine="0"} 0.0'])
    assert spec.parse_vllm_metrics(text) == {
        "spec_drafts": 10, "spec_draft_tokens": 50, "spec_accepted_tokens": 20,
        "spec_accepted_per_pos": [8, 5]}


def _fake_run(delay: float, tokens_per_msg: int, answer: list[int]) -> dict:
    async def send(conv, record):
        for i in range(0, len(answer), tokens_per_msg):
            await asyncio.sleep(delay)
            record.chunk(answer[i:i + tokens_per_msg])

    workloads = {w: spec.build_workload(w)[:3] for w in spec.WORKLOADS}
    args = type("A", (), {"streams": 2, "concurrent_requests": 4})()
    counters = iter(range(100))

    def count():
        n = next(counters)
        return {"spec_drafts": n, "spec_draft_tokens": 2 * n, "spec_accepted_tokens": n,
                "spec_accepted_per_pos": [n]}

    return asyncio.run(spec.serve_phases(send, workloads, args, count))


def test_phases_summary_ratios_and_outputs():
    off = _fake_run(0.004, 1, [1, 2, 3, 4, 5])
    on = _fake_run(0.004, 2, [1, 2, 3, 4, 5])
    assert set(off) == {"copy/single", "copy/concurrent", "open/single", "open/concurrent"}
    assert off["copy/single"]["stats"]["requests"] == 3
    assert off["copy/concurrent"]["stats"]["requests"] == 4
    assert off["copy/single"]["stats"]["tokens_per_message"] == 1.0
    assert on["copy/single"]["stats"]["tokens_per_message"] == 4 / 2
    assert on["copy/single"]["counters"]["spec_drafts"] == 1  # read around the phase
    changed = _fake_run(0.004, 2, [1, 2, 3, 4, 6])
    side = spec.side_report([(False, off), (True, on), (True, changed), (False, off)])
    s = side["summary"]["copy/single"]
    assert 1.2 < s["itl_p50_off_over_on"] < 3  # two tokens a message: about half the ITL
    assert side["outputs"] == {"off_vs_on": 14, "off_vs_off": 0, "compared_on": 28}
    assert side["acceptance"]["copy"]["drafts"] == 4
    assert set(side["verdicts"]) == {"copy", "open"}
    table = spec.format_table(side, "pdserve")
    assert "| copy | single |" in table and "copy acceptance: rate 0.500" in table


def test_the_peers_folder_gets_both_names_of_the_tied_embedding(tmp_path):
    """peers.py's folder: safetensors keeps a tied weight once (lm_head.weight) and vLLM
    then leaves the embedding unloaded; an existing folder is mended in place."""
    import torch
    from safetensors.torch import load_file, save_file

    from pdserve.bench.peers import hf_folder

    folder = tmp_path / "m-hf"
    folder.mkdir()
    (folder / "config.json").write_text('{"tie_word_embeddings": true}')
    head = torch.arange(6, dtype=torch.float32).reshape(3, 2)
    save_file({"lm_head.weight": head}, folder / "model.safetensors")
    assert hf_folder(str(tmp_path / "m.gguf"), folder) == folder
    tensors = load_file(folder / "model.safetensors")
    assert torch.equal(tensors["model.embed_tokens.weight"], head)
    assert torch.equal(tensors["lm_head.weight"], head)


def test_vllm_is_skipped_without_its_venv(tmp_path):
    args = type("A", (), {"vllm_python": str(tmp_path / "python"), "model": None})()
    assert "no such interpreter" in spec.run_vllm(args, {})["skipped"]
