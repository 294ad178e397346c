"""A step's rows (``RunnerRow``) and the model's inputs for them: flat tokens, their
positions and the attention metadata (where each row's keys live, where its new K/V
is written), built on the host and moved to the device.

A row's ``token_ids`` are its ``q`` query tokens at positions
``start_pos .. start_pos + q - 1`` (``start_pos = seqlen_k - q``, spec S36); its
``block_table`` must cover ``seqlen_k`` positions; ``state_slot`` addresses the
sliding-window ring (ignored by models without one).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import chain

import torch

from pdserve.engine.logits_controls import RowControls
from pdserve.kernels.attention import AttentionGroup, AttentionMetadata
from pdserve.kernels.decode_kv import DecodePlan
from pdserve.kernels.kv_cache import KVCache
from pdserve.kernels.slot_mapping import full_slots, ring_slots
from pdserve.scheduler.output import ScheduledRow
from pdserve.scheduler.sampling_params import SamplingParams

_GREEDY = SamplingParams(temperature=0.0)

StepInputs = tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]


@dataclass
class RunnerRow:
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    state_slot: int = -1
    sampling: SamplingParams = field(default_factory=lambda: _GREEDY)
    sample: bool = True
    output_index: int = 0
    # More tokens drawn from this row's logits, one per entry's settings: the first
    # tokens of the forks that share its prompt (n > 1). Only on a row that samples.
    extra_draws: tuple[SamplingParams, ...] = ()
    # What its logits controls read (penalties, bias, min_tokens, bad words, a
    # grammar's matcher); None: it has none and pays nothing for them.
    controls: RowControls | None = None


def runner_rows(scheduled: list[ScheduledRow],
                controls_for: Callable[..., RowControls | None]
                ) -> tuple[list[RunnerRow], list[tuple[int, int]] | None]:
    """The runner's rows of a step's scheduled rows, and where each scheduled row's
    runner rows are ((first, count) each; None when every row is one runner row).
    ``controls_for(row, length, draft)``: the controls of a row that draws the token at
    ``length`` after the history and ``draft``.

    A decode row with a draft (speculative decoding) becomes 1 + draft_len rows of one
    position each, sharing its block table: its last token, then each drafted token, at
    their positions, each sampling the token after it (engine/speculative/decoding.py)."""
    rows: list[RunnerRow] = []
    spans: list[tuple[int, int]] | None = None
    for n, row in enumerate(scheduled):
        if row.draft and row.query_len == 1 + len(row.draft):
            if spans is None:
                spans = [(i, 1) for i in range(n)]
            spans.append((len(rows), 1 + len(row.draft)))
            rows += _drafted_rows(row, controls_for)
            continue
        if spans is not None:
            spans.append((len(rows), 1))
        rows.append(RunnerRow(
            token_ids=list(row.token_ids),
            start_pos=row.start_pos,
            block_table=list(row.block_table),
            state_slot=row.state_slot,
            sampling=row.sampling,
            sample=row.sample,
            controls=controls_for(row, row.seqlen_k) if row.sample else None,
            # The position of the token drawn: seeded draws stay the same when a
            # request is recomputed elsewhere from its history.
            output_index=row.output_index,
            extra_draws=tuple(sp for _, sp in row.forks),
        ))
    return rows, spans


def _drafted_rows(row: ScheduledRow, controls_for) -> list[RunnerRow]:
    length, draft, table = row.output_index, list(row.draft), list(row.block_table)
    tokens = [row.token_ids[0], *draft]  # its last token, then each drafted one
    return [RunnerRow(token_ids=[token], start_pos=row.start_pos + j,
                      block_table=table, state_slot=row.state_slot,
                      sampling=row.sampling, sample=True,
                      controls=controls_for(row, length + j, draft[:j]),
                      output_index=length + j)
            for j, token in enumerate(tokens)]


def check_rows(rows: list[RunnerRow], block_size: int, cache: KVCache) -> None:
    bs = block_size
    for n, r in enumerate(rows):
        q = len(r.token_ids)
        if q < 1:
            raise ValueError(f"row {n}: token_ids is empty")
        if r.start_pos < 0:
            raise ValueError(f"row {n}: start_pos must be >= 0, got {r.start_pos}")
        if cache.full_layers and len(r.block_table) * bs < r.start_pos + q:
            raise ValueError(
                f"row {n}: block_table has {len(r.block_table)} blocks of {bs}, "
                f"too few for seqlen_k {r.start_pos + q}"
            )
        if r.extra_draws and not r.sample:
            raise ValueError(f"row {n}: extra_draws on a row that samples nothing")
        if cache.ring_layers and not 0 <= r.state_slot < cache.num_state_slots:
            raise ValueError(
                f"row {n}: state_slot {r.state_slot} out of range [0, {cache.num_state_slots})"
            )


def decode_inputs(rows: list[RunnerRow], plan: DecodePlan | None, dev: torch.device,
                  bs: int, cache: KVCache) -> StepInputs:
    """All rows decode (q = 1), and either every layer is full attention or the C
    step runs (it needs no ring metadata, only each row's state slot): the metadata
    is a few per-row lists, built in Python without the general path's tensor
    algebra."""
    b = len(rows)
    pos = [r.start_pos for r in rows]
    ar = torch.arange(b, device=dev)
    positions = torch.tensor(pos, device=dev)
    bt = slot_mapping = states = None
    if cache.full_layers:
        slot_mapping = torch.tensor(
            [r.block_table[p // bs] * bs + p % bs for r, p in zip(rows, pos, strict=True)],
            device=dev)
        if plan is None:  # the gather path and the C step read the block tables
            nb = math.ceil((max(pos) + 1) / bs)
            bt = torch.tensor([(r.block_table[:nb] + [0] * nb)[:nb] for r in rows],
                              device=dev)
    if cache.ring_layers:
        states = torch.tensor([r.state_slot for r in rows], device=dev)
    group = AttentionGroup(
        token_index=ar[:, None], q_valid=torch.ones(b, 1, dtype=torch.bool, device=dev),
        q_pos=positions[:, None], block_tables=bt, ring_rows=None, ring_pos=None,
        valid_tokens=ar, valid_flat=None, fresh=False, decode=True, covers_all=True,
        state_slots=states)
    meta = AttentionMetadata(groups=[group], slot_mapping=slot_mapping,
                             ring_dest=None, ring_src=None, num_tokens=b)
    tokens = torch.tensor([r.token_ids[0] for r in rows], device=dev)
    return tokens, positions, meta, ar


def general_inputs(rows: list[RunnerRow], plan: DecodePlan | None, dev: torch.device,
                   bs: int, cache: KVCache) -> StepInputs:
    """Any mix of prompt chunks and decode rows: per-token indices by tensor algebra
    on the host, moved to the device at the end."""
    b = len(rows)
    q_lens = torch.tensor([len(r.token_ids) for r in rows], dtype=torch.long)
    starts = torch.tensor([r.start_pos for r in rows], dtype=torch.long)
    tokens = torch.tensor(list(chain.from_iterable(r.token_ids for r in rows)),
                          dtype=torch.long)
    t = tokens.numel()
    cu = torch.zeros(b + 1, dtype=torch.long)
    cu[1:] = q_lens.cumsum(0)
    token_row = torch.repeat_interleave(torch.arange(b), q_lens)
    positions = starts[token_row] + torch.arange(t) - cu[token_row]
    seqlen_k = starts + q_lens

    bt = None
    slot_mapping = None
    if cache.full_layers:
        nb = max(math.ceil((r.start_pos + len(r.token_ids)) / bs) for r in rows)
        bt = torch.tensor([(r.block_table[:nb] + [0] * nb)[:nb] for r in rows],
                          dtype=torch.long)
        slot_mapping = full_slots(bt, token_row, positions, bs)
    ring_dest = ring_src = slots = None
    if cache.ring_layers:
        slots = torch.tensor([r.state_slot for r in rows], dtype=torch.long)
        dest = ring_slots(slots, seqlen_k, q_lens, token_row, positions, cache.ring_len)
        keep = dest >= 0
        ring_dest, ring_src = dest[keep], torch.arange(t)[keep]

    groups = _attention_groups(q_lens, starts, cu, seqlen_k, bt, slots, cache.ring_len,
                               plan, bs, dev)
    meta = AttentionMetadata(
        groups=groups,
        slot_mapping=slot_mapping.to(dev) if slot_mapping is not None else None,
        ring_dest=ring_dest.to(dev) if ring_dest is not None else None,
        ring_src=ring_src.to(dev) if ring_src is not None else None,
        num_tokens=t,
    )
    last_index = (cu[1:] - 1).to(dev)
    return tokens.to(dev), positions.to(dev), meta, last_index


def _attention_groups(q_lens: torch.Tensor, starts: torch.Tensor, cu: torch.Tensor,
                      seqlen_k: torch.Tensor, bt: torch.Tensor | None,
                      slots: torch.Tensor | None, R: int, plan: DecodePlan | None, bs: int,
                      dev: torch.device) -> list[AttentionGroup]:
    """One group for each kind of row the step holds: decode rows, fresh prompts
    (nothing cached to read) and continued chunks, in that order."""
    decode = q_lens == 1
    fresh = ~decode & (starts == 0)
    chunk = ~decode & ~fresh
    parts = [(m.nonzero().flatten(), f) for m, f in
             ((decode, False), (fresh, True), (chunk, False))]
    groups = []
    for ri, is_fresh in parts:
        if ri.numel() == 0:
            continue
        ql, st = q_lens[ri], starts[ri]
        ar = torch.arange(int(ql.max()))
        q_valid = ar[None, :] < ql[:, None]
        off = torch.where(q_valid, ar[None, :], 0)
        token_index = cu[ri][:, None] + off
        g_bt = ring_rows = ring_pos = None
        is_decode = bool(ql.max() == 1)
        if bt is not None and not is_fresh and not (is_decode and plan is not None):
            nb_g = math.ceil(int(seqlen_k[ri].max()) / bs)
            g_bt = bt[ri, :nb_g].to(dev)
        if slots is not None and not is_fresh:
            ar_r = torch.arange(R)
            ring_rows = (slots[ri][:, None] * R + ar_r[None, :]).to(dev)
            last = st[:, None] - 1
            ring_pos = (last - torch.remainder(last - ar_r[None, :], R)).to(dev)
        groups.append(AttentionGroup(
            token_index=token_index.to(dev), q_valid=q_valid.to(dev),
            q_pos=(st[:, None] + off).to(dev), block_tables=g_bt, ring_rows=ring_rows,
            ring_pos=ring_pos, valid_tokens=token_index[q_valid].to(dev),
            valid_flat=None if bool(q_valid.all()) else
            q_valid.flatten().nonzero().flatten().to(dev),
            fresh=is_fresh, decode=is_decode,
        ))
    if len(groups) == 1:
        groups[0].covers_all = True
    return groups
