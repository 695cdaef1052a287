"""The scheduler (engine/scheduler.py) on its own, over a real BlockManager and hand-built Sequences (no model):
each step's plan is worked out by hand from the rules in the module's docstring, and tests/sequences.run_plan does
what the model runner does after a step (columns cached, a token for every row that samples).

Blocks of 2 tokens throughout; a fresh pool hands out its highest block ids first."""

from __future__ import annotations

from nexttoken.engine.block_manager import BlockManager
from nexttoken.engine.scheduler import PrefillChunk, Replay, Scheduler
from nexttoken.engine.sequence import SequenceStatus
from support.sequences import make_seq, run_plan


def chunks(plan) -> list[tuple[str, int, int]]:  # noqa: ANN001
    return [(c.seq.request_id, c.start, c.end) for c in plan.prefill]


def ids(seqs) -> list[str]:  # noqa: ANN001
    return [s.request_id for s in seqs]


def test_chunked_prefill_within_the_token_budget() -> None:
    """Budget 6, chunks of 4: a 10-token prompt takes three steps (4 + 4 + 2); the 3-token one waits for budget
    until the third step, then both sample and decode together."""
    blocks = BlockManager(num_blocks=64, block_size=2, chunk_size=4, prefix_caching=False)
    sched = Scheduler(max_num_seqs=2, chunk_size=4, token_budget=6, blocks=blocks)
    a, b, c = make_seq("a", range(100, 110), arrival=1), make_seq("b", [5, 6, 7], arrival=2), make_seq("c", [8, 9],
                                                                                                       arrival=3)
    for s in (a, b, c):
        sched.add(s)
    plan = sched.schedule()
    assert ids(plan.admitted) == ["a", "b"] and chunks(plan) == [("a", 0, 4)]  # 6 - 4 = 2 left: less than a chunk
    assert sched.num_waiting == 1 and sched.num_running == 2 and (a.slot, b.slot) == (0, 1)
    assert len(a.block_table) == 2 and len(b.block_table) == 2  # each admitted with its first chunk's blocks
    run_plan(plan, blocks)
    plan = sched.schedule()
    assert chunks(plan) == [("a", 4, 8)] and plan.decode == [] and plan.admitted == []  # c: no place free
    run_plan(plan, blocks)
    plan = sched.schedule()
    assert chunks(plan) == [("a", 8, 10), ("b", 0, 3)] and all(c.samples for c in plan.prefill)  # 2 + 3 <= 6
    run_plan(plan, blocks)
    plan = sched.schedule()
    assert ids(plan.decode) == ["a", "b"] and plan.prefill == []
    assert len(a.block_table) == 6  # 11 columns


def test_the_first_chunk_runs_even_over_a_small_budget() -> None:
    blocks = BlockManager(num_blocks=64, block_size=2, chunk_size=4, prefix_caching=False)
    sched = Scheduler(max_num_seqs=2, chunk_size=4, token_budget=2, blocks=blocks)
    sched.add(make_seq("a", range(100, 110)))
    sched.add(make_seq("b", range(200, 210)))
    assert chunks(sched.schedule()) == [("a", 0, 4)]  # one chunk per step at least; b's must wait


def test_fcfs_gives_free_places_to_the_request_holding_fewest() -> None:
    """A request of 3 sequences (group big) arrived before a request of 1: big gets the first place, then the
    small request the second (it holds none, big holds one), then big again when a place frees."""
    blocks = BlockManager(num_blocks=64, block_size=2, chunk_size=4, prefix_caching=False)
    sched = Scheduler(max_num_seqs=2, chunk_size=4, token_budget=64, blocks=blocks)
    big = [make_seq(f"big{i}", [1, 2, 3], group="big", arrival=i) for i in range(3)]
    small = make_seq("small", [4, 5, 6], arrival=9)
    for s in big + [small]:
        sched.add(s)
    plan = sched.schedule()
    assert ids(plan.admitted) == ["big0", "small"] and sched.slots_held == {"big": 1, "small": 1}
    sched.release(small)
    assert small.status is SequenceStatus.FINISHED and small.block_table == [] and list(sched.free_slots) == [1]
    assert ids(sched.schedule().admitted) == ["big1"]


def test_priority_orders_admission_and_preempts_the_less_important() -> None:
    blocks = BlockManager(num_blocks=64, block_size=2, chunk_size=4, prefix_caching=False)
    sched = Scheduler(max_num_seqs=1, chunk_size=4, token_budget=64, blocks=blocks, policy="priority")
    low = make_seq("low", [1, 2, 3, 4, 5, 6], priority=5, arrival=1)
    sched.add(low)
    run_plan(sched.schedule(), blocks)
    assert low.status is SequenceStatus.RUNNING and low.num_cached == 4
    later = make_seq("later", [7, 8], priority=9, arrival=2)
    sched.add(later)
    assert sched.schedule().admitted == [] and sched.num_waiting == 1  # less important: no preemption
    high = make_seq("high", [9, 10], priority=-1, arrival=3)
    sched.add(high)
    plan = sched.schedule()
    assert ids(plan.preempted) == ["low"] and ids(plan.admitted) == ["high"] and chunks(plan) == [("high", 0, 2)]
    assert (low.status, low.num_cached, low.block_table, low.num_preemptions) == (SequenceStatus.WAITING, 0, [], 1)
    assert sched.num_preemptions == 1
    sched.release(high)
    assert ids(sched.schedule().admitted) == ["low"]  # (priority, arrival): 5 before 9, though back in line later


