"""The CPU encoder fast path (`specwhisper/model/encoder_cpu.py`) against the reference forward: features
equal to float rounding, independent of batch neighbours, rebuilt after weights change, and the
real base model's greedy tokens unchanged on long speech."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import real_folder

from specwhisper import Engine, load_audio, log_mel_spectrogram
from specwhisper.model import encoder_cpu
from specwhisper.model.weights import load_whisper
from specwhisper.samples import sample_paths

pytestmark = pytest.mark.skipif(not encoder_cpu.available(), reason="torch without oneDNN (mkldnn) ops")


@pytest.fixture(scope="module")
def encoder(multilingual):
    return load_whisper(multilingual).encoder


def test_fast_path_equals_reference(encoder):
    mel = torch.randn(2, encoder.conv1.in_channels, 3000, generator=torch.Generator().manual_seed(0))
    assert encoder_cpu.usable(encoder, mel)
    with torch.no_grad():
        fast, ref = encoder(mel), encoder.reference(mel)
    assert fast.shape == ref.shape and fast.dtype == torch.float32
    torch.testing.assert_close(fast, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fused", [False, True])
def test_fast_path_with_and_without_the_fused_gelu_equals_reference(encoder, fused, monkeypatch):
    """The GELU fused into oneDNN's products (`fused_gelu`: AVX-512, forced here at any level) or
    run after them: both the reference's features, and the fused product equal to the product
    then ATen's GELU."""
    monkeypatch.setattr(encoder_cpu, "fused_gelu", lambda: fused)
    mel = torch.randn(1, encoder.conv1.in_channels, 3000, generator=torch.Generator().manual_seed(1))
    encoder.__dict__.pop("_packed_cpu", None)
    with torch.no_grad():
        torch.testing.assert_close(encoder(mel), encoder.reference(mel), rtol=1e-4, atol=1e-4)
        g = torch.Generator().manual_seed(2)
        x, w, b = torch.randn(300, 64, generator=g), torch.randn(96, 64, generator=g) / 8, torch.randn(96, generator=g)
        packed = encoder_cpu.pack(w, 300), b
        real, attrs = encoder_cpu.MKLDNN._linear_pointwise, []

        class Spy:  # records the fused post-op each product asks oneDNN for
            binary = real.binary

            def __call__(self, *args):
                attrs.append(args[3])
                return real(*args)

        monkeypatch.setattr(encoder_cpu, "MKLDNN", types.SimpleNamespace(_linear_pointwise=Spy()))
        torch.testing.assert_close(encoder_cpu.linear_gelu(x, packed), torch.nn.functional.gelu(x @ w.t() + b),
                                   rtol=1e-5, atol=1e-5)
        assert attrs == (["gelu"] if fused else ["none"])


@pytest.mark.parametrize("held, expected", [("AVX2", False), ("avx2_vnni", False), ("AVX512_CORE", None), ("", None)])
def test_the_gelu_is_fused_only_where_onednn_runs_avx512(held, expected, monkeypatch):
    """oneDNN's AVX2 erf GELU ran slower fused than ATen's after the product: held to AVX2 (or
    on a CPU without AVX-512) the GELU stays separate."""
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.setenv("DNNL_MAX_CPU_ISA", held)
    avx512 = torch.cpu._is_avx512_supported()
    assert encoder_cpu.fused_gelu() is (avx512 if expected is None else expected)


def test_int8_projections_stay_close_to_float32(encoder):
    """A draft's encoder with int8 projections (`Whisper.int8_encoder`): features within a few
    percent of the float32 reference, and really computed another way."""
    if not encoder_cpu.int8_usable():
        pytest.skip("this torch has no fbgemm int8 linear")
    mel = torch.randn(1, encoder.conv1.in_channels, 3000, generator=torch.Generator().manual_seed(4))
    encoder.int8_linears = True
    try:
        with torch.no_grad():
            int8, ref = encoder(mel), encoder.reference(mel)
    finally:
        del encoder.int8_linears  # back to the class default (float32)
    assert int8.shape == ref.shape and int8.dtype == torch.float32 and not torch.equal(int8, ref)
    cosine = torch.nn.functional.cosine_similarity(int8[0], ref[0], dim=-1)
    assert cosine.min() > 0.98, cosine.min()
    with torch.no_grad():
        torch.testing.assert_close(encoder(mel), ref, rtol=1e-4, atol=1e-4)  # the float32 path again


