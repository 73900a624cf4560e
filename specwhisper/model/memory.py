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
