"""The CPU's decisions: float32 by default (a float16 checkpoint's projections read in float16 by
the C++ step, widened exactly), an exact int8-screened greedy head, compact drafts
(bfloat16 / int8 projections read by the C++ decode ops), a bfloat16 model split between decoder
and encoder by what the CPU computes fast, eager steps trimmed to the longest row, one window per
encoder call, and the adaptive k calibrated from measured pass costs."""
from __future__ import annotations

import torch

from . import cpu_ops
from ..constants import CROSS_POOL
from .base import Backend


class CpuBackend(Backend):
    name = "cpu"
    default_dtype = torch.float32
    cuda_graphs = False  # cuda_graphs=True runs the graph-shaped path eagerly (for tests)
    trim_width = True  # measurably faster here, and a host read costs nothing
    encoder_batch = 1  # compute-bound: batching windows gains nothing
    calibrates = True  # pass costs vary by CPU (a verify row adds arithmetic: v(5) ~ 1.3-1.7)

    def load_whisper(self, path, dtype: torch.dtype):
        if dtype == torch.float32:
            model = super().load_whisper(path, dtype)
            # float16 checkpoints (Whisper's): the C++ step reads the projections in float16,
            # widened exactly (the same bits, half the bytes of the decoder blocks). The copies
            # are made at its first call (`Decoder.layer_params`), so a draft whose projections
            # are compacted to int8 or bfloat16 first never makes them (base: 160 ms at load)
            model.decoder.half = cpu_ops.available()
            return model
        if dtype != torch.bfloat16:
            return super().load_whisper(path, dtype)
        model = super().load_whisper(path, torch.float32)
        # the decoder (bandwidth-bound) in bfloat16. The encoder (compute-bound) runs in bfloat16
        # on a CPU with bfloat16 arithmetic (3x faster than float32 here); elsewhere torch's
        # bfloat16 GEMM is ~7x slower than float32, so it stays float32 and returns bfloat16
        # features. Decoding stays exact relative to this model.
        model.decoder.to(torch.bfloat16)
        model.fuse()
        if cpu_ops.native_bf16():
            model.encoder.to(torch.bfloat16)
            model.decoder.native_bf16 = True  # cross K/V from torch's bfloat16 GEMM too
        else:
            model.encoder.features_dtype = torch.bfloat16
        return model

    def screens_head(self, dtype: torch.dtype) -> bool:
        return dtype == torch.float32  # other dtypes read their own head directly

    def compacts_drafts(self, dtype: torch.dtype) -> bool:
        return dtype == torch.float32 and cpu_ops.available()

    def draft_cross_dtype(self, decoder, dtype: torch.dtype) -> torch.dtype | None:
        # a compact draft reads its cross-attention K/V in bfloat16 too (half the bytes per step)
        return torch.bfloat16 if decoder.compact and dtype == torch.float32 else None

    def draft_cross_pool(self, decoder, dtype: torch.dtype) -> int:
        # a compact draft attends over the means of 2 adjacent positions (40 ms of audio): half
        # the cross K/V bytes of its step, a proposal's input only (`draft.pool_positions`)
        return CROSS_POOL if decoder.compact and dtype == torch.float32 else 1
