"""prepare(): every input limit, a property test against an independent statement of the
rules, the real tokenizer, and malformed protobuf bytes over a real gRPC channel."""

from __future__ import annotations

import json
import math
import string
import time
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.router.request_error import RequestError
from pdserve.router.validation import (
    MAX_PROMPT_BYTES,
    MAX_REQUEST_ID_CHARS,
    MAX_STOP_TOKEN_IDS,
    ModelLimits,
    PreparedRequest,
    prepare,
)
from pdserve.rpc import router_pb2
from pdserve.scheduler.sampling_params import Guide

LIMITS = ModelLimits(vocab_size=100, max_model_len=64, max_tokens_limit=63)
INT32 = st.integers(-(2**31), 2**31 - 1)
INT64 = st.integers(-(2**63), 2**63 - 1)
FAST = settings(max_examples=200, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class ByteTokenizer:
    """One token per UTF-8 byte (ids 3..98): enough to test the limits around tokenizing."""

    def __init__(self) -> None:
        self.calls = 0

    def encode(self, text: str) -> list[int]:
        self.calls += 1
        return [3 + b % 96 for b in text.encode("utf-8")]


def request(prompt="hello", **fields) -> router_pb2.GenerateRequest:
    req = router_pb2.GenerateRequest(**fields)
    if isinstance(prompt, str):
        req.text = prompt
    elif prompt is not None:
        req.token_ids.SetInParent()  # set the oneof even for an empty list
        req.token_ids.ids.extend(prompt)
    return req


def rejected(req, tokenizer=None, limits=LIMITS) -> str:
    with pytest.raises(RequestError) as err:
        prepare(req, tokenizer or ByteTokenizer(), limits)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    return err.value.message


def test_valid_request_is_prepared():
    out = prepare(request("hi", request_id="client-7 a/b", max_tokens=5, temperature=0.5,
                          top_p=0.75, top_k=3, seed=-4, stop_token_ids=[3, 4], ignore_eos=True),
                  ByteTokenizer(), LIMITS)
    assert out.request_id == "client-7 a/b"
    assert out.prompt_token_ids == [3 + ord("h") % 96, 3 + ord("i") % 96]
    s = out.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed) == (5, 0.5, 0.75, 3, -4)
    assert s.stop_token_ids == (3, 4) and s.ignore_eos


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, -0.5])
def test_temperature_must_be_finite_and_not_negative(value):
    assert "temperature" in rejected(request(temperature=value))


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, 0.0, -0.1, 1.5])
def test_top_p_must_be_finite_in_0_1(value):
    assert "top_p" in rejected(request(top_p=value))


def test_request_id_of_one_mib_is_rejected():
    message = rejected(request(request_id="a" * (1 << 20)))
    assert "request_id" in message and str(MAX_REQUEST_ID_CHARS) in message
    prepare(request(request_id="a" * MAX_REQUEST_ID_CHARS), ByteTokenizer(), LIMITS)


@pytest.mark.parametrize("request_id", ["a\nb", "\x00", "tab\there", "\x1b[31mred", "a\u2028"])
def test_request_id_must_be_printable(request_id):
    assert "request_id" in rejected(request(request_id=request_id))


def test_200000_stop_token_ids_are_rejected_fast():
    req = request(stop_token_ids=range(200_000))
    tokenizer = ByteTokenizer()
    started = time.perf_counter()
    message = rejected(req, tokenizer)
    elapsed = time.perf_counter() - started
    assert "stop_token_ids" in message and str(MAX_STOP_TOKEN_IDS) in message
    assert elapsed < 0.05, f"took {elapsed * 1e3:.1f} ms"
    assert tokenizer.calls == 0
    prepare(request(stop_token_ids=[5] * MAX_STOP_TOKEN_IDS), ByteTokenizer(), LIMITS)


