"""The scheduler: which requests run, what each computes this step, and which give their KV blocks back.

As in nano-vllm, sequences are `waiting` or `running`; the running hold blocks of the paged KV pool
(block_manager.py). A step runs one decode token for every running sequence that has finished its prompt, plus
prefill chunks of the others within a token budget, so a long prompt is prefilled over several steps while the
other streams keep flowing. `max_num_seqs` bounds how many run at once; memory is bounded by the pool alone.

Admission. A waiting sequence is admitted when the blocks of its first chunk exist (after its prompt's cached
prefix, which it shares by reference) and a place among the running is free. Waiting sequences queue per request
(`Sequence.group`: one client request's prompts x n); under `fcfs` each free place goes to the waiting request that
holds the fewest (ties: round robin, in turn), so a request with thousands of sequences cannot keep a small one
waiting behind all of them. Under `priority` the waiting sequence with the lowest (priority, arrival) goes first.
A sequence whose next chunk is a whole prompt chunk that a running sequence is computing right now waits a step:
it then finds that chunk in the prefix cache instead of computing it again (a shared system prompt is prefilled
once).

LoRA slots. A sequence under a LoRA adapter runs only while its adapter sits in one of the model's adapter slots
(`adapters`: model/lora/registry.py). Admission takes one (`acquire`: the adapter's own, a free one, or the least
recently used idle adapter's) and leaving the running batch gives it back (`release`); a sequence whose adapter
finds every slot held by running sequences waits, and the sequences behind it are admitted meanwhile (vLLM's
--max-loras).

Preemption by recompute. When a running sequence's next step needs a block the pool lacks, the least important
running sequence (fcfs: the latest arrived; priority: the highest priority value, then the latest arrived) gives all
its blocks back and waits again at the head of its queue. When it runs again its prompt is prefilled in the same
chunks as before (or found in the prefix cache) and its generated tokens are replayed as decode rows, each computed
exactly as its original decode step was (the runner's rows do not depend on their batch-mates), so its K/V, and
therefore its output, greedy or seeded, are the same bits as without the preemption. Under `priority`, a waiting
sequence also preempts running ones less important than itself to be admitted.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Iterator

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus

POLICIES = ("fcfs", "priority")
WATERMARK = 0.01  # of the pool's blocks kept free at admission, so running sequences can grow (vLLM's default)


@dataclass
class PrefillChunk:
    seq: Sequence
    start: int  # first column computed (a multiple of the chunk size)
    end: int

    @property
    def samples(self) -> bool:
        """The chunk ends at the newest token, so its last logits choose the next one."""
        return self.end == self.seq.num_tokens


@dataclass
class Replay:
    """Generated tokens of a preempted sequence, columns [start, end), recomputed as decode rows (logits unused)."""

    seq: Sequence
    start: int
    end: int


@dataclass
class StepPlan:
    prefill: list[PrefillChunk] = field(default_factory=list)
    replay: list[Replay] = field(default_factory=list)
    decode: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.prefill or self.decode or self.replay)

    def seqs(self) -> list[Sequence]:
        """The requests this step computes (prefill chunks' and decode rows')."""
        return [c.seq for c in self.prefill] + self.decode


def unsplit(seq: Sequence, start: int, end: int) -> int:
    """A prefill chunk's end moved so that it splits no image's placeholders (issue 43: the encoder's rows go in
    whole, and Gemma 3's image tokens attend each other): back to the image's start when the chunk has tokens
    before it, else past the image's end."""
    for image in seq.images:
        if image.start < end < image.end:
            return image.start if image.start > start else image.end
    return end


class Scheduler:
    def __init__(self, max_num_seqs: int, chunk_size: int, token_budget: int, blocks: BlockManager,
                 policy: str = "fcfs", adapters: Any = None) -> None:
        assert policy in POLICIES, policy
        self.adapters = adapters  # the model's lora.AdapterRegistry: slots for the admitted sequences' adapters
        self.chunk_size, self.token_budget, self.blocks, self.policy = chunk_size, token_budget, blocks, policy
        self.waiting: OrderedDict[str, deque[Sequence]] = OrderedDict()  # group -> its sequences, FIFO; groups in turn
        self.running: list[Sequence] = []
        self.slots_held: dict[str, int] = {}  # group -> running sequences it holds
        self.free_slots: deque[int] = deque(range(max_num_seqs))
        self.num_slots = max_num_seqs
        self.num_preemptions = 0
        self._watermark = max(1, int(blocks.num_blocks * WATERMARK))

    def add(self, seq: Sequence) -> None:
        self.waiting.setdefault(seq.group, deque()).append(seq)

    def rank(self, seq: Sequence) -> tuple:
        """Importance, most important smallest."""
        return (seq.priority, seq.arrival_time) if self.policy == "priority" else (seq.arrival_time,)

    # ---- the step ----------------------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        for seq in sorted(self.running, key=self.rank):  # the decode rows: a column each, most important first
            if seq.status is SequenceStatus.RUNNING and seq.num_uncached == 1:
                self._make_room(seq, seq.num_tokens, plan, preempt_self=True)
        plan.decode = [s for s in self.running if s.num_uncached == 1]
        self._admit(plan)
        budget = self.token_budget - len(plan.decode)
        order = self.running if self.policy == "fcfs" else sorted(self.running, key=self.rank)
        for seq in list(order):
            if seq.status is not SequenceStatus.RUNNING or seq.num_uncached <= 1:
                continue
            if budget < self.chunk_size and (plan.prefill or plan.replay):  # one chunk per step at least
                break
            start, prompt = seq.num_cached, len(seq.prompt_ids)
            end = min(start + self.chunk_size, prompt if start < prompt else seq.num_tokens - 1)
            end = unsplit(seq, start, end)
            if not self._make_room(seq, end, plan, preempt_self=False):
                continue
            if start < prompt:
                plan.prefill.append(PrefillChunk(seq, start, end))
            else:
                plan.replay.append(Replay(seq, start, end))
            budget -= end - start
        return plan

    def _admit(self, plan: StepPlan) -> None:
        computing = {k for s in self.running if (k := self.blocks.pending_key(s)) is not None}
        deferred: set[int] = set()
        while self.waiting:
            skip = deferred | {id(s) for s in plan.preempted}  # preempted this step: not back in the same step
            seq = next((s for s in self._candidates() if id(s) not in skip), None)
            if seq is None:
                return
            if not self._take_adapter(seq):  # every adapter slot is held: it waits, the others go on
                deferred.add(id(seq))
                continue
            if not self.free_slots and not self._preempt_for(seq, plan):
                self._drop_adapter(seq)
                return
            hit = self.blocks.match(seq)
            seq.num_cached = hit
            key = self.blocks.pending_key(seq)
            if key is not None and key in computing:  # another sequence is computing that chunk: take it next step
                self.blocks.free(seq)
                seq.num_cached = 0
                self._drop_adapter(seq)
                deferred.add(id(seq))
                continue
            first = min(hit + self.chunk_size, len(seq.prompt_ids))
            while not self._fits(seq, first):
                if not self._preempt_for(seq, plan):
                    self.blocks.free(seq)
                    seq.num_cached = 0
                    self._drop_adapter(seq)
                    return
            self.blocks.record_lookup(len(seq.prompt_ids), hit)
            self._take_waiting(seq)
            seq.prefix_hit_tokens = max(seq.prefix_hit_tokens, hit) if seq.num_preemptions else hit
            seq.slot, seq.status = self.free_slots.popleft(), SequenceStatus.RUNNING
            seq.scheduled_time = seq.scheduled_time or time.monotonic()
            self.running.append(seq)
            plan.admitted.append(seq)
            if key is not None:
                computing.add(key)

    def _take_adapter(self, seq: Sequence) -> bool:
        """Hold a slot for seq's LoRA adapter (True without one); False when every slot is held."""
        return seq.lora is None or self.adapters.acquire(seq.lora)

    def _drop_adapter(self, seq: Sequence) -> None:
        if seq.lora is not None:
            self.adapters.release(seq.lora)

    def _fits(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether seq's table covers num_tokens with the watermark left free (grown when it does). With nothing
        running there is nobody to keep room for: a request as large as the pool must still start."""
        need = self.blocks.blocks_for(num_tokens) - len(seq.block_table)
        reserve = self._watermark if self.running else 0
        return self.blocks.num_free - max(need, 0) >= reserve and self.blocks.grow(seq, num_tokens)

    def _candidates(self) -> Iterator[Sequence]:
        """Waiting sequences in the order they get a place."""
        if self.policy == "priority":
            yield from sorted((s for q in self.waiting.values() for s in q), key=self.rank)
            return
        groups = sorted(self.waiting, key=lambda g: self.slots_held.get(g, 0))  # stable: the line's order on ties
        for group in groups:
            yield self.waiting[group][0]

    def _take_waiting(self, seq: Sequence) -> None:
        queue = self.waiting.pop(seq.group)
        queue.remove(seq)
        if queue:
            self.waiting[seq.group] = queue  # the request goes to the back of the line
        self.slots_held[seq.group] = self.slots_held.get(seq.group, 0) + 1

    # ---- preemption --------------------------------------------------------------------------------------------
    def _make_room(self, seq: Sequence, num_tokens: int, plan: StepPlan, preempt_self: bool) -> bool:
        """Grow seq's table to num_tokens, preempting less important running sequences while the pool lacks blocks;
        when none is left, seq itself when `preempt_self`. Whether seq got them."""
        while not self.blocks.grow(seq, num_tokens):
            others = [s for s in self.running if s is not seq]
            victim = max(others, key=self.rank, default=None)
            if victim is None or self.rank(victim) < self.rank(seq):
                if preempt_self:
                    self._preempt(seq, plan)
                return False
            self._preempt(victim, plan)
        return True

    def _preempt_for(self, seq: Sequence, plan: StepPlan) -> bool:
        """Under `priority`, preempt the least important running sequence when it is less important than the
        waiting seq (whether one was)."""
        if self.policy != "priority" or not self.running:
            return False
        victim = max(self.running, key=self.rank)
        if self.rank(victim) <= self.rank(seq):
            return False
        self._preempt(victim, plan)
        return True

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        """Free all of seq's blocks; it waits again at the head of its request's queue and is recomputed."""
        self._leave_running(seq)
        seq.status, seq.num_cached = SequenceStatus.WAITING, 0
        if seq.spec is not None:
            seq.spec.draft_cached = 0  # its draft model's cache row goes with its place
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.setdefault(seq.group, deque()).appendleft(seq)
        self.waiting.move_to_end(seq.group, last=False)
        if seq in plan.decode:
            plan.decode.remove(seq)
        plan.prefill = [c for c in plan.prefill if c.seq is not seq]
        plan.replay = [r for r in plan.replay if r.seq is not seq]
        plan.preempted.append(seq)

    def _leave_running(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._drop_adapter(seq)
        held = self.slots_held.pop(seq.group, 0) - 1
        if held > 0:
            self.slots_held[seq.group] = held
        self.blocks.free(seq)
        if seq.slot is not None:
            self.free_slots.append(seq.slot)
            seq.slot = None

    def release(self, seq: Sequence) -> None:
        """Give a finished or aborted request's blocks and place back; they are free for the next step."""
        if seq in self.running:
            self._leave_running(seq)
        queue = self.waiting.get(seq.group)
        if queue is not None and seq in queue:
            queue.remove(seq)
            if not queue:
                del self.waiting[seq.group]
        seq.status = SequenceStatus.FINISHED

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self.waiting.values())
