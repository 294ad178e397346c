from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class Chat(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "chat", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos", "stop", "include_stop_str_in_output", "logprobs", "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "min_p", "bad_words", "structured_output")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    chat: Chat
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    stop: _containers.RepeatedScalarFieldContainer[str]
    include_stop_str_in_output: bool
    logprobs: int
    n: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    min_p: float
    bad_words: _containers.RepeatedScalarFieldContainer[str]
    structured_output: StructuredOutput
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[Chat, _Mapping]] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., stop: _Optional[_Iterable[str]] = ..., include_stop_str_in_output: _Optional[bool] = ..., logprobs: _Optional[int] = ..., n: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., min_p: _Optional[float] = ..., bad_words: _Optional[_Iterable[str]] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "grammar", "choice", "loose")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    LOOSE_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    grammar: str
    choice: ChoiceList
    loose: bool
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., grammar: _Optional[str] = ..., choice: _Optional[_Union[ChoiceList, _Mapping]] = ..., loose: _Optional[bool] = ...) -> None: ...

class ChoiceList(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("logprob", "top_token_ids", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "usage", "error", "timings", "logprobs", "index")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    usage: Usage
    error: str
    timings: Timings
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    index: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., error: _Optional[str] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., index: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("router_queue_ms", "prefill_queue_ms", "prefill_ms", "kv_export_ms", "ttft_ms", "kv_handoff_ms", "decode_queue_ms", "kv_bytes", "cached_prompt_tokens", "kv_handoff_span_ms", "moves")
    ROUTER_QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    KV_EXPORT_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    KV_HANDOFF_MS_FIELD_NUMBER: _ClassVar[int]
    DECODE_QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_HANDOFF_SPAN_MS_FIELD_NUMBER: _ClassVar[int]
    MOVES_FIELD_NUMBER: _ClassVar[int]
    router_queue_ms: float
    prefill_queue_ms: float
    prefill_ms: float
    kv_export_ms: float
    ttft_ms: float
    kv_handoff_ms: float
    decode_queue_ms: float
    kv_bytes: int
    cached_prompt_tokens: int
    kv_handoff_span_ms: float
    moves: int
    def __init__(self, router_queue_ms: _Optional[float] = ..., prefill_queue_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., kv_export_ms: _Optional[float] = ..., ttft_ms: _Optional[float] = ..., kv_handoff_ms: _Optional[float] = ..., decode_queue_ms: _Optional[float] = ..., kv_bytes: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., kv_handoff_span_ms: _Optional[float] = ..., moves: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class ClusterStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RankState(_message.Message):
    __slots__ = ("rank", "actor_id", "node_id", "state", "num_waiting", "num_running", "num_prompted", "num_free_blocks", "num_total_blocks", "kv_usage", "outstanding_prompt_tokens", "num_steps", "num_empty_steps", "num_preemptions", "num_inflight", "cache_queried_tokens", "cache_hit_tokens", "cache_evictions", "num_cached_blocks", "spec_drafts", "spec_draft_tokens", "spec_accepted_tokens", "spec_accepted_per_pos")
    RANK_FIELD_NUMBER: _ClassVar[int]
    ACTOR_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPTED_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_EMPTY_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    CACHE_QUERIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_PER_POS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    actor_id: str
    node_id: str
    state: str
    num_waiting: int
    num_running: int
    num_prompted: int
    num_free_blocks: int
    num_total_blocks: int
    kv_usage: float
    outstanding_prompt_tokens: int
    num_steps: int
    num_empty_steps: int
    num_preemptions: int
    num_inflight: int
    cache_queried_tokens: int
    cache_hit_tokens: int
    cache_evictions: int
    num_cached_blocks: int
    spec_drafts: int
    spec_draft_tokens: int
    spec_accepted_tokens: int
    spec_accepted_per_pos: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, rank: _Optional[int] = ..., actor_id: _Optional[str] = ..., node_id: _Optional[str] = ..., state: _Optional[str] = ..., num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., num_prompted: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., kv_usage: _Optional[float] = ..., outstanding_prompt_tokens: _Optional[int] = ..., num_steps: _Optional[int] = ..., num_empty_steps: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., num_inflight: _Optional[int] = ..., cache_queried_tokens: _Optional[int] = ..., cache_hit_tokens: _Optional[int] = ..., cache_evictions: _Optional[int] = ..., num_cached_blocks: _Optional[int] = ..., spec_drafts: _Optional[int] = ..., spec_draft_tokens: _Optional[int] = ..., spec_accepted_tokens: _Optional[int] = ..., spec_accepted_per_pos: _Optional[_Iterable[int]] = ...) -> None: ...

class PoolState(_message.Message):
    __slots__ = ("name", "target_replicas", "ranks", "group_generation")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TARGET_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    GROUP_GENERATION_FIELD_NUMBER: _ClassVar[int]
    name: str
    target_replicas: int
    ranks: _containers.RepeatedCompositeFieldContainer[RankState]
    group_generation: int
    def __init__(self, name: _Optional[str] = ..., target_replicas: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[RankState, _Mapping]]] = ..., group_generation: _Optional[int] = ...) -> None: ...

class ClusterState(_message.Message):
    __slots__ = ("mode", "model", "pools", "num_inflight", "max_queue_depth", "kv_transport", "planner")
    MODE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    NUM_INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    PLANNER_FIELD_NUMBER: _ClassVar[int]
    mode: str
    model: str
    pools: _containers.RepeatedCompositeFieldContainer[PoolState]
    num_inflight: int
    max_queue_depth: int
    kv_transport: str
    planner: PlannerState
    def __init__(self, mode: _Optional[str] = ..., model: _Optional[str] = ..., pools: _Optional[_Iterable[_Union[PoolState, _Mapping]]] = ..., num_inflight: _Optional[int] = ..., max_queue_depth: _Optional[int] = ..., kv_transport: _Optional[str] = ..., planner: _Optional[_Union[PlannerState, _Mapping]] = ...) -> None: ...

