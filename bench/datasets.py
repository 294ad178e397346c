"""Workloads for the serving benchmark, and the arrival process that paces them.

Datasets (seeded, so two deployments see exactly the same requests):

- ``random``: input and output lengths drawn uniformly from
  ``[len * (1 - range_ratio), len * (1 + range_ratio)]`` (vLLM's random dataset), the
  prompt made of random token ids (``ids``: sent as ids, exact lengths) or those ids
  decoded to text (``text``: the router tokenizes it; the length recorded is the
  re-encoded one).
- ``mixed``: long prompts among short chats. A ``long_ratio`` share of the requests
  (exactly ``round(n * long_ratio)``, at seeded random positions) has a long prompt and
  a short answer; the rest are short chats with longer answers, whose inter-token
  latency is what a long prefill disturbs in a normal (non-disaggregated) engine.

- ``prefix``: what prefix caching and cache-aware routing are for. ``shared``: one of a
  few long system prompts followed by a short question (the first request of each
  system prompt is ``first``: its cache is cold); ``cold``: a unique prompt of the same
  length, nothing to share; ``turn``: multi-turn conversations, each turn re-sending the
  whole history (the earlier turns' prompts, a synthetic reply to each, the new user
  message), sent only after the conversation's previous turn finished (``after``), its
  first turn ``first`` too.

Arrivals (vLLM's): gaps between sends are gamma-distributed with shape ``burstiness``
and mean ``1 / request_rate``; burstiness 1 is a Poisson process, < 1 burstier,
> 1 more regular. The first request goes at once; ``request_rate = inf`` sends all
of them at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# Ids below this are left out of random prompts: small vocabularies keep their
# special tokens (bos/eos/pad) at the bottom.
FIRST_PROMPT_ID = 8


@dataclass
class SampleRequest:
    prompt: str | list[int]
    prompt_len: int
    output_len: int
    kind: str = "random"
    after: int | None = None  # index of the request that must finish before this is sent


def length_range(length: int, range_ratio: float) -> tuple[int, int]:
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    if length < 1:
        raise ValueError(f"lengths must be >= 1, got {length}")
    low = max(1, int(length * (1.0 - range_ratio)))
    high = max(low, int(length * (1.0 + range_ratio)))
    return low, high


def _prompt(rng: np.random.Generator, n: int, vocab_size: int, tokenizer, fmt: str
            ) -> tuple[str | list[int], int]:
    if vocab_size <= FIRST_PROMPT_ID:
        raise ValueError(f"vocab_size must be > {FIRST_PROMPT_ID}, got {vocab_size}")
    ids = rng.integers(FIRST_PROMPT_ID, vocab_size, size=n).tolist()
    if fmt == "ids":
        return ids, n
    if fmt != "text":
        raise ValueError(f"prompt format must be 'ids' or 'text', got {fmt!r}")
    if tokenizer is None:
        raise ValueError("text prompts need a tokenizer (the model folder's tokenizer.json)")
    text = tokenizer.decode(ids)
    return text, len(tokenizer.encode(text))


def random_requests(num_prompts: int, input_len: int, output_len: int, *, vocab_size: int,
                    range_ratio: float = 0.0, seed: int = 0, prompt_format: str = "ids",
                    tokenizer=None, kind: str = "random") -> list[SampleRequest]:
    rng = np.random.default_rng(seed)
    in_lo, in_hi = length_range(input_len, range_ratio)
    out_lo, out_hi = length_range(output_len, range_ratio)
    in_lens = rng.integers(in_lo, in_hi + 1, size=num_prompts)
    out_lens = rng.integers(out_lo, out_hi + 1, size=num_prompts)
    out = []
    for n_in, n_out in zip(in_lens, out_lens, strict=False):
        prompt, plen = _prompt(rng, int(n_in), vocab_size, tokenizer, prompt_format)
        out.append(SampleRequest(prompt, plen, int(n_out), kind))
    return out


CHAT_TOPICS = (
    "the history of the printing press", "how volcanoes form", "a recipe for bread",
    "the rules of chess", "why leaves change colour", "how a bicycle stays upright",
    "the water cycle", "a trip to the mountains", "how vaccines work", "the life of bees",
    "learning a new language", "how computers store numbers", "the moon landing",
    "a day at the beach", "how to write a good email", "the planets of the solar system",
)
CHAT_ASKS = ("Tell me about {}.", "Write a short story about {}.", "Explain {} to a child.",
             "Give me five facts about {}.", "Write a poem about {}.")


def chat_requests(num_prompts: int, output_len: int, *, chat_template, tokenizer,
                  seed: int = 0, prompt_format: str = "text") -> list[SampleRequest]:
    """Chat turns (a question on a topic, numbered so that no two prompts are the same
    and a server's prompt cache does not answer them), rendered by the model's chat
    template: the prompt a chat client sends, as text or ids."""
    if chat_template is None or tokenizer is None:
        raise ValueError("the chat dataset needs the model's chat template and tokenizer")
    rng = np.random.default_rng(seed)
    out = []
    for i in range(num_prompts):
        ask = CHAT_ASKS[int(rng.integers(len(CHAT_ASKS)))]
        topic = CHAT_TOPICS[int(rng.integers(len(CHAT_TOPICS)))]
        question = f"Request {seed}-{i}. " + ask.format(topic)
        text = chat_template.render([{"role": "user", "content": question}])
        ids = list(chat_template.encode(tokenizer, text))
        out.append(SampleRequest(text if prompt_format == "text" else ids, len(ids),
                                 output_len, "chat"))
    return out


def mixed_requests(num_prompts: int, *, vocab_size: int, long_ratio: float = 0.1,
                   long_input_len: int = 1024, long_output_len: int = 8,
                   short_input_len: int = 64, short_output_len: int = 64,
                   range_ratio: float = 0.0, seed: int = 0, prompt_format: str = "ids",
                   tokenizer=None) -> list[SampleRequest]:
    if not 0.0 <= long_ratio <= 1.0:
        raise ValueError(f"long_ratio must be in [0, 1], got {long_ratio}")
    rng = np.random.default_rng(seed)
    n_long = int(round(num_prompts * long_ratio))
    is_long = np.zeros(num_prompts, dtype=bool)
    is_long[rng.permutation(num_prompts)[:n_long]] = True
    out = []
    for i in range(num_prompts):
        kind = "long" if is_long[i] else "short"
        n_in, n_out = ((long_input_len, long_output_len) if is_long[i]
                       else (short_input_len, short_output_len))
        lo, hi = length_range(n_in, range_ratio)
        olo, ohi = length_range(n_out, range_ratio)
        n_in = int(rng.integers(lo, hi + 1))
        n_out = int(rng.integers(olo, ohi + 1))
        prompt, plen = _prompt(rng, n_in, vocab_size, tokenizer, prompt_format)
        out.append(SampleRequest(prompt, plen, n_out, kind))
    return out


def _conversations(ids, num_conversations: int, num_turns: int, turn_len: int,
                   output_len: int) -> list[list[list[int]]]:
    """Each conversation's prompts: its whole history so far at every turn."""
    conversations = []
    for _ in range(num_conversations):
        history, prompts = [], []
        for _turn in range(num_turns):
            history = history + ids(turn_len)
            prompts.append(list(history))
            history = history + ids(output_len)  # the reply the next turn re-sends
        conversations.append(prompts)
    return conversations


def _turn_slots(items: list[tuple[str, object]], order) -> dict[int, list[int]]:
    """Per conversation, the positions in `order` its turns landed on."""
    slots: dict[int, list[int]] = {}
    for position, item in enumerate(order):
        kind, value = items[item]
        if kind == "turn":
            slots.setdefault(value[0], []).append(position)
    return slots


def _place_single_prompts(out: list, items: list[tuple[str, object]], order, systems: list,
                          output_len: int) -> None:
    """The shared and cold requests at their positions; a system prompt's first use
    is `first` (its cache is cold)."""
    seen_systems: set[int] = set()
    for position, item in enumerate(order):
        kind, value = items[item]
        if kind == "turn":
            continue
        first = kind == "shared" and id(systems[item % len(systems)]) not in seen_systems
        if kind == "shared":
            seen_systems.add(id(systems[item % len(systems)]))
        out[position] = SampleRequest(value, len(value), output_len,
                                      "first" if first else kind)


def prefix_requests(num_prompts: int, *, vocab_size: int, system_len: int = 1024,
                    question_len: int = 32, num_system_prompts: int = 2, turns: int = 4,
                    turn_len: int = 64, output_len: int = 16, seed: int = 0
                    ) -> list[SampleRequest]:
    """About a third each of shared-system-prompt, cold and multi-turn requests (see
    the module doc), in a seeded random order that keeps each conversation's turns in
    order; token-id prompts (exact lengths)."""
    rng = np.random.default_rng(seed)

    def ids(n: int) -> list[int]:
        return rng.integers(FIRST_PROMPT_ID, vocab_size, size=n).tolist()

    num_turns = max(turns, 1)
    num_conversations = max(1, num_prompts // 3 // num_turns)
    num_shared = max(1, (num_prompts - num_conversations * num_turns) // 2)
    num_cold = max(0, num_prompts - num_conversations * num_turns - num_shared)
    systems = [ids(system_len) for _ in range(max(1, num_system_prompts))]
    items: list[tuple[str, object]] = []
    for i in range(num_shared):
        items.append(("shared", systems[i % len(systems)] + ids(question_len)))
    items += [("cold", ids(system_len + question_len)) for _ in range(num_cold)]
    conversations = _conversations(ids, num_conversations, num_turns, turn_len, output_len)
    items += [("turn", (c, t)) for c in range(num_conversations) for t in range(num_turns)]
    order = rng.permutation(len(items))
    # a conversation's turns keep their order: the k-th of its slots gets its turn k
    slots = _turn_slots(items, order)
    out: list[SampleRequest | None] = [None] * len(items)
    _place_single_prompts(out, items, order, systems, output_len)
    for c, positions in slots.items():
        for t, position in enumerate(sorted(positions)):
            prompt = conversations[c][t]
            out[position] = SampleRequest(prompt, len(prompt), output_len,
                                          "first" if t == 0 else "turn",
                                          after=sorted(positions)[t - 1] if t else None)
    return [r for r in out if r is not None]


def arrival_offsets(num_requests: int, request_rate: float, burstiness: float = 1.0,
                    seed: int = 0) -> list[float]:
    """Send times (seconds after the start) of `num_requests` requests."""
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 (or inf), got {request_rate}")
    if num_requests <= 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    theta = 1.0 / (request_rate * burstiness)
    gaps = rng.gamma(shape=burstiness, scale=theta, size=num_requests - 1)
    return [0.0, *np.cumsum(gaps).tolist()]
