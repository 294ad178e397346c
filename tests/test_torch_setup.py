"""`make setup`'s torch (scripts/torch_setup.py): the pinned CPU build without an NVIDIA
driver (as before), a CUDA build with one (pip isolated from the local CPU file, a CPU
build installed replaced), and a CUDA build already installed kept."""

from __future__ import annotations


def test_each_machine_gets_its_torch(repo_module, tmp_path):
    setup = repo_module("scripts/torch_setup.py")
    assert setup.pip_args(False, None) == ["install", "--quiet", "torch==2.13.0"]
    assert setup.pip_args(False, ("2.13.0+cpu", None)) == ["install", "--quiet", "torch==2.13.0"]
    assert setup.pip_args(True, None) == ["--isolated", "install", "--quiet", "torch==2.13.0"]
    assert setup.pip_args(True, ("2.13.0+cpu", None)) == [
        "--isolated", "install", "--quiet", "--force-reinstall", "torch==2.13.0"]
    assert setup.pip_args(True, ("2.12.0", "12.8")) is None  # the user's CUDA torch
    assert setup.pip_args(False, ("2.12.0", "12.8")) is None


def test_the_driver_is_seen_from_the_kernels_file(repo_module, tmp_path, monkeypatch):
    setup = repo_module("scripts/torch_setup.py")
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    assert not setup.nvidia_driver(tmp_path / "version")
    (tmp_path / "version").write_text("NVRM version: NVIDIA UNIX Open Kernel Module 580.00\n")
    assert setup.nvidia_driver(tmp_path / "version")


def test_this_machine_keeps_its_cpu_build(repo_module, capsys):
    setup = repo_module("scripts/torch_setup.py")
    assert setup.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    import torch

    if torch.version.cuda:
        assert "kept" in out
    elif setup.nvidia_driver():
        assert out.startswith("NVIDIA driver found") and "--isolated" in out
    else:
        assert out.startswith("no NVIDIA driver") and "torch==2.13.0" in out
