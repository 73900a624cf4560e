"""Device backends: every device-dependent decision of the engine in one object per device
(`base.Backend` is the interface; `cpu.py`, `cuda.py`). `backend_for(device)` picks one. Beside
them, the ops they run: `ops.py` (sampling ops: Triton, C++ or the reference) and `cpu_ops.py`
(the C++ decoder-step ops)."""
from __future__ import annotations

import functools

import torch

from . import cpu_ops
from .base import Backend
from .cpu import CpuBackend
from .cuda import CudaBackend

cpu_ops.strict_mkl()  # before any MKL computation: thread-count independent GEMMs (see there)

__all__ = ["Backend", "CpuBackend", "CudaBackend", "backend_for", "default_device"]


def default_device() -> torch.device:
    """Engine(device=None): CUDA when available, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@functools.cache
def _backend(device: torch.device) -> Backend:
    kinds = {"cpu": CpuBackend, "cuda": CudaBackend}
    return kinds.get(device.type, Backend)(device)


def backend_for(device) -> Backend:
    """The backend of `device` (a torch.device or its name); other device types get the plain
    `Backend` (no tuning of its own)."""
    return _backend(torch.device(device))
