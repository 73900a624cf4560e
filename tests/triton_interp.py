"""Triton kernels run on CPU tensors: a kernel source loaded afresh with TRITON_INTERPRET=1."""
from __future__ import annotations

import contextlib
import importlib.util
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Before anything imports Triton: without a GPU its kernels run in the interpreter. (With a GPU
    # the CUDA tests need compiled kernels; the CPU cases load an interpreted copy, `Interpreted`.)
    os.environ.setdefault("TRITON_INTERPRET", "1")

KERNELS = Path(__file__).resolve().parent.parent / "specwhisper" / "kernels"


def _language_namespaces() -> list:
    """The objects whose attributes Triton's interpreter patches while it runs a kernel: the
    language modules and their classes (tensor, dtypes, ...)."""
    import triton.language as tl
    import triton.language.standard as standard

    return [tl, tl.core, tl.math, standard] + [v for v in vars(tl.core).values() if isinstance(v, type)]


# Their attributes before any kernel runs (test modules import this one at collection). An
# interpreted kernel that calls one of Triton's @jit helpers (tl.sum, tl.max, ...) patches the
# language again for that call and never restores it (InterpretedFunction.__call__), which breaks
# later compilations in the process: `CompiledForGpu.compiling` puts these values back meanwhile.
try:
    _PRISTINE = [(ns, dict(vars(ns))) for ns in _language_namespaces()]
except ImportError:  # no Triton: nothing compiles or runs interpreted
    _PRISTINE = []

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not importable")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def on_cuda(test):
    """A test of the compiled kernels on a CUDA device: marked `cuda` (bench/gpu_suite.sh runs
    `pytest -m cuda`), skipped without a device or Triton."""
    return pytest.mark.cuda(needs_cuda(needs_triton(test)))


@contextlib.contextmanager
def interpreted_stdlib():
    """Triton's own @jit helpers (tl.max, tl.sum, ...) as interpreted functions. They were built
    when Triton was first imported: if that happened before TRITON_INTERPRET was set (torch._dynamo
    imports Triton, e.g. via transformers in another test module), they are compiled-mode objects
    the interpreter cannot call. Patched only for the duration of a call, so CUDA tests in the same
    session still compile the real ones."""
    import triton.language as tl
    import triton.language.standard as standard
    from triton.runtime.interpreter import InterpretedFunction, InterpreterBuilder
    from triton.runtime.jit import JITFunction

    saved = [(ns, name, obj) for ns in (tl, standard) for name, obj in vars(ns).items()
             if isinstance(obj, JITFunction)]
    for ns, name, obj in saved:
        setattr(ns, name, InterpretedFunction(obj.fn))
    saved.append((InterpreterBuilder, "create_dot", InterpreterBuilder.create_dot))
    InterpreterBuilder.create_dot = row_dot(InterpreterBuilder.create_dot)
    try:
        yield
    finally:
        for ns, name, obj in saved:
            setattr(ns, name, obj)


def row_dot(create_dot):
    """The interpreter's tl.dot with each row of `a` multiplied on its own. The interpreter computes
    a tile's dot as one numpy matrix product, and numpy's BLAS may round a row by where it sits in
    the tile: OpenBLAS's Haswell kernels (an AVX2-only EPYC) gave 10 of 16 rows other bits when
    moved to row 0, so a 5-token verify pass differed from 5 one-token steps in the last bit,
    where AVX-512 machines' kernels did not. What the interpreted tests check is the kernels' own
    arithmetic (masks, chunks, the order of their combines), so each row is one vector-matrix
    product here, the same whatever the other rows hold (tests/test_decode_ops.py)."""
    import numpy as np
    from triton.runtime.interpreter import TensorHandle

    def dot(self, a, b, d, *args, **kwargs):
        if any(t.dtype.primitive_bitwidth == 8 and t.dtype.is_floating() for t in (a, b)):
            return create_dot(self, a, b, d, *args, **kwargs)  # fp8, which it widens first
        # [.., rows, K] @ [.., K, N] as a stack of one-row products ([.., rows, 1, K] @ [.., 1, K, N])
        rows = np.matmul(a.data[..., None, :], b.data[..., None, :, :], dtype=d.data.dtype)[..., 0, :]
        return TensorHandle(rows + d.data, d.dtype.scalar)
    return dot


class Interpreted:
    """specwhisper/kernels/<name>.py loaded afresh with TRITON_INTERPRET=1: runs on CPU tensors."""

    def __init__(self, name: str = "spec_sample"):
        previous = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"  # read when the @triton.jit decorators run
        try:
            spec = importlib.util.spec_from_file_location(f"{name}_interpreted", KERNELS / f"{name}.py")
            self.module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(self.module)
        finally:
            if previous is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = previous

    def __getattr__(self, name):
        launcher = getattr(self.module, name)

        def call(*args, **kwargs):
            with interpreted_stdlib():
                return launcher(*args, **kwargs)

        return call


class CompiledForGpu:
    """specwhisper/kernels/<name>.py loaded afresh as Triton kernels (not interpreted) whose launches, while
    `compiling()` is active, compile for a Hopper GPU (sm_90, ptxas included) instead of running:
    what a GPU's compiler rejects (the interpreter runs code no compiler accepts, e.g. an if/else
    that binds one name to two dtypes) is found on a machine without one. The launchers' outputs
    are left unwritten. `compiled` lists (kernel, signature, constants) of each compilation."""

    TARGET = ("cuda", 90, 32)

    def __init__(self, name: str | Path):
        path = Path(name) if isinstance(name, Path) else KERNELS / f"{name}.py"
        previous = os.environ.pop("TRITON_INTERPRET", None)
        try:
            spec = importlib.util.spec_from_file_location(f"{path.stem}_compiled", path)
            self.module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(self.module)
        finally:
            if previous is not None:
                os.environ["TRITON_INTERPRET"] = previous
        self.compiled: list[tuple[str, dict, dict]] = []

    @contextlib.contextmanager
    def compiling(self):
        import triton
        import triton.language as tl
        import triton.language.standard as standard
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        # the language as it was before any interpreted kernel left its patches (see _PRISTINE)
        leaked = [(ns, name, vars(ns).get(name, _MISSING), pristine.get(name, _MISSING))
                  for ns, pristine in _PRISTINE for name in set(vars(ns)) | set(pristine)
                  if vars(ns).get(name, _MISSING) is not pristine.get(name, _MISSING)]
        for ns, name, _, original in leaked:
            _put(ns, name, original)
        # Triton's own helpers as compiled-mode functions (interpreted ones if Triton was first
        # imported with TRITON_INTERPRET set, as on a machine without a GPU)
        saved = [(ns, name, obj) for ns in (tl, standard) for name, obj in vars(ns).items()
                 if isinstance(obj, InterpretedFunction)]
        for ns, name, obj in saved:
            setattr(ns, name, JITFunction(obj.fn))
        option_names = {"num_warps", "num_stages", "num_ctas", "enable_fp_fusion", "maxnreg"}
        done = self.compiled

        def run(kernel, *args, grid, warmup, **kwargs):
            options = {k: kwargs.pop(k) for k in list(kwargs) if k in option_names}
            values = dict(zip([p.name for p in kernel.params], args)) | kwargs
            signature, constants = {}, {}
            for p in kernel.params:
                value = values[p.name]
                if p.is_constexpr:
                    signature[p.name], constants[p.name] = "constexpr", value
                elif isinstance(value, torch.Tensor):
                    signature[p.name] = "*" + _TRITON_DTYPES[value.dtype]
                elif isinstance(value, bool):
                    signature[p.name] = "i1"
                elif isinstance(value, int):
                    signature[p.name] = "i32" if -2**31 <= value < 2**31 else "i64"
                elif isinstance(value, float):
                    signature[p.name] = "fp32"
                else:
                    raise TypeError(f"{kernel.fn.__name__}: argument {p.name} = {value!r}")
            entry = (kernel.fn.__name__, signature, dict(constants, **options))
            if entry not in done:
                triton.compile(ASTSource(kernel, signature, constexprs=constants),
                               target=GPUTarget(*self.TARGET), options=options)
                done.append(entry)

        saved_run = JITFunction.run
        JITFunction.run = run
        try:
            yield self.module
        finally:
            JITFunction.run = saved_run
            for ns, name, obj in saved:
                setattr(ns, name, obj)
            for ns, name, current, _ in leaked:
                _put(ns, name, current)


_MISSING = object()


def _put(ns, name: str, value) -> None:
    if value is _MISSING:
        if name in vars(ns):
            delattr(ns, name)
    else:
        setattr(ns, name, value)


_TRITON_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
                  torch.int64: "i64", torch.int32: "i32", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1"}
