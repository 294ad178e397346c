"""One simulated engine rank: the project's real ``Scheduler`` and block pool, driven
the way ``engine/engine.py`` drives them (admit imports -> schedule -> run -> process
outputs), with the model run replaced by a cost model and sampling by a stand-in.

The stand-in token never is an end-of-sequence (sequences carry no EOS id and ignore
it), so every request produces exactly its ``max_tokens`` (its dataset output length),
as ``bench serve`` asks with ``ignore_eos``. The rank is also the router's view of it
(``router/routing.py`` reads ``outstanding_tokens``, ``inflight``, ``assigned``,
``uid``, ``free_blocks``, ``pending_imports``, ``cached_prefix_blocks``): the router
here sees a rank's free blocks and cache as they are now (the real router's view lags
by one step report).
"""

from __future__ import annotations

from collections import deque
from operator import attrgetter

from pdserve.router.routing import cached_prefix_blocks
from pdserve.scheduler.block_pool import AllocStatus
from pdserve.scheduler.config import EngineType, SchedulerConfig
from pdserve.scheduler.output import SchedulerOutput, StepKind, StepResult
from pdserve.scheduler.scheduler import Scheduler
from pdserve.scheduler.sequence import Sequence
from pdserve.scheduler.votes import Communicator
from pdserve.simulator.cost_model import CostModel

STAND_IN_TOKEN = 7  # below the random datasets' first prompt id; never an EOS here
_seqlen_k = attrgetter("seqlen_k")


class SimSequence(Sequence):
    """A Sequence that knows its request's index in the client log (client_log.py)."""

    __slots__ = ("client",)


class _CachedNames:
    """The block pool's names as a set-like view (``in``) for ``cached_prefix_blocks``."""

    __slots__ = ("blocks",)

    def __init__(self, blocks) -> None:
        self.blocks = blocks

    def __contains__(self, block_hash: bytes) -> bool:
        return bool(self.blocks.lookup([block_hash]))


class SimRank:
    def __init__(self, uid: int, rank: int, config: SchedulerConfig, engine_type: EngineType,
                 costs: CostModel, communicator: Communicator | None = None) -> None:
        self.uid = uid
        self.rank = rank
        self.engine_type = engine_type
        self.comm = communicator
        self.scheduler = Scheduler(config, engine_type, communicator)
        self.costs = costs
        self.inbox: list[SimSequence] = []  # prompts sent during a step: added before the next
        self.imports: deque[SimSequence] = deque()  # prefilled, waiting for blocks (FIFO)
        self.num_steps = 0
        self.num_empty_steps = 0
        # the router's view (router/routing.py)
        self.outstanding_tokens = 0
        self.inflight: set[str] = set()
        self.assigned = 0
        self.pending_imports = 0
        self.pending_blocks: dict[bytes, int] = {}
        self._names = _CachedNames(self.scheduler.blocks) if self.scheduler.caching else set()

    # -- the router's view ---------------------------------------------------------

    @property
    def free_blocks(self) -> int:
        return len(self.scheduler.blocks.free_queue)  # num_free_blocks, without two calls

    def cached_prefix_blocks(self, hashes: list[bytes]) -> int:
        return cached_prefix_blocks(self._names, self.pending_blocks, hashes)

    # -- work ----------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self.inbox or self.imports or self.scheduler.has_unfinished())

    def can_import(self, num_tokens: int) -> bool:
        """False if a prompt of ``num_tokens`` can never fit (the engine refuses it)."""
        return self.scheduler.can_admit_prefilled(num_tokens) != AllocStatus.NEVER

    def admit(self) -> None:
        """Between steps (an import is a prompt, processed, without its first token yet): prompts sent meanwhile join ``waiting``; prefilled sequences
        whose blocks are free now are imported, in order (``LLMEngine._admit_imports``)."""
        sched = self.scheduler
        if self.inbox:
            for seq in self.inbox:
                sched.add(seq)
            self.inbox.clear()
        imports = self.imports
        while imports:
            seq = imports[0]
            if sched.can_admit_prefilled(seq.processed) != AllocStatus.OK:
                return
            imports.popleft()
            sched.add_prefilled(seq)
            seq.token_ids.append(STAND_IN_TOKEN)  # the prefill rank's first token
            sched.register_prefilled(seq)

    def step_seconds(self, out: SchedulerOutput) -> float:
        """What the model run of ``out`` costs (0 for an empty step)."""
        rows = out.scheduled
        if not rows:
            return 0.0
        if out.kind is StepKind.DECODE:
            return self.costs.decode.seconds(len(rows), sum(map(_seqlen_k, rows)))
        return self.costs.prompt.seconds([(r.query_len, r.seqlen_k - r.query_len) for r in rows])

    def finish_step(self, out: SchedulerOutput) -> StepResult:
        """Process the step's outputs with stand-in tokens; handed-off sequences give
        their blocks back (the engine does once their KV is exported); the block pool's
        cache events are dropped."""
        self.num_steps += 1
        if not out.scheduled:
            self.num_empty_steps += 1
        sched = self.scheduler
        result = sched.process_outputs(out, [STAND_IN_TOKEN] * len(out.scheduled))
        for seq in result.handed_off:
            sched.release_handed_off(seq)
        if sched.caching:
            # The engine sends these in its step report; the router here reads the
            # pool's names directly (_CachedNames), and kept, they grow with the run.
            sched.blocks.drain_events()
        return result