@pytest.mark.parametrize("int8", [False, True])
def test_packed_weights_serve_windows_of_every_length(encoder, int8):
    """A draft encodes its windows' audio only (`Drafter.encode`: 1200 of 3000 frames, say): the
    packed weights are built once, whatever length comes first, and reused for every length (no
    re-pack when it changes), each length's layers attending as `layer_blocks` says for it, and
    the features equal a fresh pack's for the same input."""
    if int8 and not encoder_cpu.int8_usable():
        pytest.skip("this torch has no fbgemm int8 linear")
    gen = torch.Generator().manual_seed(8)
    mels = [torch.randn(1, encoder.conv1.in_channels, n, generator=gen) for n in (1200, 3000, 600)]
    encoder.attention_block, encoder.int8_linears = 150, int8
    try:
        encoder.__dict__.pop("_packed_cpu", None)
        with torch.no_grad():
            first = [encoder(m) for m in mels]
            packed = encoder.__dict__["_packed_cpu"]
            # int8: the layers' projections and conv2 (conv1's 240 inputs stay float32)
            assert isinstance(packed[1].conv2, tuple) != int8 and isinstance(packed[1].conv1, tuple)
            again = [encoder(m) for m in mels[::-1]][::-1]
            assert encoder.__dict__["_packed_cpu"] is packed  # no re-pack for another length
            fresh = []
            for m in mels:
                encoder.__dict__.pop("_packed_cpu")
                fresh.append(encoder(m))
            refs = [encoder.reference(m) for m in mels]
    finally:
        del encoder.attention_block, encoder.int8_linears
    for a, b, c, ref in zip(first, again, fresh, refs):
        assert torch.equal(a, b) and torch.equal(a, c)
        if not int8:
            torch.testing.assert_close(a, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("engine", ["onednn", "fbgemm", "no-such-engine"])
def test_int8_weights_from_either_engine_stay_close_and_leave_the_global_engine(engine, monkeypatch):
    """`_pack_int8` packs with `INT8_ENGINE` where torch has it (else fbgemm), restores torch's
    global quantized engine, and the product through the packed weights stays close to float32's
    (per-row weight scales, per-call activations)."""
    if not encoder_cpu.int8_usable():
        pytest.skip("this torch has no fbgemm int8 linear")
    if engine == "onednn" and "onednn" not in torch.backends.quantized.supported_engines:
        pytest.skip("this torch has no oneDNN quantized engine")
    monkeypatch.setattr(encoder_cpu, "INT8_ENGINE", engine)
    gen = torch.Generator().manual_seed(9)
    w, b, x = torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen), torch.randn(300, 64, generator=gen)
    before = torch.backends.quantized.engine
    packed = encoder_cpu._pack_int8(w, b, 300)
    assert torch.backends.quantized.engine == before
    with torch.no_grad():
        y, ref = encoder_cpu.linear(x, packed), x @ w.T + b
    assert y.shape == ref.shape and not torch.equal(y, ref)
    assert ((y - ref).norm(dim=1) / ref.norm(dim=1)).max() < 0.03


SATURATING_PRODUCT = """
import json, torch
from specwhisper.model import encoder_cpu
torch.manual_seed(0)
# rows of large activations against large weights of one sign: every pair of u8 x s8 products
# overflows a saturating int16 where the packed weights reach 127 (AVX2 without VNNI)
w = (0.9 + 0.1 * torch.rand(96, 256)) * torch.where(torch.rand(96, 1) < 0.5, -1.0, 1.0)
x = 1 + 0.5 * torch.rand(40, 256)
b = torch.randn(96)
with torch.no_grad():
    y = encoder_cpu.linear(x, encoder_cpu.int8_pack(w, b))
ref = x @ w.T + b
print(json.dumps({"weight_max": encoder_cpu.int8_weight_max(),
                  "err": float(((y - ref).norm(dim=1) / ref.norm(dim=1)).max())}))
"""


