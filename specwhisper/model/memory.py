"""CPU buffers in 2 MB pages: the tensors a decode step streams (weights, heads, KV caches).

torch's CPU allocator, with `THP_MEM_ALLOC_ENABLE=1` (set by `import specwhisper`), advises large
buffers into transparent huge pages, but it does not align them to 2 MB and glibc hands back memory
already faulted in 4 KB pages: in a loaded base + base-2l engine, base-2l's 4-bit head sat 48% in
huge pages, its cross-attention K/V 40% and 89%, a self-attention V cache 0%, and the first layer
of base's float16 projections 9 of 384 pages (`/proc/self/pagemap` read against
`/proc/kpageflags`). `huge_zeros` maps fresh private anonymous memory instead, 2 MB aligned and
advised before the first touch, so every whole 2 MB of it is faulted in as one huge page; its pages
cost nothing until written (a runner's 8-slot caches are ~400 MB, one request touches a slot's
share). The values are zeros, as `torch.zeros`'.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import os

import torch

HUGE_PAGE = 2 << 20


def huge_pages_wanted() -> bool:
    """Whether buffers go to 2 MB-aligned huge-page mappings: Linux's `madvise` is there and
    `THP_MEM_ALLOC_ENABLE=0` (the opt-out of huge pages) is not set."""
    return hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get("THP_MEM_ALLOC_ENABLE", "1") != "0"


def huge_zeros(shape, dtype: torch.dtype) -> torch.Tensor:
    """`torch.zeros(shape, dtype=dtype)` on the CPU, in its own 2 MB-aligned mapping advised into
    huge pages when it is at least 2 MB (smaller ones, or without huge pages: `torch.zeros`)."""
    shape = tuple(shape)
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE or not huge_pages_wanted():
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without transparent huge pages: plain (still zero, still lazy) pages
        pass
    raw = torch.frombuffer(region, dtype=torch.uint8)  # holds `region` alive; unmapped with it
    start = -raw.data_ptr() % HUGE_PAGE
    return raw[start:start + nbytes].view(dtype).view(shape)


def huge_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of CPU tensor `t` in a `huge_zeros` buffer (the same values)."""
    out = huge_zeros(t.shape, t.dtype)
    out.copy_(t)
    return out


# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = 1 << 30


@functools.cache
def keep_freed_memory() -> bool:
    """Let glibc's malloc serve allocations up to 32 MB from its heap and keep what is freed there
    (`mallopt`: a fixed mmap threshold of 32 MB, a trim threshold of 1 GB) -> whether it applied
    (glibc only, once per process; `SPECWHISPER_MALLOC_TUNING=0` leaves malloc alone).

    The CPU encoder's products return fresh tensors (oneDNN's fused inner products have no `out=`):
    a window's fc1 output is 12 MB, its q/k/v 9 MB. With torch's huge-page allocation on (2 MB
    aligned blocks, `THP_MEM_ALLOC_ENABLE=1`, as `import specwhisper` sets it) glibc mapped every
    such block anew, so each product first faulted in and zeroed fresh memory (≈ 520 page faults a
    12 MB tensor, 0.2 with the memory kept; tests/test_memory.py): whisper-base's q/k/v product ran
    at 184 GFLOP/s and fc1's at 195 against 224-226 with the memory kept (2 threads of a Zen 4
    EPYC, FMA peak 229), the whole encoder 0.444-0.470 -> 0.429-0.431 s a window (alternated
    processes), target-only calls 2% faster. The price: a process keeps up to `TRIM_THRESHOLD` of
    freed heap resident instead of returning it (base + base-2l after three calls: 1309 against
    1293 MB; blocks above 32 MB are still mapped and unmapped on their own)."""
    if os.environ.get("SPECWHISPER_MALLOC_TUNING", "1").strip().lower() in ("0", "off", "no", "false"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # glibc: other C libraries (musl) have other knobs
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
