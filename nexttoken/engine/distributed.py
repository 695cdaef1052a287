"""The engine over tensor-parallel ranks: rank 0 schedules, every rank runs the same model-runner code.

    rank 0 (the engine, the API, the server)            ranks 1..N-1 (workers: `serve_worker`)
    scheduler.schedule() -> StepPlan
    DistributedRunner.run(plan):
        broadcast_object_list([StepMessage]) ------->   receive the StepMessage
        ModelRunner.run(plan)    <- all-reduces ->      ModelRunner.run(mirror of the plan)
        logits (all-gathered by the vocab-parallel head): sampling, stopping, text: rank 0 only

A `StepMessage` carries what the runner reads of each sequence (tokens, lengths, prompt-logprob wishes) and the
block table of every row: rank 0's block manager decides every block (prefix-cache hits included), and each rank's
pool holds its heads of the same blocks. Only torch.distributed moves data (gloo on CPU, NCCL on CUDA).

Failure. Every collective runs under the process group's timeout. Rank 0 pings idle workers (a broadcast and an
all-reduce) every `timeout / 4` seconds, so a hung or dead rank is noticed while the server idles too, and a
worker whose rank 0 falls silent for `timeout` seconds stops. Locally spawned workers are also watched as
processes. Any of these calls `Cluster.fail`: later steps raise TensorParallelError at once, and the server's
`on_failure` ends the process with the message (a sharded model with a missing rank cannot compute anything).
"""

from __future__ import annotations

import atexit
import itertools
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..model.parallel import RankGroup, TensorParallelError
from .model_runner import ModelRunner
from .scheduler import PrefillChunk, Replay, StepPlan

DEFAULT_TIMEOUT_S = 60.0  # a collective (or an idle worker's wait for the next step) longer than this is a failure
WATCH_INTERVAL_S = 0.2  # how often rank 0 checks its local workers' processes


# ---- the step message -------------------------------------------------------------------------------------------
@dataclass
class Admitted:
    request_id: str
    prompt_ids: list[int]
    wants_prompt_logprobs: bool
    top_logprobs: int
    num_cached: int  # prompt tokens found in the prefix cache (their blocks head its table)


@dataclass
class StepMessage:
    kind: str  # "step", "ping" or "stop"
    engine: tuple = ()  # (serial, num_blocks, block size, max_len, cache dtype): which runner
    admitted: list[Admitted] = field(default_factory=list)
    prefill: list[tuple[str, int, int, list[int]]] = field(default_factory=list)  # (request id, start, end, table)
    replay: list[tuple[str, int, int, list[int], list[int]]] = field(default_factory=list)  # + generated ids
    decode: list[tuple[str, int, int, list[int]]] = field(default_factory=list)  # (id, last token, num tokens, table)
    hook_inputs: dict[str, dict] = field(default_factory=dict)  # request id -> extra model inputs (rank 0's hooks)
    released: list[str] = field(default_factory=list)  # requests that left since the last message


class _Params:
    def __init__(self, wants_prompt_logprobs: bool, top_logprobs: int) -> None:
        self.wants_prompt_logprobs, self.top_logprobs = wants_prompt_logprobs, top_logprobs


