"""The GPU's decisions: float16 by default, the decoders on the Triton decode ops in half
precision, the graph-shaped steps captured as CUDA graphs (no host read inside a step, so no
trimming), windows encoded four at a time, iterations timed with
CUDA events (read after the iteration's one host read), the adaptive k from its priors."""
from __future__ import annotations

import torch

from .base import Backend


class CudaBackend(Backend):
    name = "cuda"
    default_dtype = torch.float16
    cuda_graphs = True
    captures_graphs = True
    trim_width = False  # a host read is a sync: fixed shapes instead
    encoder_batch = 4  # always this shape (padded): one window's features never depend on the others
    calibrates = False

    def fuses_decode_ops(self, dtype: torch.dtype) -> bool:
        # half precision: torch's kernels round a row by the pass's shape, so a verify pass can flip
        # a near tie that a one-token step does not; the decode ops make it token-exact (README, GPU)
        return dtype in (torch.float16, torch.bfloat16)

    def clock(self) -> EventClock:
        return EventClock()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


class EventClock:
    """Times the parts of an iteration with CUDA events, read after the iteration's one host
    sync (so timing adds none)."""

    def __init__(self):
        self.marks = [self._now()]

    @staticmethod
    def _now() -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def mark(self) -> None:
        self.marks.append(self._now())

    def intervals(self) -> list[float]:
        self.marks[-1].synchronize()
        return [a.elapsed_time(b) / 1000 for a, b in zip(self.marks, self.marks[1:])]
