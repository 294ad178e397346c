"""Router and pool settings: typed, validated at start."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from pdserve.engine.config import EngineSettings, engine_dtype
from pdserve.rank.messages import (
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    DEFAULT_MAX_FAILED_STEPS,
    DEFAULT_POLL_TIMEOUT_S,
)
from pdserve.router.auth import is_loopback_host
from pdserve.scheduler.sampling_params import MAX_CHOICES

MODES = ("disaggregated", "normal")
ROUTINGS = ("cache_aware", "least_loaded")
# in_process (kv_transfer) serves ranks in one process only; "auto" is resolved at start
# (resolved_kv_transport): "device" when both pools hold GPUs, else "ray"
TRANSPORTS = ("auto", "ray", "grpc", "device")


@dataclass
class PoolConfig:
    """One pool of engine ranks: how many, what each asks Ray for."""

    name: str  # "prefill" | "decode" | "normal"
    replicas: int = 1
    num_cpus: float = 0.5
    num_gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)
    # The torch threads each rank's steps may run on; "auto": the cores its node gives
    # its process shared among the pool's ranks (at least 1), in every pool: each
    # decode step then runs on 1 or on all of them, whichever has been faster lately,
    # so that a decode rank takes a prefill rank's idle core and gives it back when
    # the prefill rank computes (engine/backends/cpu/thread_tuner.py); a prompt step
    # runs on all of them. Decided when the rank starts (rank.engine_rank.rank_threads).
    threads: int | str = "auto"
    # The ranks' engine settings (engine/config.py: EngineSettings, the scheduler's
    # policy included); the router sets model_dir and engine_type. A mapping given here
    # (a program's) is checked and typed at construction.
    engine: EngineSettings = field(default_factory=EngineSettings)

    def __post_init__(self) -> None:
        if isinstance(self.engine, Mapping):
            self.engine = EngineSettings.from_mapping(self.engine, f"{self.name}.engine")
        elif not isinstance(self.engine, EngineSettings):
            raise ValueError(f"{self.name}.engine must be a mapping of engine settings, got "
                             f"{type(self.engine).__name__}")

    def validate(self) -> None:
        if self.replicas < 0:
            raise ValueError(f"{self.name} replicas must be >= 0, got {self.replicas}")
        if self.num_cpus < 0:
            raise ValueError(f"{self.name} num_cpus must be >= 0, got {self.num_cpus}")
        if self.threads != "auto" and (isinstance(self.threads, bool)
                                       or not isinstance(self.threads, int) or self.threads < 1):
            raise ValueError(f"{self.name} threads must be an integer >= 1 or \"auto\", got "
                             f"{self.threads!r}")
        # Again at start: flags may have changed fields since construction.
        try:
            self.engine.check()
        except ValueError as exc:
            raise ValueError(f"{self.name}.engine.{exc}") from None

    def rank_engine_settings(self, model_dir: str) -> dict[str, Any]:
        """What a rank of this pool builds its EngineConfig from (plain data, through
        Ray): every setting, the model, and the device decided (a pool asking for GPUs
        runs its engines on "cuda" unless told otherwise)."""
        return dict(self.engine.settings(), model_dir=model_dir, device=self.device())

    def device(self) -> str:
        """Where this pool's engines run: its engine's device, or for auto the GPU when
        the pool asks Ray for one (Ray shows a rank only the GPUs it asks for: with none,
        CUDA_VISIBLE_DEVICES is empty and torch sees no GPU)."""
        if self.engine.device == "auto":
            return "cuda" if self.num_gpus else "cpu"
        return self.engine.device


@dataclass
class RouterConfig:
    model_dir: str
    mode: str = "disaggregated"
    host: str = "127.0.0.1"
    port: int = 50051
    # Prometheus text endpoint (router/metrics.py): None = port + 1 (a free port when
    # `port` is 0); 0 turns it off.
    metrics_port: int | None = None
    # How KV payloads reach the decode ranks (kv_transfer/): "ray" (shared memory on one
    # node, the object store across nodes), "device" (GPU to GPU over a torch.distributed
    # pair group, NCCL; gloo on CPU), "grpc" (bytes through the router); "auto": "device"
    # when both the prefill and the decode pool have num_gpus > 0, else "ray".
    kv_transport: str = "auto"
    # Disaggregated: a prompt that takes several prefill steps streams the KV of each
    # step's full blocks to its decode rank while the rest computes, so the hand-off
    # after its last chunk carries only that chunk (router/kv_stream.py).
    kv_streaming: bool = True
    # How a prompt's rank is chosen (router/pools.py, Pool.choose_prefill): cache_aware
    # scores each rank by the prompt tokens it would compute before this request's
    # first token (its queue plus the prompt minus its cached prefix); least_loaded
    # looks at the queue only.
    routing: str = "cache_aware"
    # cache_aware: how much a prompt's uncached tokens weigh against a rank's queue
    # (Pool.choose_prefill); 1 = time to the first token alone.
    prefix_overlap_weight: float = 2.0
    # OpenAI-compatible HTTP front (router/http_api.py): None = port + 2 (a free port when
    # `port` is 0); 0 turns it off. The model's id there: served_model_name, or the
    # model folder's name.
    http_port: int | None = None
    served_model_name: str | None = None
    # Access (router/auth.py, SECURITY.md): tenant tokens `<tenant> <token>` per line; an
    # admin token for ScalePool and cluster internals (without one: loopback peers only).
    auth_token_file: str | None = None
    admin_token_file: str | None = None
    # TLS on the router port (PEM files). A non-loopback host needs them, or `insecure`.
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    insecure: bool = False
    # Requests accepted but not finished; past it, RESOURCE_EXHAUSTED.
    max_queue_depth: int = 256
    # max_tokens above this is INVALID_ARGUMENT (None: the model length allows it).
    max_tokens_limit: int | None = None
    default_max_tokens: int = 16
    # n (completions of one prompt, sharing one prefill) above this is INVALID_ARGUMENT.
    # Each choice counts against max_queue_depth.
    max_choices: int = 16
    prefill: PoolConfig = field(default_factory=lambda: PoolConfig("prefill", resources={"prefill": 1}))
    decode: PoolConfig = field(default_factory=lambda: PoolConfig("decode", resources={"decode": 1}))
    normal: PoolConfig = field(default_factory=lambda: PoolConfig("normal"))
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S
    # How long a poll of a rank waits for a step report.
    poll_timeout_s: float = DEFAULT_POLL_TIMEOUT_S
    # Test doubles and alternative engines: callables shipped to the actors.
    engine_factory: Callable | None = None
    loop_factory: Callable | None = None
    communicator_factory: Callable | None = None
    # A request is tried on at most this many ranks (rank deaths, refusals) before it
    # ends with an error; while a pool re-forms, dispatch waits up to rank_wait_s.
    # Moves (a rank died, left, or a step failed) count as attempts too.
    max_attempts: int = 8
    rank_wait_s: float = 60.0
    # Bounds that keep the router from ever hanging on a wedged rank or transfer:
    # a KV hand-off that takes longer fails over to another decode rank; a rank that
    # answers no poll for rank_unresponsive_s is treated as dead.
    handoff_timeout_s: float = 60.0
    rank_unresponsive_s: float = 120.0
    # An attempt that produced no token for this long (its rank alive, its reports
    # lost, or stuck in a queue) moves to another rank.
    request_stall_timeout_s: float = 300.0
    # Every other call to a rank (admission, abort, stats) gives up after this long.
    rank_call_timeout_s: float = 30.0
    # A rank start (actor placed, model loaded) that takes longer fails: the resize
    # that asked for it rolls back (so a size the cluster cannot place fails in time).
    rank_start_timeout_s: float = 180.0
    # Joining a (re-formed) data-parallel group, and pausing for it.
    group_timeout_s: float = 60.0
    # Leaving ranks get this long to finish their requests; what is left then moves.
    drain_timeout_s: float = 120.0
    # Largest pool a ScalePool may ask for.
    max_replicas: int = 16
    # A rank whose engine loop failed more often than this in a row is replaced; one
    # whose steps fail max_failed_steps times in a row gives up by itself.
    max_group_heals: int = 2
    max_failed_steps: int = DEFAULT_MAX_FAILED_STEPS
    # Decode ranks tried for one hand-off before the request is re-prefilled.
    max_handoff_tries: int = 4
    # The SLO planner (planner/, docs/scaling.md "Autoscaling"): with autoscale on, the router
    # sizes the prefill pool for slo_ttft_ms and the decode pool for slo_itl_ms (both at
    # the slo_percentile of the last planner_window_s of samples), between the minima
    # and maxima, through the same resize as `pdserve scale`. Disaggregated mode only.
    autoscale: bool = False
    slo_ttft_ms: float = 1000.0
    slo_itl_ms: float = 100.0
    slo_percentile: float = 90.0
    min_prefill: int = 1
    max_prefill: int = 4
    min_decode: int = 1
    max_decode: int = 4
    # How often it looks; how long a pool is left alone after any change to it (and how
    # long the router must be idle before both pools go back to their minima).
    planner_interval_s: float = 5.0
    planner_cooldown_s: float = 60.0
    # A new rank's samples are ignored for this long (compile caches, cold KV, first
    # steps); fewer samples than planner_min_samples judge nothing.
    planner_warmup_s: float = 30.0
    planner_window_s: float = 60.0
    planner_min_samples: int = 5
    # After a scale-up whose new ranks could not start (Ray could not place them, or
    # they failed to load), the pool stays at what is placed this long before a retry.
    planner_backoff_s: float = 600.0

    def validate(self) -> None:
        # Section by section, in a fixed order: the first problem found is the one reported.
        self._validate_routing()
        self._validate_admission()
        self._validate_endpoints()
        self._validate_security()
        self._validate_bounds()
        for pool in self.pools():
            pool.validate()
        self._validate_kv_pairing()
        self._validate_planner()
        self._validate_planner_pools()

    def _validate_routing(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {self.routing!r}")
        if not 0 <= self.prefix_overlap_weight <= 100:
            raise ValueError("prefix_overlap_weight must be in [0, 100], got "
                             f"{self.prefix_overlap_weight}")
        if not isinstance(self.kv_streaming, bool):
            raise ValueError(f"kv_streaming must be true or false, got {self.kv_streaming!r}")
        if self.kv_transport not in TRANSPORTS:
            raise ValueError(f"kv_transport must be one of {TRANSPORTS}, got {self.kv_transport!r}")

    def _validate_kv_pairing(self) -> None:
        """A decode rank imports the prefill ranks' KV blocks as they are: the settings that
        decide the cache's layout must agree, or every hand-off would be refused."""
        if self.mode != "disaggregated":
            return
        a, b = self.prefill.engine, self.decode.engine
        names = ["block_size", "kv_precision"]
        if "auto" in (a.kv_precision, b.kv_precision):  # follows the activations
            names += ["quantization", "activation_precision"]
        for name in names:
            if getattr(a, name) != getattr(b, name):
                raise ValueError(
                    f"prefill.engine.{name} {getattr(a, name)!r} and decode.engine.{name} "
                    f"{getattr(b, name)!r} differ: a decode rank imports the prefill ranks' KV "
                    f"blocks as they are, so the settings that decide the KV cache's layout "
                    f"must agree")

    def check_kv_dtypes(self) -> None:
        """Once the pools' GPUs are decided (``pdserve serve`` shares the cluster's out
        after validate, gpu_share.py; the service checks again as it starts): the KV
        caches' dtype, as each pool's ranks will resolve it (auto: bf16 on a GPU, fp32 on
        the CPU), must be one, or every hand-off would be refused."""
        if self.mode != "disaggregated":
            return
        a, b = self.prefill.engine, self.decode.engine
        resolved = [engine_dtype(p.engine.dtype, p.device()) for p in (self.prefill, self.decode)]
        if resolved[0] != resolved[1]:
            raise ValueError(
                f"prefill ranks on {self.prefill.device()} (prefill.engine.dtype {a.dtype!r}: "
                f"{resolved[0]}) and decode ranks on {self.decode.device()} (decode.engine.dtype "
                f"{b.dtype!r}: {resolved[1]}) would keep KV caches of different dtypes, and a "
                f"decode rank imports the prefill ranks' KV blocks as they are: give both "
                f"pools one dtype, or both GPUs (num_gpus) or neither")

    def _validate_admission(self) -> None:
        if self.max_queue_depth < 1:
            raise ValueError(f"max_queue_depth must be >= 1, got {self.max_queue_depth}")
        if not 1 <= self.max_choices <= MAX_CHOICES:
            raise ValueError(f"max_choices must be in [1, {MAX_CHOICES}], got {self.max_choices}")

    def _validate_endpoints(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.http_port is not None and not 0 <= self.http_port < 65536:
            raise ValueError(f"http_port must be in [0, 65535], got {self.http_port}")
        if self.served_model_name is not None and not (
                0 < len(self.served_model_name) <= 256 and self.served_model_name.isprintable()):
            raise ValueError("served_model_name must be 1..256 printable characters")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")

    def _validate_security(self) -> None:
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("tls_cert_file and tls_key_file go together: give both or neither")
        if not (self.tls_cert_file or self.insecure or is_loopback_host(self.host)):
            raise ValueError(
                f"host {self.host!r} is not a loopback address: anyone on the network could "
                "read prompts, completions and tokens in plaintext. Serve TLS "
                "(--tls-cert-file/--tls-key-file), or pass --insecure (YAML: insecure: true) "
                "if the network itself is trusted")

    def _validate_bounds(self) -> None:
        """The timeouts and retry counts that keep the router from waiting forever."""
        for name in ("poll_timeout_s", "rank_wait_s", "handoff_timeout_s", "rank_unresponsive_s",
                     "rank_call_timeout_s", "rank_start_timeout_s", "group_timeout_s",
                     "drain_timeout_s", "collective_timeout_s", "request_stall_timeout_s"):
            value = getattr(self, name)
            if not _positive_finite(value):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        for name in ("max_attempts", "max_replicas", "max_failed_steps", "max_handoff_tries"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def _validate_planner(self) -> None:
        """The planner's objectives and timing."""
        if not isinstance(self.autoscale, bool):
            raise ValueError(f"autoscale must be true or false, got {self.autoscale!r}")
        for name in ("slo_ttft_ms", "slo_itl_ms", "planner_interval_s", "planner_cooldown_s",
                     "planner_window_s", "planner_backoff_s"):
            value = getattr(self, name)
            if not _positive_finite(value):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if not (isinstance(self.planner_warmup_s, int | float)
                and 0 <= self.planner_warmup_s < float("inf")):
            raise ValueError(f"planner_warmup_s must be >= 0 seconds, got {self.planner_warmup_s!r}")
        if not 0 < self.slo_percentile <= 100:
            raise ValueError(f"slo_percentile must be in (0, 100], got {self.slo_percentile!r}")
        if self.planner_min_samples < 1:
            raise ValueError(f"planner_min_samples must be >= 1, got {self.planner_min_samples}")

    def _validate_planner_pools(self) -> None:
        """The pool sizes the planner may choose between, and the mode it needs."""
        for pool in ("prefill", "decode"):
            low, high = getattr(self, f"min_{pool}"), getattr(self, f"max_{pool}")
            if not 1 <= low <= high:
                raise ValueError(f"min_{pool} must be >= 1 and <= max_{pool}, got "
                                 f"min_{pool} {low}, max_{pool} {high}")
            if high > self.max_replicas:
                raise ValueError(f"max_{pool} ({high}) must be <= max_replicas "
                                 f"({self.max_replicas}): no resize may ask for more")
        if self.autoscale and self.mode != "disaggregated":
            raise ValueError("autoscale sizes the prefill and decode pools of disaggregated "
                             f"mode; mode {self.mode!r} has one pool: scale it with "
                             "`pdserve scale normal N`, or serve --mode disaggregated")

    def resolved_kv_transport(self) -> str:
        """``kv_transport`` with "auto" decided: "device" when the prefill and the decode
        pool both ask for GPUs (disaggregated), else "ray"."""
        if self.kv_transport != "auto":
            return self.kv_transport
        if self.mode == "disaggregated" and self.prefill.num_gpus > 0 and self.decode.num_gpus > 0:
            return "device"
        return "ray"

    @property
    def model_name(self) -> str:
        """The model's id in the HTTP API (`model` fields, /v1/models)."""
        return self.served_model_name or Path(self.model_dir).name or "pdserve"

    def pools(self) -> list[PoolConfig]:
        return [self.prefill, self.decode] if self.mode == "disaggregated" else [self.normal]


_POOL_NAMES = ("prefill", "decode", "normal")
# Fields a YAML file may set (the factories are for programs, not files).
_FILE_FIELDS = {f.name for f in fields(RouterConfig)} - {
    "engine_factory", "loop_factory", "communicator_factory"}
_POOL_FIELDS = {f.name for f in fields(PoolConfig)} - {"name"}


def config_from_dict(data: dict[str, Any], **overrides: Any) -> RouterConfig:
    """A RouterConfig from plain data (a parsed YAML file); unknown keys are refused.

    Pools are mappings under `prefill`, `decode`, `normal` with PoolConfig fields;
    a top-level `engine` mapping applies to every pool (a pool's own wins).
    """
    data = dict(data or {})
    shared_engine = _engine_mapping(data.pop("engine", None), "engine")
    unknown = set(data) - _FILE_FIELDS
    if unknown:
        raise ValueError(f"unknown router config field(s): {', '.join(sorted(unknown))}")
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key in _POOL_NAMES:
            value = dict(value or {})
            bad = set(value) - _POOL_FIELDS
            if bad:
                raise ValueError(f"unknown {key} pool field(s): {', '.join(sorted(bad))}")
            default = getattr(RouterConfig(model_dir=""), key)
            engine = {**shared_engine, **_engine_mapping(value.pop("engine", None), f"{key}.engine")}
            kwargs[key] = PoolConfig(key, **{**_pool_kwargs(default), **value, "engine": engine})
        else:
            kwargs[key] = value
    for name in _POOL_NAMES:
        if name not in kwargs and shared_engine:
            default = getattr(RouterConfig(model_dir=""), name)
            kwargs[name] = PoolConfig(name, **{**_pool_kwargs(default), "engine": shared_engine})
    kwargs.update({k: v for k, v in overrides.items() if v is not None})
    kwargs.setdefault("model_dir", "")
    config = RouterConfig(**kwargs)
    config.validate()
    return config


def _positive_finite(value: Any) -> bool:
    return isinstance(value, int | float) and 0 < value < float("inf")


def _engine_mapping(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{where} must be a mapping of engine settings, got {value!r}")
    return dict(value)


def _pool_kwargs(pool: PoolConfig) -> dict[str, Any]:
    return {f: getattr(pool, f) for f in _POOL_FIELDS}


def load_config(path: str | Path, **overrides: Any) -> RouterConfig:
    import yaml  # lazy: only to read a config file (`import pdserve.cli` loads this module)

    text = Path(path).read_text()
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a router config must be a mapping of fields")
    return config_from_dict(data, **overrides)
