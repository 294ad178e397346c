"""The ``device`` KV transport between two processes against a device memcpy, both
paths it has (``scripts/gpu_check.py``'s ``device_transport`` section):

- ``ipc`` (one node, CUDA): the source shares each payload (``SharePayload``, as a rank
  answers the router), the destination maps it, copies it into a tensor of its own (as
  an import copies into its blocks) and unmaps it, all timed per hand-off;
- ``pair``: a pair group's send and receive (NCCL across two GPUs; on one GPU gloo staged
  through the host, since NCCL refuses two ranks on one GPU; gloo on CPUs).

Reported per size: MiB/s, milliseconds a hand-off, and the ratio to a device copy of
the same bytes in the same run (``memcpy_mib_s``). Each rank is a process of its own
(``spawn``); a rank that fails or hangs is reported, never waited on past its bound.

    python -m pdserve.bench.device_transport [--device cuda] [--sizes 16,64,256]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch

from pdserve.kv_transfer.device.calls import SharePayload
from pdserve.kv_transfer.device.cuda_ipc import IpcHandle, Mapper
from pdserve.kv_transfer.device.endpoint import DeviceEndpoint

SIZES_MIB = (16, 64, 256)
RESULT_TIMEOUT_S = 300.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pair_rank(rank: int, device: str, backend: str, sizes: tuple, reps: int, queue: Any,
               done: Any) -> dict:
    """One side of the measured pair group (rank 0 sends, rank 1 receives)."""
    if device == "cuda":
        device = f"cuda:{rank % torch.cuda.device_count()}"
    endpoint = DeviceEndpoint(device, "127.0.0.1")
    if rank == 0:
        address, nonce = endpoint.open_pair("bench", 60.0), os.urandom(16).hex()
        queue.put((address, nonce))
    else:
        address, nonce = queue.get(timeout=120)
    endpoint.join_pair("bench", address, rank, nonce, backend, 60.0)
    out = {}
    for mib in sizes:
        nbytes = mib << 20
        if rank == 0:
            endpoint.export("x", torch.full((nbytes,), 7, dtype=torch.uint8, device=device))
            for _ in range(reps + 1):  # the first one warms up
                endpoint.send("bench", "x", 0, 120.0)
            endpoint.release("x")
            continue
        endpoint.receive("bench", nbytes, 0, 120.0)
        _sync(endpoint.device)
        start = time.perf_counter()
        for _ in range(reps):
            got = endpoint.receive("bench", nbytes, 0, 120.0)
        _sync(endpoint.device)
        seconds = time.perf_counter() - start
        assert got.device == endpoint.device and int(got[-1]) == 7
        out[mib] = seconds / reps
    endpoint.close()
    return out


def _ipc_rank(rank: int, device: str, backend: str, sizes: tuple, reps: int, queue: Any,
              done: Any) -> dict:
    """Rank 0 shares one payload a size; rank 1 maps, copies out and unmaps each."""
    dev = torch.device(device if device != "cuda" else "cuda:0")
    if rank == 0:
        endpoint = DeviceEndpoint(str(dev))
        handles = {}
        for mib in sizes:
            endpoint.export(f"x{mib}", torch.full((mib << 20,), 7, dtype=torch.uint8,
                                                  device=dev))
            handles[mib] = endpoint.handle(SharePayload(f"x{mib}", 0))
        queue.put(handles)
        done.wait(RESULT_TIMEOUT_S)  # the receiver maps them until then
        endpoint.close()
        return {}
    handles, mapper, out = queue.get(timeout=120), Mapper(), {}
    for mib in sizes:
        if not isinstance(handles[mib], IpcHandle):
            raise RuntimeError(f"the source could not share: {handles[mib].error}")
        into = torch.empty(mib << 20, dtype=torch.uint8, device=dev)
        for rep in range(reps + 1):  # the first one warms up
            if rep == 1:
                start = time.perf_counter()
            with mapper.mapped(handles[mib], dev) as data:
                into.copy_(data)
        out[mib] = (time.perf_counter() - start) / reps
        assert int(into[-1]) == 7 and mapper.num_open() == 0
    done.set()
    return out


def _rank_main(fn: Any, rank: int, device: str, backend: str, sizes: tuple, reps: int,
               queue: Any, done: Any, results: Any) -> None:
    try:
        results.put((rank, True, fn(rank, device, backend, sizes, reps, queue, done)))
    except BaseException as exc:  # reported, not hung on
        done.set()
        results.put((rank, False, f"{type(exc).__name__}: {exc}"))


def _run(fn: Any, device: str, backend: str, sizes: tuple, reps: int) -> dict:
    """Both ranks, each in a process of its own: the receiver's seconds a hand-off per
    size, or ``{"error": ...}``."""
    ctx = torch.multiprocessing.get_context("spawn")
    queue, results, done = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(fn, r, device, backend, sizes, reps, queue, done, results))
             for r in (0, 1)]
    for p in procs:
        p.start()
    got: dict = {}
    try:
        for _ in procs:
            rank, ok, value = results.get(timeout=RESULT_TIMEOUT_S)
            got[rank] = (ok, value)
    except Exception as exc:
        return {"error": f"no result from both ranks: {type(exc).__name__}: {exc}"}
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.terminate()
    failed = [f"rank {r}: {v}" for r, (ok, v) in sorted(got.items()) if not ok]
    return {"error": "; ".join(failed)} if failed else got[1][1]


def memcpy_mib_s(dev: torch.device, mib: int, reps: int) -> float:
    """A device copy of ``mib`` MiB between two preallocated tensors, in MiB/s."""
    src = torch.full((mib << 20,), 7, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(dev)
    start = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    _sync(dev)
    return reps * mib / (time.perf_counter() - start)


def _rated(seconds: dict, dev: torch.device, sizes: tuple, reps: int) -> dict:
    out = {}
    for mib in sizes:
        memcpy, rate = memcpy_mib_s(dev, mib, reps), mib / seconds[mib]
        out[f"{mib}MiB"] = {"transport_mib_s": round(rate, 1), "ms": round(seconds[mib] * 1e3, 3),
                            "memcpy_mib_s": round(memcpy, 1), "ratio": round(rate / memcpy, 4)}
    return out


def device_transport_check(dev: torch.device, reps: int = 5,
                           sizes: tuple = SIZES_MIB) -> dict:
    """Both paths between two processes against a device memcpy (see the module doc)."""
    on_cuda = dev.type == "cuda"
    backend = "nccl" if on_cuda and torch.cuda.device_count() >= 2 else "gloo"
    pair: dict = {"backend": backend, "path": (
        "nccl, GPU to GPU" if backend == "nccl" else
        "gloo, staged through host memory (one GPU)" if on_cuda else "gloo, CPU ranks")}
    seconds = _run(_pair_rank, dev.type, backend, sizes, reps)
    pair.update(seconds if "error" in seconds else _rated(seconds, dev, sizes, reps))
    out: dict = {"pair": pair}
    if not on_cuda:
        out["ipc"] = {"skipped": "CUDA IPC needs a CUDA device"}
    else:
        seconds = _run(_ipc_rank, dev.type, backend, sizes, reps)
        out["ipc"] = {"path": "cuda ipc, one GPU, map + one device copy + unmap", **(
            seconds if "error" in seconds else _rated(seconds, dev, sizes, reps))}
    errors = [f"{k}: {v['error']}" for k, v in out.items() if "error" in v]
    if errors:
        out["error"] = "; ".join(errors)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES_MIB)), help="MiB, comma-separated")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    sizes = tuple(int(s) for s in args.sizes.split(","))
    out = device_transport_check(torch.device(args.device), args.reps, sizes)
    print(json.dumps(out))
    return 1 if "error" in out else 0


if __name__ == "__main__":
    raise SystemExit(main())
