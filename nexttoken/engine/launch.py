"""Starting the ranks of a tensor-parallel model: spawned here on one machine, or launched by torchrun.

Local (`nexttoken.load(path, tensor_parallel_size=N)`, `nexttoken serve --tensor-parallel-size N`): this process
is rank 0; it starts N-1 worker processes (`python -m nexttoken.engine.launch`) that join a process group on a
free loopback port (env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE), and every rank loads its own slices.

torchrun (several hosts): every rank runs the same nexttoken command; torchrun sets RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT. Rank 0 goes on as the engine (and server); on every other rank the load call serves
steps as a worker and exits the process when rank 0 closes (docs/tensor_parallel.md has the commands).
"""

from __future__ import annotations

import argparse
import atexit
import gc
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from ..config import ModelConfig
from ..errors import ModelLoadError
from ..model.weights.shard import load_model_shard
from ..model.parallel import RankGroup, TensorParallelError, check_divisible, quantize_int8_sharded
from ..model.quant.quantize import QUANTIZATIONS
from .distributed import DEFAULT_TIMEOUT_S, Cluster, free_port, serve_worker


def backend_for(device: torch.device) -> str:
    """gloo on CPU, NCCL on CUDA; a clear error where torch lacks the one needed."""
    if not dist.is_available():
        raise ModelLoadError("this torch build has no torch.distributed: tensor parallelism needs it")
    if device.type == "cuda":
        if not dist.is_nccl_available():
            raise ModelLoadError("tensor parallelism on CUDA needs NCCL, which this torch build lacks")
        return "nccl"
    if device.type == "cpu":
        if not dist.is_gloo_available():
            raise ModelLoadError("tensor parallelism on CPU needs gloo, which this torch build lacks")
        return "gloo"
    raise ModelLoadError(f"tensor parallelism runs on cpu or cuda, not {device.type}")


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def _check(path: Path, size: int, quantize: str | None, timeout: float) -> None:
    if quantize not in (None, "none") and quantize not in QUANTIZATIONS:
        raise ModelLoadError(f"quantize={quantize!r} is not supported; use one of {', '.join(QUANTIZATIONS)} or None")
    if quantize not in (None, "none", "int8"):  # the ranks quantize their slices as one process would: int8 only
        raise TensorParallelError(f"quantize={quantize!r} does not run with tensor parallelism yet: use int8 or no "
                                  "quantization with tensor_parallel_size > 1")
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
        raise ModelLoadError(f"the tensor-parallel timeout must be a positive number of seconds, got {timeout!r}")
    check_divisible(ModelConfig.from_dir(path), size)  # before any process starts


def _device(device: str | torch.device | None, local_rank: int) -> torch.device:
    device = torch.device(device or "cpu")
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", local_rank)  # one GPU per local rank
        torch.cuda.set_device(device)  # NCCL's object broadcasts use the current device
    return device


START_TIMEOUT_S = 600.0  # starting a process and loading a shard may take long; the step timeout applies after


