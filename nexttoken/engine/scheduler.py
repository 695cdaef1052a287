"""The scheduler: which requests get a cache slot, and what each running one computes this step.

As in nano-vllm, sequences are `waiting` (no slot yet) or `running` (own a slot). A step runs one decode token for
every running sequence that has finished its prompt, plus prefill chunks of the others within a token budget, so
a long prompt is prefilled over several steps while the other streams keep flowing. KV memory is bounded by the
number of slots: when all are taken, new sequences wait.

Waiting sequences queue per request (`Sequence.group`: one client request's prompts x n), and each free slot goes
to the waiting request that holds the fewest slots (ties: round robin, in turn). A request with thousands of
sequences cannot keep a small one waiting behind all of them: the small one gets the next free slot. (Slots are
not taken back from a running sequence: there is no preemption, so that next slot is the first one to free.)
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from .prefix_cache import PrefixCache
from .sequence import Sequence, SequenceStatus


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
class StepPlan:
    admitted: list[tuple[Sequence, list[int]]] = field(default_factory=list)  # (seq, prefix-cache blocks to copy)
    prefill: list[PrefillChunk] = field(default_factory=list)
    decode: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.prefill or self.decode)


class Scheduler:
    def __init__(self, num_slots: int, chunk_size: int, token_budget: int, prefix_cache: PrefixCache) -> None:
        self.chunk_size, self.token_budget, self.prefix_cache = chunk_size, token_budget, prefix_cache
        self.waiting: OrderedDict[str, deque[Sequence]] = OrderedDict()  # group -> its sequences, FIFO; groups in turn
        self.running: deque[Sequence] = deque()
        self.slots_held: dict[str, int] = {}  # group -> running sequences (slots) it holds
        self.free_slots: deque[int] = deque(range(num_slots))
        self.num_slots = num_slots

    def add(self, seq: Sequence) -> None:
        self.waiting.setdefault(seq.group, deque()).append(seq)

    def _next_waiting(self) -> Sequence:
        """The first sequence of the waiting request that holds the fewest slots (the first such in line); that
        request then goes to the back of the line."""
        group = min(self.waiting, key=lambda g: self.slots_held.get(g, 0))
        queue = self.waiting.pop(group)
        seq = queue.popleft()
        if queue:
            self.waiting[group] = queue
        self.slots_held[group] = self.slots_held.get(group, 0) + 1
        return seq

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        while self.waiting and self.free_slots:
            seq = self._next_waiting()
            seq.slot, seq.status = self.free_slots.popleft(), SequenceStatus.RUNNING
            seq.scheduled_time = seq.scheduled_time or time.monotonic()
            # Prompt logprobs need the logits of every prompt position, so such a request computes them all.
            wants_all = seq.params.wants_prompt_logprobs
            blocks = [] if wants_all else self.prefix_cache.match(seq.token_ids, seq.lora_key)
            seq.num_cached = seq.prefix_hit_tokens = len(blocks) * self.chunk_size
            plan.admitted.append((seq, blocks))
            self.running.append(seq)
        plan.decode = [s for s in self.running if s.num_uncached == 1]
        budget = self.token_budget - len(plan.decode)
        for seq in self.running:
            if seq.num_uncached <= 1:
                continue
            if budget < self.chunk_size and plan.prefill:  # one chunk per step at least, so prefill progresses
                break
            start = seq.num_cached
            end = min(start + self.chunk_size, seq.num_tokens)
            plan.prefill.append(PrefillChunk(seq, start, end))
            budget -= end - start
        return plan

    def release(self, seq: Sequence) -> None:
        """Give a finished or aborted request's slot back; it is free for the next step."""
        if seq in self.running:
            self.running.remove(seq)
            held = self.slots_held.pop(seq.group, 0) - 1
            if held > 0:
                self.slots_held[seq.group] = held
        queue = self.waiting.get(seq.group)
        if queue is not None and seq in queue:
            queue.remove(seq)
            if not queue:
                del self.waiting[seq.group]
        if seq.slot is not None:
            self.free_slots.append(seq.slot)
            seq.slot = None
        seq.status = SequenceStatus.FINISHED

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self.waiting.values())