class PlannerDecision(_message.Message):
    __slots__ = ("at", "pool", "from_replicas", "to_replicas", "reason", "outcome", "error")
    AT_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    FROM_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    TO_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    at: float
    pool: str
    from_replicas: int
    to_replicas: int
    reason: str
    outcome: str
    error: str
    def __init__(self, at: _Optional[float] = ..., pool: _Optional[str] = ..., from_replicas: _Optional[int] = ..., to_replicas: _Optional[int] = ..., reason: _Optional[str] = ..., outcome: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class PlannerState(_message.Message):
    __slots__ = ("enabled", "slo_ttft_ms", "slo_itl_ms", "slo_percentile", "min_prefill", "max_prefill", "min_decode", "max_decode", "window_s", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p90_ms", "itl_p99_ms", "decisions", "notes", "num_looks", "num_failed_looks")
    class NotesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    SLO_TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    SLO_ITL_MS_FIELD_NUMBER: _ClassVar[int]
    SLO_PERCENTILE_FIELD_NUMBER: _ClassVar[int]
    MIN_PREFILL_FIELD_NUMBER: _ClassVar[int]
    MAX_PREFILL_FIELD_NUMBER: _ClassVar[int]
    MIN_DECODE_FIELD_NUMBER: _ClassVar[int]
    MAX_DECODE_FIELD_NUMBER: _ClassVar[int]
    WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_P50_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_P90_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_P99_MS_FIELD_NUMBER: _ClassVar[int]
    ITL_P50_MS_FIELD_NUMBER: _ClassVar[int]
    ITL_P90_MS_FIELD_NUMBER: _ClassVar[int]
    ITL_P99_MS_FIELD_NUMBER: _ClassVar[int]
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    NOTES_FIELD_NUMBER: _ClassVar[int]
    NUM_LOOKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FAILED_LOOKS_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    slo_ttft_ms: float
    slo_itl_ms: float
    slo_percentile: float
    min_prefill: int
    max_prefill: int
    min_decode: int
    max_decode: int
    window_s: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p90_ms: float
    itl_p99_ms: float
    decisions: _containers.RepeatedCompositeFieldContainer[PlannerDecision]
    notes: _containers.ScalarMap[str, str]
    num_looks: int
    num_failed_looks: int
    def __init__(self, enabled: _Optional[bool] = ..., slo_ttft_ms: _Optional[float] = ..., slo_itl_ms: _Optional[float] = ..., slo_percentile: _Optional[float] = ..., min_prefill: _Optional[int] = ..., max_prefill: _Optional[int] = ..., min_decode: _Optional[int] = ..., max_decode: _Optional[int] = ..., window_s: _Optional[float] = ..., ttft_p50_ms: _Optional[float] = ..., ttft_p90_ms: _Optional[float] = ..., ttft_p99_ms: _Optional[float] = ..., itl_p50_ms: _Optional[float] = ..., itl_p90_ms: _Optional[float] = ..., itl_p99_ms: _Optional[float] = ..., decisions: _Optional[_Iterable[_Union[PlannerDecision, _Mapping]]] = ..., notes: _Optional[_Mapping[str, str]] = ..., num_looks: _Optional[int] = ..., num_failed_looks: _Optional[int] = ...) -> None: ...

class ScalePoolRequest(_message.Message):
    __slots__ = ("pool", "replicas")
    POOL_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    pool: str
    replicas: int
    def __init__(self, pool: _Optional[str] = ..., replicas: _Optional[int] = ...) -> None: ...

class ScalePoolResponse(_message.Message):
    __slots__ = ("pool", "replicas", "previous_replicas")
    POOL_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    pool: str
    replicas: int
    previous_replicas: int
    def __init__(self, pool: _Optional[str] = ..., replicas: _Optional[int] = ..., previous_replicas: _Optional[int] = ...) -> None: ...

class TimelineRequest(_message.Message):
    __slots__ = ("since",)
    SINCE_FIELD_NUMBER: _ClassVar[int]
    since: float
    def __init__(self, since: _Optional[float] = ...) -> None: ...

class StepRecord(_message.Message):
    __slots__ = ("pool", "rank", "kind", "start", "end", "num_tokens", "num_rows", "num_handoffs", "handoff_start", "handoff_end")
    POOL_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    NUM_HANDOFFS_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_START_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_END_FIELD_NUMBER: _ClassVar[int]
    pool: str
    rank: int
    kind: str
    start: float
    end: float
    num_tokens: int
    num_rows: int
    num_handoffs: int
    handoff_start: float
    handoff_end: float
    def __init__(self, pool: _Optional[str] = ..., rank: _Optional[int] = ..., kind: _Optional[str] = ..., start: _Optional[float] = ..., end: _Optional[float] = ..., num_tokens: _Optional[int] = ..., num_rows: _Optional[int] = ..., num_handoffs: _Optional[int] = ..., handoff_start: _Optional[float] = ..., handoff_end: _Optional[float] = ...) -> None: ...

class Timeline(_message.Message):
    __slots__ = ("steps",)
    STEPS_FIELD_NUMBER: _ClassVar[int]
    steps: _containers.RepeatedCompositeFieldContainer[StepRecord]
    def __init__(self, steps: _Optional[_Iterable[_Union[StepRecord, _Mapping]]] = ...) -> None: ...
