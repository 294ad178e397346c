"""The offline API: `LLM(model_dir).generate(prompts, SamplingParams(...))`.

`mode="normal"` runs one NORMAL engine. `mode="disaggregated"` runs a PROMPT and a
COMPLETION engine in this process and moves every request between them through the
real KV payload (serialised to bytes and back), exactly as the service does between
ranks.

The offline API recomputes preempted requests (the spec's table) and therefore turns on
the `partial_prompts_first` policy: without it, a recomputed request at the head of
`waiting` can wait forever for blocks held by a half-prefilled prompt behind it.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.model.catalog import resolve_model
from pdserve.engine.outputs import RequestOutput, TokenLogprobs
from pdserve.scheduler.sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    attempt: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    # One TokenLogprobs per token_ids entry when SamplingParams.logprobs asked, else None.
    logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache


class LLM:
    """``LLM(model_dir, mode, **settings)``: ``settings`` are any ``EngineSettings``
    fields (engine/config.py; the scheduler's policy, scheduler/config.py, included),
    with their defaults, except two the offline API sets differently (module docstring):
    ``stop_preempted_request=False`` and ``partial_prompts_first=True``."""

    def __init__(self, model_dir: str, mode: str = "normal", *,
                 stop_preempted_request: bool = False, partial_prompts_first: bool = True,
                 **settings: Any) -> None:
        if mode not in ("normal", "disaggregated"):
            raise ValueError(f"mode must be 'normal' or 'disaggregated', got {mode!r}")
        fixed = sorted({"model_dir", "engine_type"} & set(settings))
        if fixed:
            raise TypeError(f"LLM() takes no {', '.join(fixed)} setting: mode chooses the engines")
        self.mode = mode
        # a folder, a GGUF file, or a built-in name (smollm2-135m-instruct, tiny)
        model_dir = resolve_model(model_dir).path
        settings["partial_prompts_first"] = partial_prompts_first
        # it recomputes preempted requests: guided ones too, their matchers kept
        settings.setdefault("recompute_structured_output", True)

        def config(engine_type: str, stop_preempted: bool) -> EngineConfig:
            return EngineConfig(model_dir=model_dir, engine_type=engine_type,
                                stop_preempted_request=stop_preempted, **settings)

        if mode == "normal":
            self.engines = [LLMEngine(config("normal", stop_preempted_request))]
        else:
            prompt = LLMEngine(config("prompt", stop_preempted_request))
            # A COMPLETION engine cannot recompute (no prefill path): it must terminate.
            completion = LLMEngine(config("completion", True))
            self.engines = [prompt, completion]
        self.tokenizer = self.engines[0].tokenizer
        self._next_id = 0

    def generate(self, prompts: str | Seq[str] | None = None,
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 prompt_token_ids: Seq[Seq[int]] | None = None,
                 use_tqdm: bool = True) -> list[CompletionOutput]:
        """Generate for every prompt; outputs come back in input order."""
        token_lists = self._token_lists(prompts, prompt_token_ids)
        params = self._params(sampling_params, len(token_lists))
        results: dict[str, CompletionOutput] = {}
        first = self.engines[0]
        for ids, sp in zip(token_lists, params, strict=True):
            attempt = f"llm-{self._next_id}"
            self._next_id += 1
            first.add_request(attempt, ids, sp)
            results[attempt] = CompletionOutput(
                attempt, list(ids), logprobs=[] if sp.logprobs is not None else None)
        with tqdm(total=len(results), desc="generate", unit="req",
                  disable=not use_tqdm or len(results) < 8) as bar:
            pending = len(results)
            while pending:
                for out in self._step():
                    done = results[out.attempt]
                    done.token_ids.extend(out.new_token_ids)
                    done.num_cached_tokens = max(done.num_cached_tokens, out.num_cached_tokens)
                    if out.new_logprobs:
                        done.logprobs.extend(out.new_logprobs)
                    if out.finished:
                        done.finish_reason = out.finish_reason
                        done.text = self.tokenizer.decode(done.token_ids)
                        pending -= 1
                        bar.update(1)
        return list(results.values())

    def _step(self) -> list[RequestOutput]:
        if self.mode == "normal":
            return self.engines[0].step().outputs
        prompt, completion = self.engines
        outputs: list[RequestOutput] = []
        if prompt.has_work():
            step = prompt.step()
            outputs += step.outputs
            for handoff in step.handoffs:
                for choice in [handoff, *handoff.forks]:  # n > 1: forks share the payload
                    lp = choice.first_token_logprobs
                    outputs.append(RequestOutput(choice.attempt, [choice.first_token_id],
                                                 new_logprobs=None if lp is None else [lp],
                                                 num_cached_tokens=handoff.num_cached_tokens))
                completion.import_prefilled(handoff.payload)
        if completion.has_work():
            outputs += completion.step().outputs
        return outputs

    def _token_lists(self, prompts, prompt_token_ids) -> list[list[int]]:
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of prompts or prompt_token_ids")
        if prompt_token_ids is not None:
            return [list(ids) for ids in prompt_token_ids]
        if isinstance(prompts, str):
            prompts = [prompts]
        return [self.tokenizer.encode(p) for p in prompts]

    @staticmethod
    def _params(sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = list(sampling_params)
        if len(params) != n:
            raise ValueError(f"sampling_params has {len(params)} entries for {n} prompts")
        return params

    def assert_drained(self) -> None:
        for engine in self.engines:
            engine.assert_drained()
