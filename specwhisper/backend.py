"""Probe the hardware once and dispatch the speculative-sampling step to the fastest exact backend.

- CUDA tensors: the fused Triton kernel (`kernels/spec_sample.py`).
- CPU tensors: the C++ op `specwhisper::speculative_sample_noise` (`csrc/spec_sample.cpp`), built
  just in time with ninja on first use into ~/.cache/specwhisper/build (or $SPECWHISPER_BUILD_DIR).
  $SPECWHISPER_NO_EXT=1 turns it off.
- Otherwise, or when a backend cannot be loaded (announced by one warning), the reference
  `specwhisper.sampling.speculative_sample_core`.
All three give the same tokens bit for bit, so the choice only changes speed. Probes are cached
with functools.cache: the only module-level state. Nothing here imports a GPU-only package.
"""
from __future__ import annotations

import functools
import importlib
import importlib.resources
import importlib.util
import os
import sys
import warnings
from pathlib import Path
from types import ModuleType
from typing import Callable, Literal

import torch

from specwhisper import sampling

Backend = Literal["triton", "cpp", "reference"]

_REPO_ROOT = Path(__file__).resolve().parent.parent
_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def which_backend(device: torch.device | str) -> Backend:
    """The implementation `speculative_sample_noise` uses for tensors on `device`."""
    device = torch.device(device)
    if device.type == "cuda" and triton_kernels() is not None:
        return "triton"
    if device.type == "cpu" and cpp_op() is not None:
        return "cpp"
    return "reference"


def speculative_sample_noise(target_logits: torch.Tensor, draft_logits: torch.Tensor,
                             draft_tokens: torch.Tensor, temperature: float, top_p: float,
                             uniforms: torch.Tensor, exp_noise: torch.Tensor):
    """`sampling.speculative_sample_noise` on the fastest backend for the tensors' device
    (arguments are assumed checked, as `sampling.speculative_sample` does; no host sync)."""
    args = (target_logits, draft_logits, draft_tokens, temperature, top_p, uniforms, exp_noise)
    backend = which_backend(target_logits.device)
    if backend == "triton" and target_logits.dtype in _TRITON_DTYPES \
            and draft_logits.dtype in _TRITON_DTYPES:
        contiguous = [a.contiguous() if isinstance(a, torch.Tensor) else a for a in args]
        return triton_kernels().speculative_sample_triton(*contiguous)
    if backend == "cpp":
        return cpp_op()(*args)
    return sampling.speculative_sample_core(*args)


@functools.cache
def triton_kernels() -> ModuleType | None:
    """The Triton kernel module, or None (with one warning) if Triton cannot be imported."""
    try:
        return _import_kernels("spec_sample")
    except Exception as exc:  # ImportError, or a Triton that fails to initialise
        warnings.warn(f"specwhisper: Triton kernels unavailable ({exc!r}); CUDA tensors use the "
                      "PyTorch reference sampler", RuntimeWarning, stacklevel=3)
        return None


def _import_kernels(name: str) -> ModuleType:
    """`specwhisper.kernels.<name>` when installed, else `<repo>/kernels/<name>.py` from a checkout."""
    try:
        return importlib.import_module(f"specwhisper.kernels.{name}")
    except ModuleNotFoundError:
        path = _REPO_ROOT / "kernels" / f"{name}.py"
        if not path.is_file():
            raise
    module_name = f"specwhisper_kernels_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


@functools.cache
def cpp_op() -> Callable | None:
    """torch.ops.specwhisper.speculative_sample_noise, built on first use; None if disabled by
    SPECWHISPER_NO_EXT=1 or if the build fails (then with one warning)."""
    if os.environ.get("SPECWHISPER_NO_EXT", "") not in ("", "0"):
        return None
    if not _op_registered():
        try:
            _build_cpp_extension()
        except Exception as exc:
            warnings.warn(f"specwhisper: could not build the C++ sampling op ({exc}); CPU tensors "
                          "use the PyTorch reference sampler (set SPECWHISPER_NO_EXT=1 to skip the "
                          "build)", RuntimeWarning, stacklevel=3)
            return None
    _register_fake()
    return torch.ops.specwhisper.speculative_sample_noise


@functools.cache
def _register_fake() -> None:
    """Shape function of the C++ op, so it traces under torch.compile / FakeTensor."""

    @torch.library.register_fake("specwhisper::speculative_sample_noise")
    def _(target_logits, draft_logits, draft_tokens, temperature, top_p, uniforms, exp_noise):
        B, k1, _ = target_logits.shape
        return (target_logits.new_empty((B, k1), dtype=torch.int64),
                target_logits.new_empty((B,), dtype=torch.int64))


def _op_registered() -> bool:
    try:
        torch.ops.specwhisper.speculative_sample_noise
    except (AttributeError, RuntimeError):
        return False
    return True


def build_dir() -> Path:
    """Where the JIT-built extension lives: $SPECWHISPER_BUILD_DIR, else a per-torch/per-Python
    folder under ~/.cache/specwhisper/build."""
    if os.environ.get("SPECWHISPER_BUILD_DIR"):
        return Path(os.environ["SPECWHISPER_BUILD_DIR"]).expanduser()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    tag = f"torch{torch.__version__.replace('+', '-')}-py{sys.version_info[0]}{sys.version_info[1]}"
    return cache / "specwhisper" / "build" / tag


def _build_cpp_extension() -> None:
    from torch.utils.cpp_extension import load  # imports setuptools machinery: only when needed

    with importlib.resources.as_file(_csrc_dir() / "spec_sample.cpp") as source:
        directory = build_dir()
        directory.mkdir(parents=True, exist_ok=True)
        # -ffp-contract=off: no FMA contraction, so the fp32 exp matches the reference bit for bit;
        # -fno-trapping-math only lets the loops vectorise (it changes no result).
        cflags = ["-O3", "-ffp-contract=off", "-fno-trapping-math", "-fopenmp", "-fopenmp-simd"]
        load(name="specwhisper_C", sources=[str(source)], build_directory=str(directory),
             extra_cflags=cflags, extra_ldflags=["-fopenmp"], is_python_module=False,
             verbose=False)


def _csrc_dir():
    try:
        resources = importlib.resources.files("specwhisper.csrc")
        if (resources / "spec_sample.cpp").is_file():
            return resources
    except (ModuleNotFoundError, TypeError):
        pass
    return _REPO_ROOT / "csrc"
