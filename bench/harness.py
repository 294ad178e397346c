"""A router (pools + gRPC server) on an event loop of its own thread, in this process.

Tests and the in-process benchmarks (chaos, soak) drive it: they reach the service's
pools and ranks directly to kill, resize and inspect, and talk to it over real gRPC.
Ray must be initialised.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from dataclasses import asdict

from pdserve.engine.model.catalog import resolve_model
from pdserve.router.embedded_ray import RAY_LOCAL_ONLY
from pdserve.router.embedded_ray import start_embedded_ray as start_ray


class RouterHarness:
    """A router (pools + gRPC server) running on an event loop of its own thread."""

    def __init__(self, config) -> None:
        # lazy: router.server imports ray, which must wait for start_embedded_ray
        from pdserve.router.server import start_router

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = self.call(start_router(config), timeout=180)
        self.service = self.server.service
        self.address = f"127.0.0.1:{self.server.port}"

    def call(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stats(self) -> dict[str, list[dict]]:
        """Fresh engine stats of every live rank, by pool."""
        self.call(self.service.refresh_stats())
        return {name: [dict(asdict(r.stats), state=r.state) for r in pool.ranks]
                for name, pool in self.service.pools.items()}

    def wait_drained(self, timeout: float = 30.0) -> dict[str, list[dict]]:
        """Wait until no request is in flight, every rank's blocks are all free and its
        engine holds nothing (an abort that just landed is reported by its next step)."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            ranks = [r for rs in stats.values() for r in rs if r["state"] != "dead"]
            idle = len(self.service.tracker) == 0 and all(
                r["num_free_blocks"] == r["num_total_blocks"] and r["num_waiting"] == 0
                and r["num_prompted"] == 0 for r in ranks)
            if (idle and not self.drained_errors()) or time.monotonic() > deadline:
                return stats
            time.sleep(0.1)

    def drained_errors(self) -> list[str]:
        """The engines' own block-leak invariant on every live rank (empty: no leak)."""
        async def check():
            ranks = [r for p in self.service.pools.values() for r in p.ranks
                     if r.state != "dead"]
            return await asyncio.gather(*(r.actor.check_drained.remote() for r in ranks))

        return [e for e in self.call(check()) if e]

    def close(self) -> None:
        if not self.thread.is_alive():
            return
        try:
            self.call(self.server.stop(grace=0.5), timeout=60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)

    def assert_nothing_left(self, timeout: float = 30.0) -> None:
        """No request (nor KV stream) in the router; every live rank's blocks, slots,
        payloads and partial imports free."""
        stats = self.wait_drained(timeout)
        for ranks in stats.values():
            for r in ranks:
                if r["state"] != "dead":
                    assert r["num_free_blocks"] == r["num_total_blocks"], r
        assert len(self.service.tracker) == 0
        assert self.service.num_kv_streams == 0
        assert self.drained_errors() == []


def start_embedded_ray(model: str | None, resources: dict[str, float] | None = None) -> str:
    """Start a local Ray for an in-process benchmark (loopback: Ray's local-only mode, as
    `pdserve serve`'s; no dashboard; pool resources for ranks, 8 of each unless
    `resources` says otherwise) and return the model folder (the built-in one by
    default). Call it before anything imports ray."""
    if "ray" not in sys.modules:  # read at import: later, Ray picks the machine's address
        os.environ.update(RAY_LOCAL_ONLY)
    model = resolve_model(model).path
    start_ray(num_cpus=8, resources=resources or {"prefill": 8, "decode": 8},
              temp_dir=os.environ.get("PDSERVE_RAY_TMP", "/tmp/pdserve-ray"))
    return model
