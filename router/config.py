"""Router and pool settings: typed, validated at start."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MODES = ("disaggregated", "normal")
TRANSPORTS = ("ray", "grpc")


@dataclass
class PoolConfig:
    """One pool of engine ranks: how many, what each asks Ray for."""

    name: str  # "prefill" | "decode" | "normal"
    replicas: int = 1
    num_cpus: float = 0.5
    num_gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)
    # Engine settings (pdserve.engine.config.EngineConfig fields, minus engine_type).
    engine: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        if self.replicas < 0:
            raise ValueError(f"{self.name} replicas must be >= 0, got {self.replicas}")
        if self.num_cpus < 0:
            raise ValueError(f"{self.name} num_cpus must be >= 0, got {self.num_cpus}")


@dataclass
class RouterConfig:
    model_dir: str
    mode: str = "disaggregated"
    host: str = "127.0.0.1"
    port: int = 50051
    kv_transport: str = "ray"
    # Requests accepted but not finished; past it, RESOURCE_EXHAUSTED.
    max_queue_depth: int = 256
    # max_tokens above this is INVALID_ARGUMENT (None: the model length allows it).
    max_tokens_limit: int | None = None
    default_max_tokens: int = 16
    prefill: PoolConfig = field(default_factory=lambda: PoolConfig("prefill", resources={"prefill": 1}))
    decode: PoolConfig = field(default_factory=lambda: PoolConfig("decode", resources={"decode": 1}))
    normal: PoolConfig = field(default_factory=lambda: PoolConfig("normal"))
    collective_timeout_s: float = 10.0
    # How long a poll of a rank waits for a step report.
    poll_timeout_s: float = 0.5
    # Test doubles and alternative engines: callables shipped to the actors.
    engine_factory: Callable | None = None
    loop_factory: Callable | None = None
    communicator_factory: Callable | None = None
    torch_threads: int | None = 1
    # A request is tried on at most this many ranks (rank deaths, refusals) before it
    # ends with an error; while a pool re-forms, dispatch waits up to rank_wait_s.
    max_attempts: int = 3
    rank_wait_s: float = 60.0

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.kv_transport not in TRANSPORTS:
            raise ValueError(f"kv_transport must be one of {TRANSPORTS}, got {self.kv_transport!r}")
        if self.max_queue_depth < 1:
            raise ValueError(f"max_queue_depth must be >= 1, got {self.max_queue_depth}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for pool in self.pools():
            pool.validate()

    def pools(self) -> list[PoolConfig]:
        return [self.prefill, self.decode] if self.mode == "disaggregated" else [self.normal]