@pytest.mark.parametrize("held", [False, True], ids=["native", "held-to-avx2"])
def test_int8_products_stay_close_where_the_kernels_would_saturate(held):
    """Without VNNI (AVX2-only CPUs, or torch's libraries held to AVX2) the int8 kernels add pairs
    of u8 x s8 products into saturating int16s: `int8_pack` then keeps weights within 63, so such
    products stay close to float32's (packed at 127, held to AVX2, they read 0.64 of their value).
    In a fresh process, natively and with oneDNN and fbgemm held to AVX2."""
    if not encoder_cpu.int8_usable():
        pytest.skip("this torch has no fbgemm int8 linear")
    env = dict(os.environ)
    for name in ("DNNL_MAX_CPU_ISA", "FBGEMM_ENABLE_INSTRUCTIONS"):
        env.pop(name, None)
    if held:
        env.update(DNNL_MAX_CPU_ISA="AVX2", FBGEMM_ENABLE_INSTRUCTIONS="AVX2")
    done = subprocess.run([sys.executable, "-c", SATURATING_PRODUCT], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["weight_max"] in (63, 127)
    if held:
        assert out["weight_max"] == 63  # AVX2 alone has no VNNI: the probe must see the saturation
    assert out["err"] < 0.03, out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,block", [(1500, 150), (12, 3), (12, 12), (7, 1)])
def test_block_attention_equals_attention_block_by_block(T, block, dtype):
    """`block_attention` against full attention run on each block alone, on contiguous and
    strided (head-transposed) inputs; a length that is not a multiple of the block is refused."""
    from specwhisper.model.whisper import block_attention

    g = torch.Generator().manual_seed(T + block)
    q, k, v = (torch.randn(2, T, 3, 16, generator=g).to(dtype).transpose(1, 2) for _ in range(3))  # [B, H, T, Dh]
    want = torch.cat([torch.nn.functional.scaled_dot_product_attention(
        q[:, :, i:i + block], k[:, :, i:i + block], v[:, :, i:i + block], scale=1.0)
        for i in range(0, T, block)], dim=2)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(block_attention(q, k, v, block), want, **tol)
    torch.testing.assert_close(block_attention(q.contiguous(), k.contiguous(), v.contiguous(), block), want, **tol)
    if block < T:
        full = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=1.0)
        assert not torch.allclose(full, want, atol=1e-3)
    with pytest.raises(ValueError, match="multiple of"):
        block_attention(q[:, :, :T - 1], k[:, :, :T - 1], v[:, :, :T - 1], T)


