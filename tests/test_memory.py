"""`model.memory`: CPU buffers in their own 2 MB-aligned huge-page mappings, equal to torch.zeros."""
import gc
from pathlib import Path

import pytest
import torch

from specwhisper.model import memory
from specwhisper.model.head import Q4Head, ScreenedHead
from specwhisper.model.whisper import DecoderCache, one_buffer

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def mapping_of(ptr: int) -> tuple[int, int, int] | None:
    """(start, end, AnonHugePages kB) of this process's mapping that holds address `ptr`."""
    found = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and not head[0].endswith(":"):
            start, end = (int(x, 16) for x in head[0].split("-"))
            found = [start, end, 0] if start <= ptr < end else None
        elif found is not None and head[0] == "AnonHugePages:":
            return found[0], found[1], int(head[1])
    return None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.uint8])
def test_huge_zeros_equals_torch_zeros(dtype):
    for shape in [(3, 5), (2, 3, 1500, 64), (1 << 20,)]:
        t = memory.huge_zeros(shape, dtype)
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"
        assert torch.equal(t, torch.zeros(shape, dtype=dtype))
        t.fill_(1)  # writable, the whole of it
        assert bool((t == 1).all())


@pytest.mark.skipif(not memory.huge_pages_wanted(), reason="no madvise here, or THP_MEM_ALLOC_ENABLE=0")
def test_large_buffers_are_aligned_mapped_alone_and_released():
    t = memory.huge_zeros((3, 1 << 20), torch.float32)  # 12 MB
    assert t.data_ptr() % memory.HUGE_PAGE == 0
    start, end, _ = mapping_of(t.data_ptr())
    assert end - start >= t.numel() * 4 and end - start <= t.numel() * 4 + memory.HUGE_PAGE + 4096
    t.fill_(2.0)
    if THP.exists() and "[never]" not in THP.read_text():
        # advised before its first touch: whole 2 MB spans fault in as huge pages
        assert mapping_of(t.data_ptr())[2] >= 2048
    ptr = t.data_ptr()
    del t
    gc.collect()
    assert mapping_of(ptr) is None or mapping_of(ptr)[:2] != (start, end)  # unmapped with its tensor


def test_small_buffers_and_the_opt_out_use_torch(monkeypatch):
    small = memory.huge_zeros((100,), torch.float32)
    assert torch.equal(small, torch.zeros(100))
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    assert not memory.huge_pages_wanted()
    big = memory.huge_zeros((1 << 20,), torch.float32)
    assert torch.equal(big, torch.zeros(1 << 20)) and mapping_of(big.data_ptr()) is not None


def test_huge_copy_keeps_values_and_layout():
    src = torch.randn(8, 3, 1 << 16)[:, 1]  # a strided view, 2 MB
    out = memory.huge_copy(src)
    assert out.is_contiguous() and torch.equal(out, src)
    src.add_(1)
    assert not torch.equal(out, src)  # a copy, not a view


def test_step_buffers_heads_and_caches_hold_the_same_values():
    from specwhisper.config import WhisperConfig

    cfg = WhisperConfig(vocab_size=51865, d_model=64, encoder_layers=1, decoder_layers=2, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=80,
                        max_source_positions=1500, max_target_positions=448)
    cache = DecoderCache.allocate(cfg, 3, "cpu", torch.float32, torch.bfloat16)
    for t in cache.buffers():
        assert not t.any()
    assert cache.cross_k.dtype == torch.bfloat16 and cache.self_k.shape == (2, 3, 2, 449, 32)
    tensors = [torch.randn(700, 1000), torch.randn(3), torch.randn(2000, 600).half()]
    for copy, t in zip(one_buffer(tensors), tensors):
        assert copy.dtype == t.dtype and torch.equal(copy, t)
    w = torch.randn(5000, 512)
    torch.manual_seed(0)
    h = torch.randn(3, 512)
    assert torch.equal(ScreenedHead(w).argmax(h), (h @ w.T).argmax(-1))
    q4 = Q4Head(w)
    assert q4.packed.is_contiguous() and q4.packed.shape == (625, 16, 8, 16)


FAULTS = """
import resource, sys
import specwhisper, torch
from specwhisper.model import memory
applied = memory.keep_freed_memory()
torch.ones(3 << 20)  # 12 MB, a window's fc1 output in base's encoder
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(50):
    torch.ones(3 << 20).add_(1)
print(applied, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 50)
"""


def faults_per_tensor(env: dict) -> tuple[bool, float]:
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", FAULTS], env={**os.environ, **env}, capture_output=True,
                         text=True, check=True).stdout.split()
    return out[0] == "True", float(out[1])


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="Linux (glibc) only")
def test_freed_memory_is_kept_so_fresh_tensors_fault_no_pages():
    """With `keep_freed_memory` a fresh 12 MB tensor reuses heap already faulted in; without it
    (torch's huge-page allocation on, as `import specwhisper` sets it) each one faulted ~520 pages
    here (a tensor in fresh 4 KB pages: 3072). SPECWHISPER_MALLOC_TUNING=0 leaves malloc alone.
    A few faults a tensor remain in a busy process (11 in a whole test run: other threads' stacks
    and buffers), far from a fresh tensor's."""
    applied, kept = faults_per_tensor({})
    left_alone, default = faults_per_tensor({"SPECWHISPER_MALLOC_TUNING": "0"})
    assert applied and not left_alone
    assert kept < 50, kept
    if default >= 100:  # where glibc's own thresholds fault fresh pages (they may not, without huge pages)
        assert kept * 10 < default, (kept, default)
