"""What a device decides, as one object: `Backend` is the interface and the policy of a device
with no tuning of its own; `cpu.CpuBackend` and `cuda.CudaBackend` override what their device
does differently. The engine, the loader, the drafter, the runner and the speculation controller
ask their backend instead of testing the device type; the kernels keep their own dispatch
(`ops.py`, `cpu_ops.py`)."""
from __future__ import annotations

import time

import torch

from ..engine.graphs import StepGraphs
from ..model.weights import load_whisper
from . import cpu_ops


class Backend:
    name = "generic"
    default_dtype = torch.float32  # Engine(dtype=None)
    cuda_graphs = False  # Engine(cuda_graphs=None): the graph-shaped path
    captures_graphs = False  # the graph-shaped steps are captured (else they run eagerly)
    # trim each eager step's attended width to the longest row and feed only the draft's
    # uncached tokens (host reads of the lengths; worth it where a host read costs nothing)
    trim_width = False
    # windows per encoder call, zero-padded to this shape: a window's features then never depend
    # on its neighbours (a batched GEMM may round a row differently beside other rows)
    encoder_batch = 1
    calibrates = False  # the adaptive k measures pass costs before its first decision (else priors)

    def __init__(self, device: torch.device):
        self.device = device

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.device})"

    # ---------------------------------------------------------------- loading
    def load_whisper(self, path, dtype: torch.dtype):
        """A checkpoint's model on this device, its weights in `dtype`."""
        return load_whisper(path, device=self.device, dtype=dtype)

    def screens_head(self, dtype: torch.dtype) -> bool:
        """Whether greedy decoding reads an output head of `dtype` through an int8 screen
        (`head.ScreenedHead`: exact, a quarter of float32's bytes)."""
        return False

    def fuses_decode_ops(self, dtype: torch.dtype) -> bool:
        """Engine(decode_ops=None): whether the decoders run on the Triton decode ops
        (`Whisper.fuse_decode_ops`), whose rows round independently of the pass's shape."""
        return False

    # ---------------------------------------------------------------- drafts
    def compacts_drafts(self, dtype: torch.dtype) -> bool:
        """Engine(compact_draft=None): whether a draft (not a self draft) of `dtype` is compacted."""
        return False

    def compact_draft(self, model, own_encoder: bool) -> None:
        """Compact a draft model: its decoder's projections in bfloat16, read as int8 copies by its
        C++ step, and, for a draft with its own encoder, its encoder in bfloat16 on a CPU with
        AMX (`cpu_ops.bf16_draft_encoder`), else its projections in int8 (`model.whisper.Whisper.compact_*`,
        `int8_encoder`: the decoder's cross K/V projections too), its layers attending within
        3-second blocks (`local_encoder`; the last layer too with int8 projections, where that pass
        costs most) over one position per 40 ms (`pool_encoder`). A draft only proposes: the output
        stays exact."""
        model.compact_decoder()
        model.int8_projections()  # what its C++ step reads: a quarter of float32's bytes
        if own_encoder:  # its own encoder pass: the largest part of its cost
            if cpu_ops.bf16_draft_encoder():
                model.compact_encoder()
                model.local_encoder()  # attention within 3 s blocks: a tenth of that pass's largest part
            else:
                # no AMX (an AVX2 CPU, or AVX512-BF16 alone): int8 projections instead, and every layer
                # local (tiny.en held to AVX2: 123 -> 103 ms a window, demo acceptance 0.869 -> 0.868;
                # the demo then drafts, 1.07-1.11x, where before the controller kept it off)
                model.local_encoder(last=model.int8_encoder())
            model.pool_encoder()  # its layers on one position per 40 ms: half their work and its cross K/V

    def draft_cross_dtype(self, decoder, dtype: torch.dtype) -> torch.dtype | None:
        """The dtype of a draft decoder's cross-attention K/V cache (None: `dtype`)."""
        return None

    def draft_cross_pool(self, decoder, dtype: torch.dtype) -> int:
        """How many adjacent audio positions a draft decoder's cross-attention K/V are averaged
        over (`drafting.DraftSide`; 1: all 1500 kept)."""
        return 1

    # ---------------------------------------------------------------- steps
    def step_graphs(self, enabled: bool | None):
        """The runner's `graphs` (`graphs.StepGraphs`) for Engine(cuda_graphs=enabled), or None
        (the unpadded eager path). Where graphs are not captured, the graph-shaped path runs
        eagerly, rehearsing a capture's warm-up (and its rewind)."""
        if enabled is None:
            enabled = self.cuda_graphs
        if not isinstance(enabled, bool):
            raise TypeError(f"cuda_graphs must be None or a bool, got {enabled!r}")
        return StepGraphs(True, self.device, rehearse=not self.captures_graphs) if enabled else None

    # ---------------------------------------------------------------- clocks
    def clock(self) -> WallClock:
        """A clock for the parts of one iteration (`speculation.Speculation`)."""
        return WallClock()

    def synchronize(self) -> None:
        """Wait for the work queued on this device (before reading a wall clock)."""


class WallClock:
    """Times the parts of an iteration with the host's clock (the work is done when issued)."""

    def __init__(self):
        self.marks = [time.perf_counter()]

    def mark(self) -> None:
        self.marks.append(time.perf_counter())

    def intervals(self) -> list[float]:
        return [b - a for a, b in zip(self.marks, self.marks[1:])]
