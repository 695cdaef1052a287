"""Where a model's weights live in CPU memory: one arena on transparent huge pages (2 MiB).

A decode step streams every weight once, and with 4 KiB pages it crosses a page boundary every 4 KiB: a TLB
miss, and a point where the hardware prefetcher stops. On 2 MiB pages a 440 MB float32 matrix-vector product
streamed 9% faster on the 2-core test machine (35.8 vs 32.8 GB/s, same run). Linux hands out huge pages for
memory advised with MADV_HUGEPAGE (the default "madvise" mode of transparent huge pages), so the loader copies
the checkpoint's tensors straight into one such arena instead of into separate allocations. Where that is not
available (another OS, THP disabled, a small model) the tensors get ordinary memory, with the same values.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os

import torch
from torch import nn

HUGE_PAGE = 2 << 20
ALIGN = 64  # bytes: every tensor starts on a cache line, as torch's own allocator does


def huge_page_arena(nbytes: int) -> torch.Tensor | None:
    """A zeroed uint8 CPU tensor of `nbytes` on huge-page-advised memory, 2 MiB aligned; None where unsupported.

    The memory is an anonymous mapping owned by the tensor (and every view of it): it is unmapped when the last
    one is freed."""
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    try:
        mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError, AttributeError):
        return None
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps `mapping` alive
    start = (-raw.data_ptr()) % HUGE_PAGE
    return raw[start : start + nbytes]


def _padded(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def copy_into_arena(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Copies of CPU tensors (cast to `dtype` when given) packed into one huge-page arena. `tensors` is updated
    as it goes, so each source can be freed as soon as its copy exists (fused temporaries never pile up). Names
    that share a tensor (tied weights) share the copy. Without an arena: plain copies, `tensor.to(dtype)`."""
    first: dict[int, str] = {}
    owner = {name: first.setdefault(id(t), name) for name, t in tensors.items()}  # ids are unique while all live
    sizes = {name: t.numel() * (dtype or t.dtype).itemsize for name, t in tensors.items() if owner[name] == name}
    arena = huge_page_arena(sum(_padded(n) for n in sizes.values()))
    offset = 0
    for name in list(tensors):
        if owner[name] != name:
            tensors[name] = tensors[owner[name]]  # already copied: the owner comes first
            continue
        source, target = tensors[name], dtype or tensors[name].dtype
        if arena is None:
            tensors[name] = source.to(dtype=target, copy=True)
        else:
            tensors[name] = arena[offset : offset + sizes[name]].view(target).view(source.shape).copy_(source)
            offset += _padded(sizes[name])
        del source
    return tensors


def empty_in_arena(specs: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, torch.Tensor]:
    """Uninitialised CPU tensors of the given (shape, dtype) by name, packed into one huge-page arena (plain
    allocations where there is none): the slots a loader reads the checkpoint's bytes straight into."""
    sizes = {name: math.prod(shape) * dtype.itemsize for name, (shape, dtype) in specs.items()}
    arena = huge_page_arena(sum(_padded(n) for n in sizes.values()))
    out, offset = {}, 0
    for name, (shape, dtype) in specs.items():
        if arena is None:
            out[name] = torch.empty(shape, dtype=dtype)
        else:
            out[name] = arena[offset : offset + sizes[name]].view(dtype).view(shape)
            offset += _padded(sizes[name])
    return out


@torch.no_grad()
def repack(module: nn.Module) -> None:
    """Move every CPU parameter and buffer of `module` into one huge-page arena, in place (e.g. after int8
    quantization replaced the weights). A Parameter keeps its identity (its .data moves), so ties survive."""
    slots = [(m, kind, name) for m in module.modules() for kind in ("_parameters", "_buffers")
             for name, t in getattr(m, kind).items() if t is not None and t.device.type == "cpu"]
    tensors = {str(i): getattr(m, kind)[name] for i, (m, kind, name) in enumerate(slots)}
    originals = dict(tensors)
    packed = copy_into_arena(tensors)  # a tied Parameter is one object in two slots: copied once
    for (m, kind, name), key in zip(slots, packed):
        old = originals[key]
        if isinstance(old, nn.Parameter):
            old.data = packed[key]
        else:
            getattr(m, kind)[name] = packed[key]


def release_freed_memory() -> None:
    """Hand memory freed by loading (unfused checkpoint tensors) back to the OS.

    glibc keeps large freed blocks in its heap, so without this the process stays at ~2x the weights' size.
    """
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zeroed tensor whose CPU memory is committed page by page as it is first written (an anonymous mapping:
    the kernel hands out zero pages on first touch), so a large KV pool holds only the memory of the tokens written
    into it. torch.zeros would write every page at once. Other devices: torch.zeros."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = max(1, dtype.itemsize * int(torch.Size(shape).numel()))
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mapping, dtype=torch.uint8).view(dtype).view(shape)  # keeps `mapping` alive


def discard_pages(t: torch.Tensor, start: int, end: int) -> None:
    """Give the kernel back the pages wholly inside bytes [start, end) of CPU tensor `t`'s memory (an anonymous
    private mapping, `lazy_zeros`): madvise(MADV_DONTNEED), after which they read as zeros and cost nothing until
    written again. Pages shared with bytes outside the range are kept; a no-op off Linux."""
    advise = getattr(_libc(), "madvise", None)
    if advise is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    page = mmap.PAGESIZE
    first = (t.data_ptr() + start + page - 1) // page * page
    last = (t.data_ptr() + end) // page * page
    if last > first:
        advise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), mmap.MADV_DONTNEED)


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def available_memory(device: torch.device | str) -> int:
    """Bytes this process can still allocate on `device` without swapping or failing: the kernel's MemAvailable
    on CPU (cgroup limits included when they are lower), the free memory of a CUDA device."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    available = _meminfo_available()
    limit = _cgroup_room()
    return min(available, limit) if limit is not None else available


def _meminfo_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _cgroup_room() -> int | None:
    """What a cgroup v2 memory limit leaves (limit - current), or None without one."""
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open("/sys/fs/cgroup/memory.current") as f:
            return max(0, int(limit) - int(f.read().strip()))
    except (OSError, ValueError):
        return None