@pytest.mark.parametrize("int8", [False, True])
def test_local_attention_fast_path_equals_its_reference(encoder, int8, monkeypatch):
    """A draft's encoder with block attention (`Whisper.local_encoder`): the fast path equals the
    reference forward with the same blocks, and differs from full attention; the last layer
    stays global unless `local_last`; where the kernel runs full attention, it runs the local
    layers too (their blocks passed to it)."""
    from specwhisper.backends import cpu_ops

    if int8 and not encoder_cpu.int8_usable():
        pytest.skip("this torch has no fbgemm int8 linear")
    blocks = []
    kernel = cpu_ops.encoder_attention
    monkeypatch.setattr(cpu_ops, "encoder_attention",
                        lambda qkv, heads, block=None: blocks.append(block) or kernel(qkv, heads, block))
    mel = torch.randn(1, encoder.conv1.in_channels, 3000, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = encoder.reference(mel)
    encoder.attention_block, encoder.int8_linears = 150, int8
    try:
        assert encoder.layer_blocks(1500) == [150] * (len(encoder.layers) - 1) + [None]
        encoder.local_last = True
        assert encoder.layer_blocks(1500) == [150] * len(encoder.layers)
        assert encoder.layer_blocks(1499) == [None] * len(encoder.layers)  # not a multiple: full attention
        with torch.no_grad():
            fast, ref = encoder(mel), encoder.reference(mel)
    finally:
        del encoder.attention_block, encoder.int8_linears, encoder.local_last
    if cpu_ops.encoder_attention_usable(mel):
        assert blocks == [150] * len(encoder.layers)
    assert not torch.allclose(ref, full, atol=1e-3)  # really attended locally
    if int8:  # int8 projections: close, as in the test above
        assert torch.nn.functional.cosine_similarity(fast[0], ref[0], dim=-1).min() > 0.98
    else:
        torch.testing.assert_close(fast, ref, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        torch.testing.assert_close(encoder(mel), full, rtol=1e-4, atol=1e-4)  # the packed weights follow back


def test_a_window_does_not_depend_on_its_batch_neighbours(encoder):
    g = torch.Generator().manual_seed(1)
    mels = torch.randn(3, encoder.conv1.in_channels, 3000, generator=g)
    with torch.no_grad():
        together = encoder(mels)
        alone = [encoder(m[None])[0] for m in mels]
    for row, single in zip(together, alone):
        assert torch.equal(row, single)


def test_packed_weights_follow_in_place_changes(encoder):
    mel = torch.randn(1, encoder.conv1.in_channels, 3000, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = encoder(mel)
        fc1 = encoder.layers[0].fc1.weight
        saved = fc1.clone()
        fc1.mul_(1.5)
        try:
            changed, ref = encoder(mel), encoder.reference(mel)
        finally:
            fc1.copy_(saved)
        after = encoder(mel)
    assert not torch.allclose(changed, before, atol=1e-3)
    torch.testing.assert_close(changed, ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(after, before)


def test_cross_kv_from_onednn_products(multilingual):
    """The decoder's cross-attention K/V from oneDNN products (`Decoder.cross_packed`): equal to
    torch's GEMM to float32 rounding, a row's bits the same alone or beside another row, and the
    reordered weights rebuilt after an in-place change of a projection, the same bits on 1 and 2
    threads."""
    from specwhisper.model.whisper import DecoderCache

    model = load_whisper(multilingual)
    dec = model.decoder
    g = torch.Generator().manual_seed(6)
    features = torch.randn(2, model.config.max_source_positions, model.config.d_model, generator=g)

    def fill(rows=2, fast=True, x=features):
        cache = DecoderCache.allocate(model.config, rows, "cpu", torch.float32)
        dec.fast_cross = fast
        try:
            with torch.no_grad():
                dec.fill_cross(cache, x)
        finally:
            del dec.fast_cross  # the class default
        return cache

    fast, slow = fill(), fill(fast=False)
    assert dec.__dict__.get("_cross_packed"), "the oneDNN path did not run"
    for a, b in ((fast.cross_k, slow.cross_k), (fast.cross_v, slow.cross_v)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    alone = fill(1, x=features[1:])
    assert torch.equal(alone.cross_k[:, 0], fast.cross_k[:, 1]) and torch.equal(alone.cross_v[:, 0], fast.cross_v[:, 1])
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)  # a Ray worker's 1 thread and its driver's 2
    try:
        other = fill()
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(other.cross_k, fast.cross_k) and torch.equal(other.cross_v, fast.cross_v)
    v_proj = dec.layers[0].encoder_attn.v_proj.weight
    saved = v_proj.detach().clone()
    with torch.no_grad():
        v_proj.mul_(2.0)
    try:
        changed, reference = fill(), fill(fast=False)
    finally:
        with torch.no_grad():
            v_proj.copy_(saved)
    torch.testing.assert_close(changed.cross_v, reference.cross_v, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(changed.cross_v[0], fast.cross_v[0], atol=1e-3)
    assert torch.equal(fill().cross_v, fast.cross_v)  # restored: the first layout's bits again


def test_autograd_and_other_dtypes_take_the_reference(encoder):
    mel = torch.randn(1, encoder.conv1.in_channels, 3000)
    assert not encoder_cpu.usable(encoder, mel.double())
    assert not encoder_cpu.usable(encoder, mel[0])
    encoder.layers[0].fc1.weight.requires_grad_(True)
    try:
        assert not encoder_cpu.usable(encoder, mel)
        with torch.no_grad():
            assert encoder_cpu.usable(encoder, mel)
    finally:
        encoder.layers[0].fc1.weight.requires_grad_(False)


@pytest.mark.real
def test_real_base_tokens_unchanged_on_long_speech():
    """Whisper-base greedy on ≈ 25 s windows (the bundled samples joined): the fast encoder's
    tokens equal the reference encoder's, token for token."""
    engine = Engine(real_folder("base"))
    audio = np.concatenate([np.concatenate([load_audio(p), np.zeros(4800, np.float32)]) for p in sample_paths()])
    windows = [audio[i:i + 25 * 16000] for i in (0, len(audio) - 25 * 16000)]
    mels = torch.stack([log_mel_spectrogram(w, n_mels=80) for w in windows])
    encoder = engine.target.model.encoder
    fast = [o.tokens for o in engine.transcribe(mels, language="en")]
    encoder.fast_cpu = False
    try:
        ref = [o.tokens for o in engine.transcribe(mels, language="en")]
    finally:
        encoder.fast_cpu = True
    assert fast == ref and all(len(t) > 30 for t in fast)


THREADS_PROBE = """
import sys, torch, torch.nn.functional as F
if sys.argv[1] == "specwhisper":
    import specwhisper.backends.cpu_ops as ops
    assert ops.strict_mkl()
g = torch.Generator().manual_seed(0)
x, w = torch.randn(1500, 512, generator=g), torch.randn(1024, 512, generator=g)
q, k, v = (torch.randn(1, 8, 1500, 64, generator=g) for _ in range(3))
out = {}
for t in (1, 2):
    torch.set_num_threads(t)
    out[t] = (F.linear(x, w), F.scaled_dot_product_attention(q, k, v))
print(all(torch.equal(a, b) for a, b in zip(out[1], out[2])))
"""


def test_gemms_do_not_depend_on_the_thread_count():
    """MKL's AVX2 kernels (forced here, as on any CPU without AVX-512) round F.linear and the flash
    attention differently at 1 and 2 threads; importing specwhisper puts MKL in its strict
    reproducible mode, so the encoder and the cross K/V give the same bits on every thread count
    (a Ray worker's 1 thread and its driver's 2). The bare-torch run shows the test has power
    where MKL's kernels differ (not every MKL build and CPU do)."""
    import os
    import subprocess
    import sys

    if not torch.backends.mkl.is_available():
        pytest.skip("torch without MKL")
    env = {**os.environ, "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    env.pop("MKL_CBWR", None)

    def same_bits(mode: str) -> bool:
        done = subprocess.run([sys.executable, "-c", THREADS_PROBE, mode], capture_output=True, text=True,
                              env=env, timeout=300, check=True)
        return done.stdout.strip().splitlines()[-1] == "True"

    assert same_bits("specwhisper")
    if same_bits("torch"):
        pytest.skip("this MKL gives thread-independent bits even without strict mode (no power here)")


def _avx2_attention() -> bool:
    from specwhisper.backends import cpu_ops

    return cpu_ops.available() and cpu_ops._ops().vector_level() >= 1


needs_avx2 = pytest.mark.skipif(not _avx2_attention(), reason="the encoder attention kernel needs AVX2 + FMA")


@needs_avx2
@pytest.mark.parametrize("T,heads,head_dim", [(1, 1, 64), (5, 2, 64), (6, 1, 64), (7, 3, 20), (31, 2, 64),
                                              (32, 8, 64), (33, 2, 16), (45, 2, 40), (40, 3, 12), (257, 4, 64),
                                              (1500, 8, 64)])
@pytest.mark.parametrize("spread", [1.0, 6.0])
def test_encoder_attention_matches_reference(T, heads, head_dim, spread):
    """csrc/encoder_ops.h against softmax(q kᵀ) v in float64, on the edges of its tiles (6 keys or
    channels, 16 and 32 queries), head dims that are not a multiple of 6 or 16 (a last group of 4
    channels: 16, 40, 64; of 2: 20; none: 12, whose queries are not moved 8 × 8), strided rows, and
    scores spread enough that the softmax is nearly one-hot (spread 6: score sd ≈ 290): within
    twice the error of torch's own float32 attention on the same input."""
    from specwhisper.backends import cpu_ops

    d = heads * head_dim
    g = torch.Generator().manual_seed(T * 7 + heads)
    wide = torch.randn(T, 3 * d + 5, generator=g) * spread
    qkv = wide[:, 2:3 * d + 2]  # rows strided, columns unit-stride
    assert T == 1 or not qkv.is_contiguous()
    with torch.no_grad():
        out = cpu_ops.encoder_attention(qkv, heads)
        ref = cpu_ops.encoder_attention_reference(qkv.double(), heads)
        torch_error = (cpu_ops.encoder_attention_reference(qkv, heads).double() - ref).abs().max().item()
    assert out.shape == (T, d) and out.dtype == torch.float32
    error = (out.double() - ref).abs().max().item()
    assert error <= 2 * max(torch_error, 1e-6), (error, torch_error)


@needs_avx2
def test_encoder_attention_bits_do_not_depend_on_threads_or_the_calling_thread():
    """Each output element is made by one thread in a fixed order: 1 thread, 2 threads, and a
    call from another thread (the extension's own pool) give the same bits."""
    import threading

    from specwhisper.backends import cpu_ops

    qkv = torch.randn(301, 3 * 4 * 64, generator=torch.Generator().manual_seed(5))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_ops.encoder_attention(qkv, 4)
        torch.set_num_threads(2)
        two = cpu_ops.encoder_attention(qkv, 4)
        box = []
        worker = threading.Thread(target=lambda: box.append(cpu_ops.encoder_attention(qkv, 4)))
        worker.start()
        worker.join()
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two) and torch.equal(one, box[0])


@needs_avx2
def test_encoder_attention_flushes_subnormals_only_inside_and_keeps_one_hot_rows_exact():
    """The kernel runs with flush-to-zero (weights below 2^-126 are 0: csrc/encoder_ops.h) and
    restores the calling thread's mode: a subnormal product in torch after the call is still
    subnormal. Rows whose other weights are all subnormal (scores 87.5 below the best: e^-87.5 ≈
    1.0e-38 < 2^-126, and so their products with the values, which come before and after the
    best key) give exactly their best key's value, as the float64 reference does to float32
    precision."""
    from specwhisper.backends import cpu_ops

    T, heads, Dh, d = 70, 2, 64, 128
    qkv = torch.randn(T, 3 * d, generator=torch.Generator().manual_seed(11))
    qkv[:, :Dh] = 0
    qkv[:, 0] = 10.0  # head 0: every query 10 e_0
    qkv[:, d:d + Dh] = 0
    qkv[:, d] = 1.25  # keys 1.25 e_0: scores 12.5 ...
    qkv[7, d] = 10.0  # ... but key 7's 100
    assert 0 < torch.exp(torch.tensor(12.5 - 100.0)).item() < 2.0**-126  # the weights' regime
    tiny = torch.tensor([2.0**-126], dtype=torch.float32)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out = cpu_ops.encoder_attention(qkv, heads)
            assert (tiny * 0.5).item() == 2.0**-127  # the caller's arithmetic still keeps subnormals
    finally:
        torch.set_num_threads(before)
    assert torch.equal(out[:, :Dh], qkv[7, 2 * d:2 * d + Dh].expand(T, Dh))
    ref = cpu_ops.encoder_attention_reference(qkv.double(), heads)
    torch_error = (cpu_ops.encoder_attention_reference(qkv, heads).double() - ref).abs().max().item()
    assert (out.double() - ref).abs().max().item() <= 2 * max(torch_error, 1e-6)


@needs_avx2
@pytest.mark.parametrize("T,block,heads,head_dim", [(750, 75, 6, 64), (12, 3, 2, 64), (40, 20, 3, 20),
                                                    (66, 33, 2, 16), (64, 64, 1, 64), (7, 1, 2, 64)])
def test_encoder_attention_within_blocks_is_each_block_alone(T, block, heads, head_dim):
    """`block`: each run of `block` positions attends only to itself (a draft's local layers): the
    bits of the kernel run on that run's rows alone (strided rows), within twice the error of
    torch's float32 `whisper.block_attention` against its float64 result, and different from full
    attention; a block that does not divide the length is refused."""
    from specwhisper.backends import cpu_ops
    from specwhisper.model.whisper import block_attention

    d = heads * head_dim
    g = torch.Generator().manual_seed(T + block)
    qkv = (torch.randn(T, 3 * d + 4, generator=g) * 2)[:, 1:3 * d + 1]
    with torch.no_grad():
        out = cpu_ops.encoder_attention(qkv, heads, block)
        alone = torch.cat([cpu_ops.encoder_attention(qkv[i:i + block], heads) for i in range(0, T, block)])
        torch_out, ref = (block_attention(*x.reshape(T, 3, heads, head_dim).permute(1, 2, 0, 3)[:, None], block)
                          [0].transpose(0, 1).reshape(T, d) for x in (qkv, qkv.double()))  # q, k, v [1, H, T, Dh]
    assert torch.equal(out, alone)
    torch_error = (torch_out.double() - ref).abs().max().item()
    assert (out.double() - ref).abs().max().item() <= 2 * max(torch_error, 1e-6)
    if block < T:
        assert not torch.allclose(out, cpu_ops.encoder_attention(qkv, heads), atol=1e-3)
    if block > 1:
        with pytest.raises(RuntimeError, match="block must be 0 or divide"):
            cpu_ops.encoder_attention(qkv[:T - 1], heads, block)


@needs_avx2
@pytest.mark.parametrize("T,heads,head_dim,block", [(1, 1, 64, 0), (7, 3, 20, 0), (33, 2, 16, 0), (45, 2, 40, 0),
                                                    (40, 3, 12, 0), (128, 2, 64, 0), (257, 4, 64, 0), (1500, 8, 64, 0),
                                                    (750, 6, 64, 75), (66, 2, 16, 33)])
def test_encoder_attention_avx512_tiles_give_the_avx2_bits(T, heads, head_dim, block):
    """With AVX-512 the kernel's 6 × 64 tiles (items of 33 to 64 queries), 6 × 32 tiles (a last
    item of at most 32) and 16-lane softmax compute every element with the AVX2 tiles' operations
    in their order: the same bits at both levels (tile edges, whole 64-query items, head dims with
    a last group of 4 or 2 channels, local blocks). Where the CPU lacks AVX-512 both levels run the
    AVX2 tiles and this only checks the level switch."""
    from specwhisper.backends import cpu_ops

    d = heads * head_dim
    g = torch.Generator().manual_seed(T + heads + block)
    qkv = (torch.randn(T, 3 * d + 3, generator=g) * 3)[:, 1:3 * d + 1]
    with torch.no_grad():
        with cpu_ops.vector_level(2):
            wide = cpu_ops.encoder_attention(qkv, heads, block)
        with cpu_ops.vector_level(1):
            narrow = cpu_ops.encoder_attention(qkv, heads, block)
    assert torch.equal(wide, narrow)


def test_encoder_attention_names_bad_input():
    from specwhisper.backends import cpu_ops

    with pytest.raises(RuntimeError, match="not 3 \\* heads \\* head_dim"):
        cpu_ops.encoder_attention(torch.randn(10, 3 * 64 + 1), 1)
    with pytest.raises(RuntimeError, match="float32 CPU matrix"):
        cpu_ops.encoder_attention(torch.randn(10, 3 * 64, dtype=torch.float64), 1)
    with pytest.raises(RuntimeError, match="unit column stride"):
        cpu_ops.encoder_attention(torch.randn(3 * 64, 10).t(), 1)


@needs_avx2
def test_fast_path_attends_with_the_kernel_on_avx2_and_with_torch_elsewhere(encoder, monkeypatch):
    """On an AVX2 CPU the fast path's full-attention layers run the kernel (one call a layer); held
    to the scalar level, or on a CPU with full-width AVX-512, they run torch's flash kernel; the
    features agree."""
    from specwhisper.backends import cpu_ops

    calls = []
    kernel = cpu_ops.encoder_attention
    monkeypatch.setattr(cpu_ops, "encoder_attention",
                        lambda qkv, heads, block=None: calls.append(heads) or kernel(qkv, heads, block))
    mel = torch.randn(1, encoder.conv1.in_channels, 3000, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        with cpu_ops.vector_level(1):
            own = encoder(mel)
        assert len(calls) == len(encoder.layers)
        with cpu_ops.vector_level(0):
            flash = encoder(mel)
        assert len(calls) == len(encoder.layers)
    assert not torch.equal(own, flash)
    torch.testing.assert_close(own, flash, rtol=1e-4, atol=1e-4)


def _cpuinfo() -> dict:
    fields = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        if not line.strip():
            break  # the first processor is enough
        fields[key.strip()] = value.strip()
    return fields


@needs_avx2
def test_the_kernel_runs_at_every_vector_level_but_scalar():
    """The kernel runs at the AVX-512 level (512-bit tiles, on every AVX-512 CPU: an AMD Zen 4,
    whose AVX-512 runs on 256-bit units, included) and at AVX2, never at the scalar level."""
    from specwhisper.backends import cpu_ops

    x = torch.zeros(4)
    with torch.no_grad():
        with cpu_ops.vector_level(2):
            assert cpu_ops.encoder_attention_usable(x)
        with cpu_ops.vector_level(1):
            assert cpu_ops.encoder_attention_usable(x)
        with cpu_ops.vector_level(0):
            assert not cpu_ops.encoder_attention_usable(x)


@pytest.mark.parametrize("int8", [False, True])
def test_pooled_encoder_fast_path_equals_its_reference(encoder, int8):
    """A draft's encoder on pooled positions (`Whisper.pool_encoder`): the fast path equals the
    reference forward, which is the layers run on the means of adjacent positions (checked
    against the unpooled encoder's own pieces), blocks of 150 20-ms positions becoming 75; windows
    of every length reuse one pack; a frame count the pool does not divide is refused."""
    if int8 and not encoder_cpu.int8_usable():
        pytest.skip("this torch has no fbgemm int8 linear")
    gen = torch.Generator().manual_seed(6)
    mel = torch.randn(1, encoder.conv1.in_channels, 3000, generator=gen)
    encoder.attention_block, encoder.int8_linears, encoder.pool_positions = 150, int8, 2
    try:
        assert encoder.layer_blocks(750) == [75] * (len(encoder.layers) - 1) + [None]
        with torch.no_grad():
            fast, ref = encoder(mel), encoder.reference(mel)
            short = encoder(mel[..., :1200])
            # the spec, written out: convolutions and positions as Whisper, then pairs' means
            F = torch.nn.functional
            x = F.gelu(encoder.conv2(F.gelu(encoder.conv1(mel)))).transpose(1, 2) + encoder.embed_positions.weight
            x = (x[:, 0::2] + x[:, 1::2]) / 2
            for layer, block in zip(encoder.layers, [75] * (len(encoder.layers) - 1) + [None]):
                x = layer(x, block)
            spec = encoder.layer_norm(x)
        for frames in (1202, 1201):  # 601 positions (conv2 rounds up)
            with pytest.raises(ValueError, match="multiple of 4 mel frames"):
                encoder(mel[..., :frames])
    finally:
        del encoder.attention_block, encoder.int8_linears, encoder.pool_positions
    assert fast.shape == ref.shape == (1, 750, encoder.conv1.out_channels) and short.shape[1] == 300
    torch.testing.assert_close(ref, spec, rtol=1e-5, atol=1e-5)
    if int8:
        assert torch.nn.functional.cosine_similarity(fast[0], ref[0], dim=-1).min() > 0.98
    else:
        torch.testing.assert_close(fast, ref, rtol=1e-4, atol=1e-4)