class MirrorSequence:
    """A worker's copy of what the model runner reads and writes of one rank-0 Sequence."""

    def __init__(self, a: Admitted) -> None:
        self.request_id, self.prompt_ids = a.request_id, a.prompt_ids
        self.params = _Params(a.wants_prompt_logprobs, a.top_logprobs)
        self.last_token, self.num_tokens = a.prompt_ids[-1], len(a.prompt_ids)
        self.num_cached, self.prompt_logprobs = a.num_cached, None
        self.block_table: list[int] = []
        self.slot: int | None = None  # a recurrent state's row: none (tensor parallelism refuses recurrent models)
        # images and M-RoPE: none (tensor parallelism refuses the vision families)
        self.images: tuple = ()
        self.mrope_positions, self.rope_delta = None, 0
        self.output_ids: list[int] = []  # known when rank 0 replays them (a preempted request)
        self.extra: dict = {}

    @property
    def token_ids(self) -> list[int]:  # read by prefill chunks and replays
        return self.prompt_ids + self.output_ids

    def hook_inputs(self) -> dict:
        return self.extra


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the ranks --------------------------------------------------------------------------------------------------
class Cluster:
    """Rank 0's view of the ranks: the process group, the local worker processes, the lock that keeps one
    collective sequence at a time, the heartbeat, and the failure state."""

    def __init__(self, ranks: RankGroup, timeout: float, workers: list[subprocess.Popen] | None = None,
                 on_failure: Callable[[str], None] | None = None) -> None:
        self.ranks, self.timeout, self.workers = ranks, timeout, workers or []
        self.on_failure = on_failure
        self.lock = threading.Lock()
        self.serial = itertools.count()  # each engine's runner gets its own id (workers rebuild theirs on a new one)
        self.failure: str | None = None
        self.last_message = time.monotonic()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._heartbeat, name="nexttoken-tp-heartbeat", daemon=True)]
        if self.workers:
            self._threads.append(threading.Thread(target=self._watch, name="nexttoken-tp-watch", daemon=True))
        for t in self._threads:
            t.start()
        atexit.register(self.close)  # the workers are told to stop when this process ends

    def check(self) -> None:
        if self.failure is not None:
            raise TensorParallelError(self.failure)

    def lost(self) -> str:
        """Which local worker died, when one did (a collective that fails on a dead peer usually returns before the
        process is reaped, so this waits a moment for it); "" when none did (a hang, or a remote rank)."""
        deadline = time.monotonic() + 1.0
        while True:
            dead = [(r, p) for r, p in enumerate(self.workers, start=1) if p.poll() is not None]
            if dead or time.monotonic() > deadline or not self.workers:
                break
            time.sleep(0.05)
        return "; ".join(f"rank {r} (pid {p.pid}) exited with code {p.returncode}" for r, p in dead)

    def fail(self, message: str) -> None:
        if self.failure is None:
            message += "; the model's shards are incomplete, so this engine cannot go on"
            self.failure = message
            if self.on_failure is not None:
                self.on_failure(message)
            else:
                print(f"nexttoken: tensor parallelism failed: {message}", file=sys.stderr, flush=True)

    def send(self, message: StepMessage) -> None:
        """Broadcast one message (the lock is held)."""
        self.check()
        try:
            dist.broadcast_object_list([message], src=0, group=self.ranks.group)
        except Exception as e:  # noqa: BLE001 - gloo reports a dead peer or a timeout as RuntimeError
            self.fail(self.lost() or f"sending the step to the other ranks failed ({_short(e)}): a rank died or "
                      f"hung (nothing for {self.timeout:g} s)")
            raise TensorParallelError(self.failure) from e
        self.last_message = time.monotonic()

    def _heartbeat(self) -> None:
        interval = self.timeout / 4
        while not self._stop.wait(interval / 4):
            if self.failure is not None or time.monotonic() - self.last_message < interval:
                continue
            with self.lock:
                if self._stop.is_set() or self.failure is not None:
                    return
                try:
                    self.send(StepMessage("ping"))
                    self.ranks.active = True
                    self.ranks.all_reduce(torch.zeros(1, device=self.ranks.device))
                except TensorParallelError:
                    return
                except Exception as e:  # noqa: BLE001
                    self.fail(self.lost() or f"a rank did not answer the heartbeat within {self.timeout:g} s "
                              f"({_short(e)}): a rank died or hung")
                    return
                finally:
                    self.ranks.active = False

    def _watch(self) -> None:
        while not self._stop.wait(WATCH_INTERVAL_S):
            for rank, proc in enumerate(self.workers, start=1):
                code = proc.poll()
                if code is not None and self.failure is None:
                    self.fail(f"rank {rank} (pid {proc.pid}) exited with code {code}")
                    return

    def close(self) -> None:
        """Stop the workers (they exit when told) and leave the process group."""
        if self._stop.is_set():
            return
        self._stop.set()
        atexit.unregister(self.close)
        with self.lock:
            if self.failure is None:
                try:
                    dist.broadcast_object_list([StepMessage("stop")], src=0, group=self.ranks.group)
                except Exception:  # noqa: BLE001 - the workers are gone already
                    pass
        for proc in self.workers:
            try:
                proc.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
        self.failure = self.failure or "this tensor-parallel model was closed (LLM.close()): load it again"


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


