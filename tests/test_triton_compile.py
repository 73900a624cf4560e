"""Every Triton kernel compiled for a Hopper GPU (sm_90) on a machine without one, at the shapes and
options the engine launches: the interpreted tests run the kernels' arithmetic, but the interpreter
accepts code a GPU's compiler rejects (the race's pick kernel bound one name to a float64 score in
one branch and a float32 logit in the other: it ran interpreted and failed its first GPU run)."""
from __future__ import annotations

from triton_interp import CompiledForGpu, needs_triton  # first: sets TRITON_INTERPRET without a GPU

import pytest  # noqa: E402
import torch  # noqa: E402

pytestmark = needs_triton
# float16 and float32 (bfloat16 takes float16's code paths; each compilation costs seconds in CI)
DTYPES = [torch.float16, torch.float32]


def kernel_names(compiled):
    return {name for name, _, _ in compiled}


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "fp32"])
def test_decode_ops_compile(dtype):
    """Every option of the linear (layer norm, GELU, residual, cache writes; one split, splits
    added by a second kernel or serially) and the attention. float32 (its full-precision products
    compile slowly: 45 s for all of them) takes one linear of each path."""
    ops = CompiledForGpu("decode_ops")
    d, heads, dh = 256, 4, 64
    x = torch.randn(3, d, dtype=dtype)
    ln = (torch.ones(d, dtype=dtype), torch.zeros(d, dtype=dtype), 1e-5)
    one, split, serial = {}, dict(block_k=64, split_k=64, serial=False), dict(block_k=64, split_k=64, serial=True)
    cases = [(3 * d, dict(layer_norm=ln), one), (4 * d, dict(layer_norm=ln, gelu=True), split),
             (d, dict(residual=torch.randn(3, d, dtype=dtype)), serial)]
    if dtype != torch.float32:
        residual = dict(residual=torch.randn(3, d, dtype=dtype))
        cases += [(3 * d, dict(layer_norm=ln), split), (4 * d, dict(layer_norm=ln, gelu=True), one),
                  (4 * d, dict(layer_norm=ln, gelu=True), serial), (d, residual, one),
                  (51866, {}, one), (51866, {}, serial)]
    with ops.compiling() as k:
        for n, opts, tile in cases:
            k.decode_linear(x, torch.randn(n, d, dtype=dtype), torch.randn(n, dtype=dtype), **tile, **opts)
        cache = torch.zeros(1, heads, 10, dh, dtype=dtype)
        k.decode_linear(x, torch.randn(3 * d, d, dtype=dtype), layer_norm=ln,
                        kv_write=(cache, cache.clone(), torch.tensor([[0, 1, 2]])), **serial)
        q = torch.randn(1, heads, 3, dh, dtype=dtype)
        keys, values = (torch.randn(1, heads, 1500, dh, dtype=dtype) for _ in range(2))
        for serial in (False, True):
            k.decode_attention(q, keys, values, torch.full((1, 3), 1500), scale=dh**-0.5, serial=serial)
    assert kernel_names(ops.compiled) == {"_decode_linear_kernel", "_decode_linear_epilogue_kernel",
                                          "_attention_chunk_kernel", "_attention_combine_kernel"}


def test_sampling_kernels_compile():
    """float16 logits (the engine's on a GPU; the kernels widen every dtype to float32 alike)."""
    dtype = torch.float16
    ops = CompiledForGpu("spec_sample")
    B, k, V = 2, 3, 51866
    with ops.compiling() as s:
        for top_p in (1.0, 0.9):
            s.speculative_sample_triton(torch.randn(B, k + 1, V, dtype=dtype), torch.randn(B, k, V, dtype=dtype),
                                        torch.zeros(B, k, dtype=torch.int64), 1.0, top_p,
                                        torch.rand(B, k, dtype=torch.float64), torch.rand(B, V), block_size=2048)
        N = 5
        args = (torch.randn(N, V, dtype=dtype), torch.ones(N), torch.full((N,), 0.9),
                torch.arange(N), torch.zeros(N, dtype=torch.int64))
        for split in (True, False):
            for ids in (None, torch.arange(V)):
                s.race_sample_triton(*args, ids, block_size=2048, chunk_size=1024, split=split)
        s.exp_noise_triton(torch.arange(N), torch.zeros(N, dtype=torch.int64), torch.arange(V))
    names = kernel_names(ops.compiled)
    assert {"_spec_sample_kernel", "_race_sample_kernel", "_race_chunk_max_kernel", "_race_chunk_sum_kernel",
            "_race_params_kernel", "_race_chunk_kernel", "_race_pick_kernel", "_exp_noise_kernel"} <= names, names


BAD_KERNEL = '''
import triton
import triton.language as tl


@triton.jit
def _pick_kernel(flag_ptr, a_ptr, b_ptr, out_ptr):
    if tl.load(flag_ptr) > 0.0:
        best = tl.load(a_ptr)
    else:
        best = tl.load(b_ptr)
    tl.store(out_ptr, best.to(tl.float32))


def pick(flag, a, b, out):
    _pick_kernel[(1,)](flag, a, b, out)
    return out
'''


def test_a_kernel_the_interpreter_runs_but_a_gpu_rejects_fails_here(tmp_path):
    """The check can fail: one name bound to float64 in one branch and float32 in the other."""
    import triton

    path = tmp_path / "bad_kernel.py"
    path.write_text(BAD_KERNEL)
    ops = CompiledForGpu(path)
    args = (torch.ones(1), torch.ones(1, dtype=torch.float64), torch.ones(1), torch.empty(1))
    with pytest.raises(triton.compiler.errors.CompilationError, match="Mismatched type"):
        with ops.compiling() as bad:
            bad.pick(*args)
    same_dtypes = (torch.ones(1), torch.ones(1), torch.ones(1), torch.empty(1))
    with ops.compiling() as good:
        good.pick(*same_dtypes)
    assert kernel_names(ops.compiled) == {"_pick_kernel"}


INT_KERNEL = '''
import triton
import triton.language as tl


@triton.jit
def _scale_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):  # UNIQUE
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.sum(tl.load(x_ptr + offs), axis=0) * 2.0)


def scale(x, out):
    _scale_kernel[(1,)](x, out, BLOCK=16)
    return out
'''


def test_compiles_after_an_interpreted_helper_left_its_patches(tmp_path):
    """An interpreted kernel's call of a Triton @jit helper (tl.sum) patches the language for that
    call and never restores it; compiling afterwards in the same process (the full suite) then
    failed ('value' object has no attribute 'dtype'). `compiling()` compiles from the language as
    it was, and leaves the patches as it found them."""
    import triton.language as tl
    import triton.language.standard as standard
    from triton.runtime.interpreter import _patch_lang

    path = tmp_path / "int_kernel.py"
    path.write_text(INT_KERNEL.replace("UNIQUE", str(tmp_path)))  # its own source: no cache hit
    leak = _patch_lang(getattr(standard.sum, "fn", standard.sum))  # what such a call leaves behind
    try:
        patched = tl.core.mul
        assert patched.__module__ == "triton.runtime.interpreter"
        ops = CompiledForGpu(path)
        with ops.compiling() as k:
            k.scale(torch.ones(16), torch.empty(16))
        assert kernel_names(ops.compiled) == {"_scale_kernel"} and tl.core.mul is patched
    finally:
        leak.restore()
