"""kernels/decode_linear.py: the fused decode linear (layer norm, bias, GELU, residual) against its
PyTorch reference over odd shapes and every option (interpreted on CPU tensors), and on CUDA at
large-v3's shapes, where each row's bits must not depend on the other rows or their number."""
from __future__ import annotations

import importlib.util

from triton_interp import Interpreted  # first: sets TRITON_INTERPRET on a machine without a GPU

import pytest  # noqa: E402
import torch  # noqa: E402

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not importable")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# float32 products in the interpreter; float16 / bfloat16: one rounding of the input's dtype apart
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 8e-2}


@pytest.fixture(scope="module")
def interpreted():
    pytest.importorskip("triton", reason="triton is not importable")
    return Interpreted("decode_linear")


def inputs(M, K, N, dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * 2 + 0.5
    weight = torch.randn(N, K, generator=g) / K**0.5
    bias = torch.randn(N, generator=g) * 0.1
    ln = (1 + 0.1 * torch.randn(K, generator=g), 0.1 * torch.randn(K, generator=g))
    residual = torch.randn(M, N, generator=g)
    to = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return to(x), to(weight), to(bias), (to(ln[0]), to(ln[1]), 1e-5), to(residual)


OPTIONS = {"plain": {}, "bias": dict(bias=True), "ln+bias": dict(bias=True, ln=True),
           "ln+bias+gelu": dict(bias=True, ln=True, gelu=True), "bias+residual": dict(bias=True, residual=True),
           "all": dict(bias=True, ln=True, gelu=True, residual=True)}


def call(fn, args, opts):
    x, weight, bias, ln, residual = args
    return fn(x, weight, bias if opts.get("bias") else None, layer_norm=ln if opts.get("ln") else None,
              gelu=opts.get("gelu", False), residual=residual if opts.get("residual") else None)


@needs_triton
@pytest.mark.parametrize("opts", OPTIONS.values(), ids=OPTIONS.keys())
# bfloat16 only compiled, on CUDA (below): the interpreter's tl.dot computes on bfloat16's raw bits
@pytest.mark.parametrize("M,K,N,dtype", [(1, 64, 48, "fp32"), (5, 100, 33, "fp16"), (17, 257, 64, "fp32"),
                                         (3, 128, 130, "fp16"), (16, 40, 17, "fp16")])
def test_interpreted_matches_reference(interpreted, M, K, N, dtype, opts):
    args = inputs(M, K, N, DTYPES[dtype], seed=M + K + N)
    got = call(lambda *a, **kw: interpreted.decode_linear(*a, block_n=32, block_k=32, **kw), args, opts)
    expected = call(interpreted.module.decode_linear_reference, args, opts)
    assert got.dtype == expected.dtype and got.shape == (M, N)
    tol = TOLERANCE[DTYPES[dtype]]
    torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol)


@needs_triton
def test_interpreted_reference_is_layer_norm_then_linear(interpreted):
    """The reference itself, in float32, is torch's layer norm, linear, GELU and add."""
    x, weight, bias, (g, b, eps), residual = inputs(4, 96, 40, torch.float32, seed=2)
    expected = residual + torch.nn.functional.gelu(
        torch.nn.functional.linear(torch.nn.functional.layer_norm(x, (96,), g, b, eps), weight, bias))
    got = interpreted.module.decode_linear_reference(x, weight, bias, layer_norm=(g, b, eps), gelu=True,
                                                     residual=residual)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@needs_triton
def test_interpreted_empty_and_bad_arguments(interpreted):
    x, weight, *_ = inputs(3, 64, 32, torch.float32)
    assert interpreted.decode_linear(x[:0], weight).shape == (0, 32)
    with pytest.raises(AssertionError):
        interpreted.decode_linear(x[:, :63], weight)  # K mismatch
    with pytest.raises(AssertionError):
        interpreted.decode_linear(x.half(), weight)  # dtype mismatch


# --- compiled, on CUDA: large-v3's decoder linears ------------------------------------------------

LARGE_V3 = {"qkv": (1280, 3840, dict(bias=True, ln=True)), "out": (1280, 1280, dict(bias=True, residual=True)),
            "fc1": (1280, 5120, dict(bias=True, ln=True, gelu=True)), "fc2": (5120, 1280, dict(bias=True, residual=True))}


