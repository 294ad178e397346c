"""bench peers and its chat workload, without starting peers: the prompts are chat
turns rendered by the model's template, all different (no server answers one from a
prompt cache); the table's ratios are to llama.cpp's row of the same concurrency; a
missing llama.cpp build is reported as missing."""

from __future__ import annotations

import pytest

from pdserve.bench import llama_cpp, peers
from pdserve.bench.datasets import chat_requests
from pdserve.engine.model.tokenizer import Tokenizer
from pdserve.router.chat_template import ChatTemplate


def test_chat_workload_is_rendered_and_unique(real_model_path):
    template = ChatTemplate.from_model_dir(real_model_path)
    tokenizer = Tokenizer.from_model(real_model_path)
    reqs = chat_requests(12, 64, chat_template=template, tokenizer=tokenizer, seed=7)
    assert len({r.prompt for r in reqs}) == 12
    for r in reqs:
        assert r.prompt.startswith("<|im_start|>system\n")
        assert r.prompt.endswith("<|im_start|>assistant\n")
        assert r.prompt_len == len(template.encode(tokenizer, r.prompt))
        assert r.output_len == 64 and r.kind == "chat"
    again = chat_requests(12, 64, chat_template=template, tokenizer=tokenizer, seed=7)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]  # a function of the seed
    other = chat_requests(12, 64, chat_template=template, tokenizer=tokenizer, seed=8)
    assert not {r.prompt for r in other} & {r.prompt for r in reqs}
    ids = chat_requests(2, 8, chat_template=template, tokenizer=tokenizer, seed=7,
                        prompt_format="ids")
    assert ids[0].prompt == template.encode(tokenizer, reqs[0].prompt)


def test_table_ratios_are_to_llama_cpp_at_the_same_concurrency():
    def row(server, c, tps):
        return {"server": server, "concurrency": c, "output_throughput": tps,
                "median_ttft_ms": 10.0, "p99_ttft_ms": 20.0, "median_itl_ms": 5.0,
                "p99_itl_ms": 9.0}

    table = peers.format_table([row("pdserve 1P+1D", 1, 50.0), row("pdserve 1P+1D", 16, 300.0),
                                row("llama.cpp", 1, 100.0), row("llama.cpp", 16, 200.0),
                                row("vLLM-CPU", 4, 80.0)], [1, 4, 16])
    lines = table.splitlines()
    assert "| pdserve 1P+1D | 1 | 50.0 |" in lines[2] and lines[2].endswith("| 0.50x |")
    assert lines[3].endswith("| 1.50x |")
    assert lines[6].endswith("| - |")  # no llama.cpp row at 4 streams


def test_missing_llama_cpp_build_is_none(tmp_path):
    assert llama_cpp.binaries(tmp_path) is None
    bin_dir = tmp_path / "build" / "bin"
    bin_dir.mkdir(parents=True)
    for name in llama_cpp.TARGETS:
        (bin_dir / name).write_text("")
    assert set(llama_cpp.binaries(tmp_path)) == set(llama_cpp.TARGETS)


def test_an_avx2_llama_cpp_build_has_its_own_folder_and_flags():
    assert llama_cpp.build_dir("avx2") == llama_cpp.build_dir().with_name(
        llama_cpp.build_dir().name + "-avx2")
    assert "-DGGML_AVX512=OFF" in llama_cpp.ISA_FLAGS["avx2"]
    assert "-DGGML_NATIVE=OFF" in llama_cpp.ISA_FLAGS["avx2"]
    with pytest.raises(ValueError, match="isa must be one of native, avx2"):
        llama_cpp.ensure_built(isa="sse9")


def test_peers_run_without_pdserves_openmp_tuning(monkeypatch, tmp_path):
    """OMP_WAIT_POLICY=PASSIVE (make serve's, pdserve's ranks') halves llama.cpp's speed:
    the peers start without it, pdserve's own servers with it."""
    started = {}

    class Recorder:
        def __init__(self, name, cmd, port, env=None, health="/health", log_dir=None):
            started[name] = env

    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("PDSERVE_PEERS_PROBE", "kept")
    monkeypatch.setattr(peers, "Server", Recorder)
    monkeypatch.setattr(peers, "ensure_built", lambda isa: {"llama-server": tmp_path / "x"})
    peers.llama_cpp_server("m.gguf", tmp_path, 4)
    peers.vllm_server("python", tmp_path, tmp_path, 4)
    peers.pdserve_server("pdserve 1P+1D", "m.gguf", [], tmp_path)
    for peer in ("llama.cpp", "vLLM-CPU"):
        assert "OMP_WAIT_POLICY" not in started[peer], peer
        assert started[peer]["PDSERVE_PEERS_PROBE"] == "kept"
    assert started["pdserve 1P+1D"]["OMP_WAIT_POLICY"] == "PASSIVE"


def test_llama_cpp_args_reach_llama_servers_command_line(monkeypatch, tmp_path):
    """`--llama-cpp-arg=--no-repack` (repeatable; with `=`, since the value starts with a
    dash) ends llama-server's command line."""
    import argparse

    commands = {}

    class Recorder:
        def __init__(self, name, cmd, port, env=None, health="/health", log_dir=None):
            commands[name] = cmd

    monkeypatch.setattr(peers, "Server", Recorder)
    monkeypatch.setattr(peers, "ensure_built", lambda isa: {"llama-server": tmp_path / "x"})
    p = argparse.ArgumentParser()
    peers.add_args(p)
    args = p.parse_args(["--llama-cpp", "--llama-cpp-arg=--no-repack",
                         "--llama-cpp-arg=-fa"])
    assert args.llama_cpp_arg == ["--no-repack", "-fa"]
    peers.llama_cpp_server("m.gguf", tmp_path, 4, "native", tuple(args.llama_cpp_arg))
    assert commands["llama.cpp"][-2:] == ["--no-repack", "-fa"]
    assert p.parse_args([]).llama_cpp_arg == []