def test_decode_growth_preempts_the_latest_arrival_which_then_recomputes() -> None:
    """4 blocks of 2 (8 columns) for two 3-token prompts: each decodes until its 5th column needs a third block.
    The latest arrival (b) gives its blocks back and waits; once a finishes, b's prompt is prefilled again in the
    same chunks and its 2 generated tokens replayed, then it decodes."""
    blocks = BlockManager(num_blocks=5, block_size=2, chunk_size=2, prefix_caching=False)
    sched = Scheduler(max_num_seqs=2, chunk_size=2, token_budget=8, blocks=blocks)
    a, b = make_seq("a", [1, 2, 3], arrival=1), make_seq("b", [4, 5, 6], arrival=2)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    assert chunks(plan) == [("a", 0, 2), ("b", 0, 2)]
    run_plan(plan, blocks)
    plan = sched.schedule()  # one prompt token left each: it runs as a decode row, which samples
    assert plan.prefill == [] and ids(plan.decode) == ["a", "b"] and blocks.num_free == 0
    run_plan(plan, blocks)  # each has its first token: 4 tokens, 3 cached
    plan = sched.schedule()
    assert ids(plan.decode) == ["a", "b"]  # column 3 fits their second blocks
    run_plan(plan, blocks)
    plan = sched.schedule()  # column 4 needs a third block each; the pool is empty
    assert ids(plan.preempted) == ["b"] and ids(plan.decode) == ["a"] and plan.admitted == []
    assert b.status is SequenceStatus.WAITING and b.num_tokens == 5 and b.num_cached == 0
    assert len(a.block_table) == 3 and blocks.num_free == 1
    run_plan(plan, blocks)
    sched.release(a)  # a finished
    plan = sched.schedule()
    assert ids(plan.admitted) == ["b"] and chunks(plan) == [("b", 0, 2)]
    run_plan(plan, blocks)
    plan = sched.schedule()
    assert chunks(plan) == [("b", 2, 3)] and not plan.prefill[0].samples  # its tokens exist already
    run_plan(plan, blocks)
    plan = sched.schedule()
    assert [(r.seq.request_id, r.start, r.end) for r in plan.replay] == [("b", 3, 4)] and plan.prefill == []
    run_plan(plan, blocks)
    assert ids(sched.schedule().decode) == ["b"] and b.num_tokens == 5  # replay sampled nothing


def test_a_lone_sequence_longer_than_the_pool_preempts_itself() -> None:
    blocks = BlockManager(num_blocks=3, block_size=2, chunk_size=2, prefix_caching=False)  # 4 columns
    sched = Scheduler(max_num_seqs=1, chunk_size=2, token_budget=8, blocks=blocks)
    a = make_seq("a", [1, 2, 3])
    sched.add(a)
    for _ in range(3):  # chunk [0, 2), then decode rows at columns 2 (its first token) and 3
        run_plan(sched.schedule(), blocks)
    assert a.num_tokens == 5 and a.num_cached == 4
    plan = sched.schedule()  # column 4 needs a third block: none exists, nobody else to preempt
    assert ids(plan.preempted) == ["a"] and plan.empty and a.status is SequenceStatus.WAITING
    assert blocks.num_free == 2


def test_a_first_chunk_larger_than_the_pool_waits_and_takes_nothing() -> None:
    blocks = BlockManager(num_blocks=3, block_size=2, chunk_size=8, prefix_caching=False)  # 2 blocks; a chunk is 4
    sched = Scheduler(max_num_seqs=2, chunk_size=8, token_budget=8, blocks=blocks)
    sched.add(make_seq("a", range(100, 110)))
    plan = sched.schedule()
    assert plan.empty and plan.admitted == [] and sched.num_waiting == 1 and blocks.num_free == 2


def test_a_chunk_being_computed_is_waited_for_then_shared() -> None:
    """b's first chunk is a's first chunk: while a computes it, b waits a step, then finds it in the prefix cache
    (a shared system prompt is prefilled once)."""
    blocks = BlockManager(num_blocks=64, block_size=2, chunk_size=4)
    sched = Scheduler(max_num_seqs=2, chunk_size=4, token_budget=64, blocks=blocks)
    a = make_seq("a", list(range(10, 19)), arrival=1)
    b = make_seq("b", list(range(10, 14)) + [50, 51, 52, 53, 54], arrival=2)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    assert ids(plan.admitted) == ["a"] and chunks(plan) == [("a", 0, 4)] and sched.num_waiting == 1
    run_plan(plan, blocks)  # a's first chunk hashed
    plan = sched.schedule()
    assert ids(plan.admitted) == ["b"] and b.num_cached == 4 and b.prefix_hit_tokens == 4
    assert b.block_table[:2] == a.block_table[:2]
    assert chunks(plan) == [("a", 4, 8), ("b", 4, 8)]
    assert (blocks.queried_tokens, blocks.hit_tokens) == (18, 4)


def test_step_plan_shapes() -> None:
    seq = make_seq("a", [1, 2, 3])
    assert PrefillChunk(seq, 0, 3).samples and not PrefillChunk(seq, 0, 2).samples
    assert Replay(seq, 3, 4).end == 4