@pytest.mark.cuda
@needs_cuda
@needs_triton
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("name", LARGE_V3)
def test_cuda_rows_are_independent_and_match_reference(name, dtype):
    from specwhisper.backends import ops  # noqa: F401 (the compiled kernels' import path)
    from specwhisper.backends.ops import _import_kernels

    kernel = _import_kernels("decode_linear")

    K, N, opts = LARGE_V3[name]
    args = inputs(40, K, N, DTYPES[dtype], seed=K + N, device="cuda")
    full = call(kernel.decode_linear, args, opts)
    expected = call(kernel.decode_linear_reference, args, opts)
    tol = TOLERANCE[DTYPES[dtype]]
    torch.testing.assert_close(full.float(), expected.float(), rtol=tol, atol=tol)
    for rows in (slice(0, 1), slice(3, 8), slice(7, 16), slice(20, 37)):  # 1, 5, 9 and 17 rows
        part = [a[rows] if isinstance(a, torch.Tensor) and a.shape[0] == 40 else a for a in args]
        assert torch.equal(call(kernel.decode_linear, part, opts), full[rows]), rows
    other = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    other[0][1:] = torch.randn_like(other[0][1:])  # other rows' values change, row 0's bits do not
    assert torch.equal(call(kernel.decode_linear, other, opts)[0], full[0])


# --- the decoder with its linears fused (Whisper.fuse_linears) ------------------------------------

def decoder_pair(folder, device, dtype, kernel):
    """(plain, fused) loaded models of one checkpoint and a filled cache for each."""
    from specwhisper.engine.decoding import LoadedModel
    from specwhisper.model.whisper import DecoderCache

    plain, fused = (LoadedModel.load(folder, torch.device(device), dtype) for _ in range(2))
    fused.model.fuse_linears(kernel)
    cfg = plain.config
    g = torch.Generator().manual_seed(1)
    features = torch.randn(2, cfg.max_source_positions, cfg.d_model, generator=g).to(device, dtype)
    caches = []
    for m in (plain, fused):
        cache = DecoderCache.allocate(cfg, 2, torch.device(device), dtype)
        m.model.decoder.fill_cross(cache, features)
        caches.append(cache)
    return plain, fused, caches


@needs_triton
def test_interpreted_fused_decoder_matches_the_plain_one(interpreted, tmp_path):
    """A random checkpoint's decoder, prefill then a 3-token verify-shaped pass: the fused layers'
    hidden states and argmax equal the plain layers' to float rounding (float32)."""
    from checkpoints import make_checkpoint

    class Counting:  # the fused layers must run the kernel: six linears per layer and pass
        calls = 0

        def decode_linear(self, *args, **kwargs):
            Counting.calls += 1
            return interpreted.decode_linear(*args, **kwargs)

    folder = make_checkpoint(tmp_path / "ckpt", vocab_size=51865, d_model=64, decoder_layers=2, heads=4)
    plain, fused, (c_plain, c_fused) = decoder_pair(folder, "cpu", torch.float32, Counting())
    tokens = torch.tensor([[50258, 50259, 50359, 50363], [50258, 50259, 50359, 50363]])
    more = torch.randint(0, 50000, (2, 3), generator=torch.Generator().manual_seed(2))
    for toks, start in ((tokens, 0), (more, 4)):
        pos = (start + torch.arange(toks.shape[1])).expand(2, -1).contiguous()
        h_plain = plain.model.decoder.hidden(toks, pos, c_plain)
        h_fused = fused.model.decoder.hidden(toks, pos, c_fused)
        torch.testing.assert_close(h_fused, h_plain, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(c_fused.self_k, c_plain.self_k, rtol=1e-4, atol=1e-4)
    assert Counting.calls == 6 * 2 * 2
    logits = lambda m, h: m.model.decoder.logits(h)  # noqa: E731
    assert torch.equal(logits(fused, h_fused).argmax(-1), logits(plain, h_plain).argmax(-1))


@pytest.mark.cuda
@needs_cuda
@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_fused_decoder_matches_the_plain_one(tmp_path, dtype):
    from checkpoints import make_checkpoint

    folder = make_checkpoint(tmp_path / "ckpt", vocab_size=51865, d_model=256, decoder_layers=2, heads=4)
    plain, fused, (c_plain, c_fused) = decoder_pair(folder, "cuda", dtype, None)
    toks = torch.randint(0, 50000, (2, 5), device="cuda", generator=torch.Generator(device="cuda").manual_seed(3))
    pos = torch.arange(5, device="cuda").expand(2, -1).contiguous()
    h_plain = plain.model.decoder.hidden(toks, pos, c_plain)
    h_fused = fused.model.decoder.hidden(toks, pos, c_fused)
    tol = TOLERANCE[dtype] * 2
    torch.testing.assert_close(h_fused.float(), h_plain.float(), rtol=tol, atol=tol)
