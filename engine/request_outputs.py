"""What one step reports for each request it touched (``RequestOutput``): the token it
drew (with its logprobs where asked) and, once, how it finished. A request whose step
failed finishes with ``error`` and none of that step's tokens; the forks of a prompt
that ended before it completed end with it. And an engine's counters for its router
(``engine_stats``)."""

from __future__ import annotations

from collections import Counter

from pdserve.engine.outputs import EngineStats, RequestOutput, TokenLogprobs
from pdserve.scheduler.output import SchedulerOutput, StepResult
from pdserve.scheduler.sequence import Sequence


def request_outputs(result: StepResult, step_logprobs: dict[str, list[TokenLogprobs]],
                    failed: dict[str, str], aborted_unstarted: list[str]
                    ) -> tuple[list[RequestOutput], list[str]]:
    """The step's outputs, and the ids of the requests that ended (to forget).

    ``failed``: attempt -> why its step failed, each reported (and popped) once;
    ``aborted_unstarted``: requests aborted before they had a sequence."""
    by_id: dict[str, RequestOutput] = {}
    ended: list[str] = []
    # A handed-off request's first token travels in its HandOff, not here.
    handed_off = {seq.attempt for seq in result.handed_off}
    # A drafted row may append several tokens in one step (speculative decoding): the
    # sequence is listed once per token, its new tokens the last that many of its history.
    appended = Counter(seq.attempt for seq in result.updated)
    seen: Counter = Counter()
    for seq in result.updated:
        if seq.attempt in handed_off or seq.attempt in failed:
            continue
        out = _output_for(by_id, seq)
        k = seen[seq.attempt]
        seen[seq.attempt] += 1
        out.new_token_ids.append(seq.token_ids[k - appended[seq.attempt]])
        if step_logprobs:  # empty unless a request asked for logprobs
            # Every token of a request that asked was drawn by a row that computed
            # its logprobs, so new_logprobs stays aligned with new_token_ids.
            lps = step_logprobs.get(seq.attempt)
            if lps is not None:
                if out.new_logprobs is None:
                    out.new_logprobs = []
                out.new_logprobs.append(lps[k])
    for seq in result.finished:
        out = _output_for(by_id, seq)
        cause = failed.pop(seq.attempt, None)
        if cause is None:
            out.finish_reason = seq.finish_reason
        else:
            out.finish_reason, out.error, out.step_failed = "error", cause, True
            out.new_token_ids.clear()
            out.new_logprobs = None
        ended.append(seq.attempt)
        for fork_id, _ in seq.forks:  # ended before its prompt completed: so do they
            ended.append(fork_id)
            by_id[fork_id] = RequestOutput(
                fork_id, [], finish_reason=out.finish_reason, error=out.error,
                step_failed=out.step_failed, num_prompt_tokens=seq.prompt_len,
                arrival_time=seq.arrival_time)
    for attempt in aborted_unstarted:
        by_id[attempt] = RequestOutput(attempt, [], finish_reason="abort")
        ended.append(attempt)
    return list(by_id.values()), ended


def _output_for(by_id: dict[str, RequestOutput], seq: Sequence) -> RequestOutput:
    out = by_id.get(seq.attempt)
    if out is None:
        out = by_id[seq.attempt] = RequestOutput(
            seq.attempt, [], num_prompt_tokens=seq.prompt_len,
            arrival_time=seq.arrival_time, first_token_time=seq.first_token_time,
            first_scheduled_time=seq.first_scheduled_time,
            num_cached_tokens=seq.num_cached_tokens)
    out.num_output_tokens = seq.output_len
    out.first_token_time = seq.first_token_time
    return out


def engine_stats(engine) -> EngineStats:
    """An engine's counters for the router (``LLMEngine.stats``)."""
    counts = engine.scheduler.counts()
    return EngineStats(
        engine_type=engine.config.engine_type, rank=engine.rank,
        num_waiting=(counts.num_waiting + engine.num_pending_imports
                     + engine.guided.num_parked),
        num_running=counts.num_running, num_prompted=counts.num_prompted,
        num_free_blocks=counts.num_free_blocks,
        num_total_blocks=engine.runner.num_kv_blocks - 1,
        outstanding_prompt_tokens=counts.outstanding_prompt_tokens,
        num_preemptions=counts.num_preemptions,
        num_empty_steps=engine.num_empty_steps, num_steps=engine.num_steps,
        num_failed_steps=engine.num_failed_steps,
        cache_queried_tokens=counts.cache_queried_tokens,
        cache_hit_tokens=counts.cache_hit_tokens, cache_evictions=counts.cache_evictions,
        num_cached_blocks=counts.num_cached_blocks, **_spec_counters(engine.speculator))


def _spec_counters(speculator) -> dict:
    if speculator is None:
        return {}
    m = speculator.metrics
    return dict(spec_drafts=m.num_drafts, spec_draft_tokens=m.num_draft_tokens,
                spec_accepted_tokens=m.num_accepted_tokens,
                spec_accepted_per_pos=list(m.accepted_per_pos))


def split_fork_draws(sched_out: SchedulerOutput, sampled: list, draw_logprobs: list | None,
                     step_logprobs: dict[str, list[TokenLogprobs]]
                     ) -> tuple[list, dict[str, list[int]]]:
    """The rows' tokens, and the forks' first tokens (drawn after them, in row order)
    by the request they fork from; each fork's logprobs go into ``step_logprobs`` under
    its own id."""
    rows = sched_out.scheduled
    if len(sampled) == len(rows):
        return sampled, {}
    fork_tokens: dict[str, list[int]] = {}
    extra = iter(range(len(rows), len(sampled)))
    for row in rows:
        if row.forks:  # only a row that samples draws for its forks
            slots = [next(extra) for _ in row.forks]
            fork_tokens[row.attempt] = [sampled[i] for i in slots]
            if draw_logprobs is not None:
                for (fork_id, _), i in zip(row.forks, slots, strict=True):
                    if draw_logprobs[i] is not None:
                        step_logprobs[fork_id] = [draw_logprobs[i]]
    return sampled[:len(rows)], fork_tokens
