"""A router to benchmark: `pdserve serve` in a subprocess (its own embedded Ray, on a
free port), or a router on an event loop of its own thread in this process's Ray. The
benchmarks that bring deployments up (compare-modes, compare-builds, kv-transfer's
hand-off share, prefix caching, the simulator's validation, the GPU service check) share
these two."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

from pdserve.router.config import PoolConfig, RouterConfig

LISTENING = re.compile(r"pdserve router listening on (\S+)")


def _serve_command(spec: dict, *, model: str | None, num_kv_blocks: int | None,
                   max_num_seqs: int | None, kv_transport: str, python: str | None,
                   extra_args: tuple[str, ...]) -> list[str]:
    """The `pdserve serve` command line of one deployment, on a free port."""
    cmd = [python or sys.executable, "-m", "pdserve.cli", "serve", "--port", "0", "--no-self-check",
           "--mode", spec["mode"], "--kv-transport", kv_transport]
    for pool in ("prefill", "decode", "normal"):
        if pool in spec:
            cmd += [f"--{pool}", str(spec[pool])]
    if model:
        cmd += ["--model", model]
    if num_kv_blocks:
        cmd += ["--num-kv-blocks", str(num_kv_blocks)]
    if max_num_seqs:
        cmd += ["--max-num-seqs", str(max_num_seqs)]
    return cmd + list(extra_args)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after a minute."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


class SubprocessRouter(contextlib.AbstractContextManager):
    """`pdserve serve` for one deployment on a free port. ``start`` spawns it (several
    then come up at once), ``address`` waits until it listens; as a context manager it
    starts, gives its address and stops it on leaving (whether or not it came up)."""

    def __init__(self, cmd: list[str], start_timeout: float):
        self.cmd, self.start_timeout = cmd, start_timeout
        self.proc: subprocess.Popen | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        self.found: list[str] = []
        self.ready = threading.Event()
        self.ray_tmp = ""
        self.reader: threading.Thread | None = None

    def start(self) -> SubprocessRouter:
        if self.proc is not None:
            return self
        self.ray_tmp = tempfile.mkdtemp(prefix="pdcmp", dir="/tmp")
        env = dict(os.environ, PDSERVE_RAY_TMP=self.ray_tmp, PYTHONUNBUFFERED="1",
                   OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env)
        self.reader = threading.Thread(target=self._drain, daemon=True)
        self.reader.start()
        return self

    def _drain(self) -> None:  # keep reading, or the server blocks on a full pipe
        for line in self.proc.stdout:
            self.tail.append(line.rstrip())
            m = LISTENING.search(line)
            if m and not self.found:
                self.found.append(m.group(1))
                self.ready.set()
        self.ready.set()

    def address(self) -> str:
        """The router's address once it listens (RuntimeError, with its output's tail,
        when it exits or stays silent for start_timeout)."""
        self.start()
        self.ready.wait(self.start_timeout)
        if not self.found:
            raise RuntimeError(f"`{' '.join(self.cmd[2:])}` did not start:\n"
                               + "\n".join(self.tail))
        return self.found[0]

    def __enter__(self) -> str:
        try:
            return self.address()
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            _stop(self.proc)
            self.reader.join(5)
            shutil.rmtree(self.ray_tmp, ignore_errors=True)  # that Ray's session files and logs
            self.proc = None


def subprocess_router(spec: dict, *, model: str | None = None, num_kv_blocks: int | None = None,
                      max_num_seqs: int | None = None, kv_transport: str = "ray",
                      start_timeout: float = 300.0, python: str | None = None,
                      extra_args: tuple[str, ...] = ()) -> SubprocessRouter:
    """`pdserve serve` for one deployment (``with subprocess_router(...) as address``).
    `python`: the interpreter (and so the pdserve build) that serves; default this one;
    `extra_args`: more `pdserve serve` flags."""
    cmd = _serve_command(spec, model=model, num_kv_blocks=num_kv_blocks,
                         max_num_seqs=max_num_seqs, kv_transport=kv_transport, python=python,
                         extra_args=extra_args)
    return SubprocessRouter(cmd, start_timeout)


@contextlib.contextmanager
def inprocess_router(spec: dict, *, model: str, engine: dict | None = None,
                     kv_transport: str = "ray", start_timeout: float = 300.0):
    """A router on an event loop of its own thread, in this process's Ray (started if
    needed); yields its address."""
    # lazy: ray and router.server (which imports ray), only for an in-process router
    import ray

    from pdserve.router.server import start_router

    if not ray.is_initialized():
        ray.init(address="local", include_dashboard=False, log_to_driver=False,
                 num_cpus=8, resources={"prefill": 8, "decode": 8},
                 _temp_dir=os.environ.get("PDSERVE_RAY_TMP", "/tmp/pdserve-ray"))
    engine = dict(engine or {})
    config = RouterConfig(
        model_dir=model, mode=spec["mode"], port=0, kv_transport=kv_transport,
        prefill=PoolConfig("prefill", spec.get("prefill", 1), 0.5, resources={"prefill": 1},
                           engine=engine),
        decode=PoolConfig("decode", spec.get("decode", 1), 0.5, resources={"decode": 1},
                          engine=engine),
        normal=PoolConfig("normal", spec.get("normal", 1), 0.5, engine=engine))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = None
    try:
        server = asyncio.run_coroutine_threadsafe(start_router(config), loop).result(start_timeout)
        yield f"127.0.0.1:{server.port}"
    finally:
        if server is not None:
            asyncio.run_coroutine_threadsafe(server.stop(grace=0.5), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