class DistributedRunner(ModelRunner):
    """Rank 0's ModelRunner: each run broadcasts the step's plan first, then runs it with every rank."""

    def __init__(self, model, num_blocks: int, block_size: int, max_len: int,  # noqa: ANN001
                 cache_dtype: torch.dtype | None = None) -> None:
        super().__init__(model, num_blocks, block_size, max_len, cache_dtype)
        self.cluster: Cluster = model.cluster
        self.key = (next(self.cluster.serial), num_blocks, block_size, max_len, str(self.cache.k.dtype))
        self._sent: dict[str, Any] = {}  # request id -> its Sequence, while the workers hold a mirror of it

    def run(self, plan: StepPlan):  # noqa: ANN201
        with self.cluster.lock:
            self.cluster.send(self._message(plan))
            self.cluster.ranks.active = True
            try:
                return super().run(plan)
            except TensorParallelError:
                raise
            except RuntimeError as e:  # a collective failed: a peer died, or the timeout passed
                self.cluster.fail(self.cluster.lost() or f"a collective failed during a step ({_short(e)}): a rank "
                                  f"died or hung (nothing for {self.cluster.timeout:g} s)")
                raise TensorParallelError(self.cluster.failure) from e
            finally:
                self.cluster.ranks.active = False

    def _message(self, plan: StepPlan) -> StepMessage:
        released = [rid for rid, seq in self._sent.items() if seq.slot is None]
        for rid in released:
            del self._sent[rid]
        msg = StepMessage("step", self.key, released=released)
        for seq in plan.admitted:
            self._sent[seq.request_id] = seq
            msg.admitted.append(Admitted(seq.request_id, list(seq.prompt_ids), seq.params.wants_prompt_logprobs,
                                         seq.params.top_logprobs, seq.num_cached))
        msg.prefill = [(c.seq.request_id, c.start, c.end, list(c.seq.block_table)) for c in plan.prefill]
        msg.replay = [(r.seq.request_id, r.start, r.end, list(r.seq.block_table), list(r.seq.output_ids))
                      for r in plan.replay]
        msg.decode = [(s.request_id, s.last_token, s.num_tokens, list(s.block_table)) for s in plan.decode]
        for seq in [c.seq for c in plan.prefill] + plan.decode:
            extra = seq.hook_inputs()
            if extra:
                msg.hook_inputs[seq.request_id] = extra
        return msg


# ---- the workers ------------------------------------------------------------------------------------------------
class WorkerState:
    """A worker's runner (rebuilt when rank 0 builds a new engine) and its mirrors of rank 0's sequences."""

    def __init__(self, model) -> None:  # noqa: ANN001
        self.model = model
        self.key: tuple = ()
        self.runner: ModelRunner | None = None
        self.seqs: dict[str, MirrorSequence] = {}

    def plan(self, msg: StepMessage) -> StepPlan:
        if msg.engine != self.key:
            _, n_blocks, block_size, max_len, dtype = msg.engine
            self.runner, self.key, self.seqs = None, msg.engine, {}  # the old pool is freed first
            self.runner = ModelRunner(self.model, n_blocks, block_size, max_len, getattr(torch, dtype.split(".")[-1]))
        for rid in msg.released:
            self.seqs.pop(rid, None)
        plan = StepPlan()
        for a in msg.admitted:
            self.seqs[a.request_id] = MirrorSequence(a)
        for rid, start, end, table in msg.prefill:
            seq = self.seqs[rid]
            assert end <= len(seq.prompt_ids), "prefill chunks cover prompt tokens only"
            seq.block_table = table
            plan.prefill.append(PrefillChunk(seq, start, end))  # type: ignore[arg-type]
        for rid, start, end, table, outputs in msg.replay:
            seq = self.seqs[rid]
            seq.block_table, seq.output_ids = table, outputs
            plan.replay.append(Replay(seq, start, end))  # type: ignore[arg-type]
        for rid, last, n, table in msg.decode:
            seq = self.seqs[rid]
            seq.last_token, seq.num_tokens, seq.block_table = last, n, table
            plan.decode.append(seq)  # type: ignore[arg-type]
        for seq in self.seqs.values():
            seq.extra = msg.hook_inputs.get(seq.request_id, {})
        return plan


def serve_worker(model) -> None:  # noqa: ANN001
    """A worker rank's loop: run every step rank 0 broadcasts until it says stop. Raises TensorParallelError
    when rank 0 falls silent for the timeout or dies."""
    ranks: RankGroup = model.parallel.ranks
    state = WorkerState(model)
    while True:
        box: list[Any] = [None]
        try:
            dist.broadcast_object_list(box, src=0, group=ranks.group)
        except Exception as e:  # noqa: BLE001
            raise TensorParallelError(f"rank {ranks.rank}: rank 0 died or fell silent ({_short(e)})") from e
        msg: StepMessage = box[0]
        if msg.kind == "stop":
            return
        ranks.active = True
        try:
            if msg.kind == "ping":
                ranks.all_reduce(torch.zeros(1, device=ranks.device))
            else:
                plan = state.plan(msg)
                state.runner.run(plan)  # type: ignore[union-attr] - plan() built it
        except (dist.DistError, RuntimeError) as e:  # a collective of the step failed: a peer left mid-step
            raise TensorParallelError(f"rank {ranks.rank}: rank 0 died or fell silent during a step "
                                      f"({_short(e)})") from e
        finally:
            ranks.active = False