def _store(rank: int, size: int) -> dist.TCPStore:
    """The rendezvous (rank 0 hosts it on MASTER_PORT), with the start-up timeout: a rank still importing torch
    or reading its slices is not a failure."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size, is_master=rank == 0,
                         timeout=timedelta(seconds=START_TIMEOUT_S))


def _load_shard(path: Path, ranks: RankGroup, dtype, device: torch.device, quantize: str | None,  # noqa: ANN001, ANN202
                store: dist.Store | None = None):
    """This rank's shard; returns once every rank has loaded its own (so the first step's timeout counts from a
    moment all ranks share, however long loading took)."""
    ranks.active = True  # loading int8 all-reduces the row-split matrices' row maxima
    try:
        model = load_model_shard(path, ranks, dtype=dtype, device=device)
        if quantize not in (None, "none"):
            model = quantize_int8_sharded(model)
    finally:
        ranks.active = False
    if store is not None:  # a barrier under the start-up timeout, through the rendezvous store
        store.add("nexttoken/loaded", 1)
        deadline = time.monotonic() + START_TIMEOUT_S
        while store.add("nexttoken/loaded", 0) < ranks.size:
            if time.monotonic() > deadline:
                raise TensorParallelError(f"rank {ranks.rank}: the other ranks did not load within "
                                          f"{START_TIMEOUT_S:g} s")
            time.sleep(0.02)
    elif dist.get_backend() == "gloo":
        dist.monitored_barrier(timeout=timedelta(seconds=START_TIMEOUT_S), wait_all_ranks=True)
    else:
        dist.barrier()
    return model


def load_sharded(
    path: str | Path,
    tensor_parallel_size: int,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    quantize: str | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    on_failure: Callable[[str], None] | None = None,
    threads: int | None = None,
):  # noqa: ANN201
    """Rank 0's shard of the model at `path`, with `model.cluster` driving the other ranks.

    Spawns the other ranks as local processes, or, under torchrun, joins the group torchrun set up; there a
    rank other than 0 serves as a worker and then exits the process (SystemExit). Local ranks share this
    machine's cores: each runs `threads` torch threads (default: this process's count / N, at least 1; this
    process's own count is set to it), since N ranks each spinning all cores' threads wait on one another."""
    path = Path(path)
    _check(path, tensor_parallel_size, quantize, timeout)
    if under_torchrun():
        return _join_torchrun(path, tensor_parallel_size, dtype, device, quantize, timeout, on_failure)
    device = _device(device, 0)
    backend = backend_for(device)
    if dist.is_initialized():
        raise TensorParallelError(
            "this process already belongs to a torch.distributed process group: close the other tensor-parallel "
            "model first (LLM.close()), or launch with torchrun"
        )
    threads = threads or max(1, torch.get_num_threads() // tensor_parallel_size)
    torch.set_num_threads(threads)
    port = free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": str(tensor_parallel_size), "NEXTTOKEN_TP_CHILD": "1"}
    args = ["--model", str(path), "--timeout", str(timeout), "--threads", str(threads)]
    if dtype is not None:
        args += ["--dtype", str(dtype).removeprefix("torch.")]
    if quantize not in (None, "none"):
        args += ["--quantize", str(quantize)]
    if device.type != "cpu":
        args += ["--device", device.type]
    workers = [
        subprocess.Popen([sys.executable, "-m", "nexttoken.engine.launch", *args],
                         env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
        for r in range(1, tensor_parallel_size)
    ]
    try:
        store = _init_watching(backend, port, tensor_parallel_size, timeout, workers)
        ranks = RankGroup(0, tensor_parallel_size, device=device)
        model = _load_shard(path, ranks, dtype, device, quantize, store)
    except BaseException:
        for proc in workers:
            proc.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    model.cluster = Cluster(ranks, timeout, workers, on_failure)
    return model


def _init_watching(backend: str, port: int, size: int, timeout: float,
                   workers: list[subprocess.Popen]) -> dist.Store:
    """init_process_group as rank 0, on a thread, so a worker that dies while starting is reported at once."""
    error: list[BaseException] = []
    stores: list[dist.Store] = []

    def init() -> None:
        try:
            stores.append(dist.TCPStore("127.0.0.1", port, size, is_master=True,
                                        timeout=timedelta(seconds=START_TIMEOUT_S)))
            dist.init_process_group(backend, store=stores[0], rank=0, world_size=size,
                                    timeout=timedelta(seconds=timeout))
        except BaseException as e:  # noqa: BLE001 - re-raised by the caller's thread
            error.append(e)

    thread = threading.Thread(target=init, name="nexttoken-tp-init", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.1)
        for rank, proc in enumerate(workers, start=1):
            if proc.poll() is not None:
                raise TensorParallelError(
                    f"rank {rank} exited with code {proc.returncode} while starting (its error is printed above)")
    if error:
        raise TensorParallelError(f"the ranks could not form a process group: {error[0]}") from error[0]
    return stores[0]


def _join_torchrun(path: Path, size: int, dtype, device, quantize, timeout: float, on_failure):  # noqa: ANN001, ANN202
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != size:
        raise ModelLoadError(
            f"torchrun started {world} ranks but tensor_parallel_size is {size}: give the same number to both")
    device = _device(device, int(os.environ.get("LOCAL_RANK", 0)))
    backend = backend_for(device)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
    ranks = RankGroup(rank, world, device=device)
    model = _load_shard(path, ranks, dtype, device, quantize)
    if rank == 0:
        model.cluster = Cluster(ranks, timeout, None, on_failure)
        return model
    _worker(model)  # exits the process


def _worker(model) -> None:  # noqa: ANN001
    """Serve steps until rank 0 stops; exit code 0 when told to stop, 1 (with the reason) when rank 0 is gone."""
    try:
        serve_worker(model)
    except TensorParallelError as e:
        print(f"nexttoken: {e}", file=sys.stderr, flush=True)
        os._exit(1)  # the process group cannot be torn down cleanly without its peers
    if dist.is_initialized():
        dist.destroy_process_group()
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> None:
    """A locally spawned worker rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment)."""
    # At exit, freeze the heap rather than collect it (as cli.exit_without_collecting): the last collection walks
    # all of torch's objects, ~0.3 s idle and seconds on a busy machine, while rank 0's close() waits for this exit
    atexit.register(gc.freeze)
    p = argparse.ArgumentParser(prog="python -m nexttoken.engine.launch")
    p.add_argument("--model", required=True)
    p.add_argument("--dtype")
    p.add_argument("--device")
    p.add_argument("--quantize")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S)
    p.add_argument("--threads", type=int)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = _device(args.device, int(os.environ.get("LOCAL_RANK", rank)))
    store = _store(rank, world)
    dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=args.timeout))
    ranks = RankGroup(rank, world, device=device)
    model = _load_shard(Path(args.model), ranks, args.dtype, device, args.quantize, store)
    _worker(model)


if __name__ == "__main__":
    main()