def test_prompt_text_over_the_byte_limit_is_never_tokenized():
    tokenizer = ByteTokenizer()
    assert "text" in rejected(request("x" * (MAX_PROMPT_BYTES + 1)), tokenizer)
    # fewer characters than the limit, more bytes: "é" is two bytes of UTF-8
    assert "text" in rejected(request("é" * (MAX_PROMPT_BYTES // 2 + 1)), tokenizer)
    assert tokenizer.calls == 0
    # exactly at the limit it is tokenized, then refused for its token count instead
    message = rejected(request("x" * MAX_PROMPT_BYTES), tokenizer)
    assert tokenizer.calls == 1 and "prompt" in message and "tokens" in message


def test_token_id_count_is_checked_before_the_ids():
    # a million out-of-vocabulary ids: the count alone refuses them
    message = rejected(request([10**6] * 1_000_000))
    assert "prompt" in message and "token_ids" in message and "at most 63" in message
    assert "token_ids[0]" in rejected(request([LIMITS.vocab_size]))


# --- property: prepare() accepts exactly the requests the rules allow ------------------


def expected_violations(req: router_pb2.GenerateRequest, limits: ModelLimits) -> set[str]:
    """The rules of router/README.md's Limits section, written out independently of
    validation.py; each violated rule contributes the words its error may name."""
    bad: set[str] = set()
    rid = req.request_id
    if len(rid) > MAX_REQUEST_ID_CHARS or not rid.isprintable():
        bad.add("request_id")
    bad |= _prompt_violations(req, limits)
    bad |= _sampling_violations(req, limits)
    stop = list(req.stop_token_ids)
    if len(stop) > MAX_STOP_TOKEN_IDS or not all(0 <= t < limits.vocab_size for t in stop):
        bad.add("stop_token_ids")
    return bad


def _prompt_violations(req: router_pb2.GenerateRequest, limits: ModelLimits) -> set[str]:
    kind = req.WhichOneof("prompt")
    if kind == "text":
        size = len(req.text.encode("utf-8"))
        if size == 0 or size > MAX_PROMPT_BYTES or size >= limits.max_model_len:
            return {"prompt", "text"}  # ByteTokenizer: one token per byte
        return set()
    if kind == "token_ids":
        ids = list(req.token_ids.ids)
        if not ids or len(ids) >= limits.max_model_len:
            return {"prompt", "token_ids"}
        if not all(0 <= t < limits.vocab_size for t in ids):
            return {"token_ids"}
        return set()
    return {"prompt"}


def _sampling_violations(req: router_pb2.GenerateRequest, limits: ModelLimits) -> set[str]:
    bad: set[str] = set()
    max_tokens = req.max_tokens if req.HasField("max_tokens") else 16
    if not 1 <= max_tokens <= limits.max_tokens_limit:
        bad.add("max_tokens")
    if req.HasField("temperature") and not (math.isfinite(req.temperature)
                                            and req.temperature >= 0):
        bad.add("temperature")
    if req.HasField("top_p") and not (math.isfinite(req.top_p) and 0 < req.top_p <= 1):
        bad.add("top_p")
    if req.HasField("top_k") and req.top_k < -1:
        bad.add("top_k")
    return bad


def optional(strategy):
    return st.one_of(st.none(), strategy)


def mostly(valid, anything):
    """Three draws in four from ``valid``, so accepted requests are common too."""
    return st.one_of(valid, valid, valid, anything)


any_text = st.text(alphabet=st.characters(codec="utf-8"), max_size=80)
label_text = st.text(alphabet=string.ascii_letters + string.digits + " -_./:", max_size=30)
any_token_id = st.one_of(st.integers(-3, 110), INT32)
vocab_id = st.integers(0, LIMITS.vocab_size - 1)
generate_requests = st.builds(
    lambda request_id, prompt, fields, stop, ignore_eos: request(
        prompt, request_id=request_id, stop_token_ids=stop, ignore_eos=ignore_eos,
        **{k: v for k, v in fields.items() if v is not None}),
    request_id=mostly(label_text, st.one_of(
        st.text(alphabet=st.characters(codec="utf-8"), max_size=20),
        st.text(alphabet="ab\n", min_size=250, max_size=260))),
    prompt=mostly(st.one_of(label_text.filter(bool), st.lists(vocab_id, min_size=1, max_size=40)),
                  st.one_of(st.none(), any_text, st.lists(any_token_id, max_size=80))),
    fields=st.fixed_dictionaries({
        "max_tokens": mostly(optional(st.integers(1, LIMITS.max_tokens_limit)), INT32),
        "temperature": mostly(optional(st.floats(0, 4, width=32)), st.floats(width=32)),
        "top_p": mostly(optional(st.floats(0, 1, exclude_min=True, width=32)),
                        st.floats(width=32)),
        "top_k": mostly(optional(st.integers(-1, 50)), INT32),
        "seed": optional(INT64),
    }),
    stop=mostly(st.lists(vocab_id, max_size=MAX_STOP_TOKEN_IDS),
                st.lists(any_token_id, max_size=70)),
    ignore_eos=st.booleans(),
)


def assert_within_limits(out: PreparedRequest, req, limits: ModelLimits) -> None:
    assert out.request_id == req.request_id
    assert len(out.request_id) <= MAX_REQUEST_ID_CHARS and out.request_id.isprintable()
    assert 1 <= len(out.prompt_token_ids) < limits.max_model_len
    assert all(type(t) is int for t in out.prompt_token_ids)
    s = out.sampling
    assert 1 <= s.max_tokens <= limits.max_tokens_limit
    assert math.isfinite(s.temperature) and s.temperature >= 0
    assert math.isfinite(s.top_p) and 0 < s.top_p <= 1
    assert s.top_k >= -1
    assert len(s.stop_token_ids) <= MAX_STOP_TOKEN_IDS
    assert all(0 <= t < limits.vocab_size for t in s.stop_token_ids)
    if req.WhichOneof("prompt") == "token_ids":
        assert out.prompt_token_ids == list(req.token_ids.ids)


@FAST
@given(generate_requests)
def test_prepare_accepts_exactly_what_the_rules_allow(req):
    bad = expected_violations(req, LIMITS)
    try:
        out = prepare(req, ByteTokenizer(), LIMITS)
    except RequestError as exc:
        assert exc.code == grpc.StatusCode.INVALID_ARGUMENT
        assert bad, f"refused a valid request: {exc.message}"
        assert any(word in exc.message for word in bad), (exc.message, bad)
        return
    assert not bad, f"accepted a request that breaks {bad}"
    assert_within_limits(out, req, LIMITS)


# --- the built-in tiny model's real tokenizer -----------------------------------------


@pytest.fixture(scope="module")
def tiny_tokenizer_and_limits(tiny_model_dir):
    from pdserve.engine.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_model(tiny_model_dir)
    config = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    max_len = config["max_position_embeddings"]
    return tokenizer, ModelLimits(vocab_size=tokenizer.vocab_size, max_model_len=max_len,
                                  max_tokens_limit=max_len - 1)


@FAST
@given(text=st.one_of(st.text(alphabet=st.characters(codec="utf-8"), max_size=200),
                      # long prompts, some over the tiny model's 2048 positions
                      st.builds(lambda piece, times: piece * times,
                                st.text(alphabet=st.characters(codec="utf-8"), min_size=1,
                                        max_size=12),
                                st.integers(100, 1000))),
       temperature=st.floats(width=32))
def test_real_tokenizer_gives_a_valid_request_or_invalid_argument(tiny_tokenizer_and_limits,
                                                                  text, temperature):
    tokenizer, limits = tiny_tokenizer_and_limits
    req = request(text, temperature=temperature)
    try:
        out = prepare(req, tokenizer, limits)
    except RequestError as exc:
        assert exc.code == grpc.StatusCode.INVALID_ARGUMENT
        assert any(word in exc.message for word in ("prompt", "text", "temperature"))
        return
    assert_within_limits(out, req, limits)
    assert all(0 <= t < limits.vocab_size for t in out.prompt_token_ids)


def test_real_tokenizer_is_not_run_on_an_oversized_prompt(tiny_tokenizer_and_limits):
    tokenizer, limits = tiny_tokenizer_and_limits
    started = time.perf_counter()
    message = rejected(request("word " * (MAX_PROMPT_BYTES // 5 + 1)), tokenizer, limits)
    assert "text" in message and time.perf_counter() - started < 0.5


# --- malformed bytes over a real gRPC channel -------------------------------------------


def test_invalid_utf8_is_invalid_argument_end_to_end(shared_router):
    def field(number: int, payload: bytes) -> bytes:  # a length-delimited protobuf field
        return bytes([number << 3 | 2, len(payload)]) + payload

    bad_text = field(1, b"r-utf8") + field(2, b"caf\xc3")  # "café" cut inside the "é"
    bad_abort = field(1, b"\xff\xfe")
    with grpc.insecure_channel(shared_router.address) as channel:
        generate = channel.unary_stream(
            "/pdserve.rpc.Router/Generate", request_serializer=lambda b: b,
            response_deserializer=router_pb2.GenerateResponse.FromString)
        abort = channel.unary_unary("/pdserve.rpc.Router/Abort", request_serializer=lambda b: b,
                                    response_deserializer=router_pb2.AbortResponse.FromString)
        with pytest.raises(grpc.RpcError) as err:
            list(generate(bad_text, timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid pdserve.rpc.GenerateRequest" in err.value.details()
        assert "UTF-8" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            abort(bad_abort, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # the same bytes with the "é" complete are served as usual
        good = field(1, b"r-utf8") + field(2, "café".encode()) + bytes([4 << 3, 2])  # max_tokens 2
        msgs = list(generate(good, timeout=60))
        assert msgs[-1].finish_reason in ("length", "stop") and msgs[-1].request_id == "r-utf8"


# --- the logits controls and the structured output (sampling_fields.py) -----------------


class SpecialByteTokenizer(ByteTokenizer):
    """ByteTokenizer that takes ``add_special_tokens`` (bad words are encoded without)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return super().encode(text)


def prepared(req, tokenizer=None, limits=LIMITS):
    return prepare(req, tokenizer or SpecialByteTokenizer(), limits).sampling


def so(**kind) -> router_pb2.StructuredOutput:
    if "choice" in kind:
        return router_pb2.StructuredOutput(choice=router_pb2.ChoiceList(choices=kind["choice"]))
    return router_pb2.StructuredOutput(**kind)


def test_controls_reach_the_sampling_params():
    s = prepared(request("hi", max_tokens=8, presence_penalty=-0.5, frequency_penalty=1.5,
                         repetition_penalty=1.25, min_tokens=8, min_p=0.5,
                         logit_bias={9: 1.5, 3: -100.0}, bad_words=["ab"]))
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (-0.5, 1.5, 1.25)
    assert (s.min_tokens, s.min_p, s.prior_output_tokens) == (8, 0.5, 0)
    assert s.logit_bias == ((3, -100.0), (9, 1.5))
    assert s.bad_words_token_ids == ((4, 5),)
    assert s.guide is None and s.has_controls
    plain = prepared(request("hi"))
    assert not plain.has_controls and plain.repetition_penalty == 1.0


@pytest.mark.parametrize("structured, guide", [
    (so(json_schema='{"type": "object"}'), Guide("json", '{"type": "object"}')),
    (so(json_object=True), Guide("json_object")),
    (so(regex="[0-9]+"), Guide("regex", "[0-9]+")),
    (so(grammar='root ::= "a" | "b"'), Guide("grammar", 'root ::= "a" | "b"')),
    (so(choice=["yes", 'say "no"']), Guide("choice", json.dumps(["yes", 'say "no"']))),
])
def test_each_structured_output_becomes_its_guide(structured, guide):
    assert prepared(request("hi", structured_output=structured)).guide == guide


def test_a_loose_schema_keeps_keywords_the_grammar_cannot_enforce():
    spec = '{"type": "array", "uniqueItems": true}'
    assert prepared(request("hi", structured_output=so(json_schema=spec, loose=True))
                    ).guide == Guide("json", spec)


@pytest.mark.parametrize("fields, words", [
    ({"presence_penalty": 2.5}, "presence_penalty must be a number in [-2, 2]"),
    ({"presence_penalty": math.nan}, "presence_penalty"),
    ({"frequency_penalty": -math.inf}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be a finite number > 0"),
    ({"repetition_penalty": math.inf}, "repetition_penalty"),
    ({"min_p": -0.1}, "min_p must be a number in [0, 1]"),
    ({"min_p": math.nan}, "min_p"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens must be in [0, max_tokens = 4]"),
    ({"logit_bias": {LIMITS.vocab_size: 1.0}}, "logit_bias[100]"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias[-1]"),
    ({"logit_bias": {5: 100.5}}, "logit_bias[5] must be a bias in [-100, 100]"),
    ({"logit_bias": {5: math.nan}}, "logit_bias[5]"),
    ({"logit_bias": {i: 1.0 for i in range(1025)}}, "logit_bias must hold at most 1024"),
    ({"bad_words": [""]}, "bad_words[0]"),
    ({"bad_words": ["ok", "  "]}, "bad_words[1]"),
    ({"bad_words": ["w"] * 33}, "bad_words must hold at most 32"),
    ({"bad_words": ["x" * 257]}, "bad_words[0] must be at most 256 characters"),
    ({"bad_words": ["x" * 33]}, "bad_words[0] must be at most 32 tokens"),
    ({"structured_output": router_pb2.StructuredOutput()}, "structured_output must set one"),
    ({"structured_output": so(json_object=False)}, "structured_output.json_object"),
    ({"structured_output": so(json_schema="")}, "structured_output.json_schema"),
    ({"structured_output": so(json_schema='{"type": "foo"}')},
     'structured_output.json_schema: Unsupported type "foo"'),
    ({"structured_output": so(json_schema="{oops")},
     "structured_output.json_schema: the JSON schema is not valid JSON"),
    ({"structured_output": so(json_schema="[1]")},
     "structured_output.json_schema: the JSON schema must be an object"),
    ({"structured_output": so(json_schema=" " * 70000)},
     "structured_output.json_schema must be at most 65536 characters"),
    ({"structured_output": so(regex="a[b")}, "structured_output.regex: Regex parsing error"),
    # what the grammar engine cannot keep is refused with its reason, never approximated
    ({"structured_output": so(regex="(?=ab)a.")},
     "structured_output.regex: Regex parsing error at position 3: Lookahead is not supported"),
    ({"structured_output": so(regex=r"(a)\1")},
     "structured_output.regex: Regex parsing error at position 4: Backreference is not"),
    ({"structured_output": so(regex=r"a\bb")},
     "structured_output.regex: Regex parsing error at position 2: Word boundary is not"),
    ({"structured_output": so(grammar="root ::= ")}, "structured_output.grammar: EBNF parser"),
    ({"structured_output": so(choice=[])}, "structured_output.choice must hold 1..256"),
    ({"structured_output": so(choice=["a", ""])}, "structured_output.choice: "),
    ({"structured_output": so(choice=["a"] * 257)}, "structured_output.choice must hold"),
    ({"structured_output": so(json_object=True), "ignore_eos": True},
     "ignore_eos cannot be combined with structured_output"),
    ({"structured_output": so(json_schema='{"properties": {"x": {"not": {}}}}')},
     "structured_output.json_schema: not at $.properties.x is not enforced by the grammar"),
    ({"structured_output": so(json_schema='{"uniqueItems": true, "oneOf": [{}, {}]}')},
     "structured_output.json_schema: uniqueItems at $ is not enforced by the grammar engine, "
     "so the answer could break the schema (and 1 more)"),
])
def test_bad_controls_are_invalid_argument_naming_the_field(fields, words):
    message = rejected(request("hi", **fields), SpecialByteTokenizer())
    assert message.startswith(words), message


def test_the_structured_output_is_checked_before_the_prompt_is_tokenized():
    tokenizer = ByteTokenizer()
    rejected(request("hi", structured_output=so(regex="(")), tokenizer)
    assert tokenizer.calls == 0


def vllm_bad_words(words, tokenizer) -> tuple:
    """vLLM's SamplingParams.update_from_tokenizer, restated."""
    out = []
    for word in words:
        for prefix in ("", " "):
            ids = tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False)
            if not prefix or (ids[0] != out[-1][0] and len(ids) == len(out[-1])):
                out.append(tuple(ids))
    return tuple(dict.fromkeys(out))


def test_bad_words_are_tokenized_as_vllm_does(tiny_tokenizer_and_limits):
    tokenizer, limits = tiny_tokenizer_and_limits
    words = ["hello", " world", "the quick", "x", "  indented", "hello"]
    s = prepared(request("hi", bad_words=words), tokenizer, limits)
    assert s.bad_words_token_ids == vllm_bad_words(words, tokenizer)
    assert any(len(w) > 1 for w in s.bad_words_token_ids)
    assert len(s.bad_words_token_ids) > len(set(words))  # some words have both forms
    bos = tokenizer.bos_token_id
    assert bos is None or all(bos not in w for w in s.bad_words_token_ids)


def test_a_moved_request_tells_the_rank_where_its_answer_starts():
    from pdserve.router.requests import RequestState

    req = prepare(request([5, 6, 7], max_tokens=10, min_tokens=8, presence_penalty=1.0,
                          structured_output=so(regex="[a-z]+")), SpecialByteTokenizer(), LIMITS)
    state = RequestState(req, "r" * 24, "label")
    first = state.begin_attempt()
    assert first.sampling.prior_output_tokens == 0 and first.sampling.max_tokens == 10
    state.tokens.extend([11, 12, 13])
    moved = state.begin_attempt()
    assert moved.prompt_token_ids == [5, 6, 7, 11, 12, 13]
    s = moved.sampling
    assert (s.prior_output_tokens, s.max_tokens, s.min_tokens) == (3, 7, 8)
    assert (s.presence_penalty, s.guide) == (1.0, req.sampling.guide)
    assert req.sampling.prior_output_tokens == 0  # the request's own params are unchanged
