"""specwhisper/kernels/decode_ops.py, the GPU decode ops: the fused linear (layer norm, bias, GELU, residual,
cache writes) and the chunked attention against their PyTorch references over odd shapes and every
option (interpreted on CPU tensors); the decoder and the engine on them (`Whisper.fuse_decode_ops`):
equal to the plain path to rounding, a verify pass equal to one-token steps bit for bit, speculative
tokens equal to target-only's; and on CUDA at large-v3's shapes, where each row's and query's bits
must not depend on the others, in float16 and bfloat16 too."""
from __future__ import annotations

from triton_interp import Interpreted, needs_triton, on_cuda  # first: sets TRITON_INTERPRET on a machine without a GPU

import pytest  # noqa: E402
import torch  # noqa: E402

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# float32 products in the interpreter; float16 / bfloat16: one rounding of the input's dtype apart
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 8e-2}


@pytest.fixture(scope="module")
def interpreted():
    pytest.importorskip("triton", reason="triton is not importable")
    return Interpreted("decode_ops")


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
@pytest.mark.parametrize("split_k", [0, 32, 96])
def test_interpreted_split_features_match_reference_and_keep_rows_independent(interpreted, split_k):
    """The features cut into splits of split_k (0: one), each summed by its own programs, then
    added in order by the epilogue kernel: the reference's values, and a row's bits the same
    whether it is computed alone or among others."""
    opts = OPTIONS["all"]
    args = inputs(6, 257, 40, torch.float32, seed=11)
    run = lambda a: call(lambda *x, **kw: interpreted.decode_linear(  # noqa: E731
        *x, block_n=16, block_k=32, split_k=split_k, serial=False, **kw), a, opts)
    full = run(args)
    expected = call(interpreted.module.decode_linear_reference, args, opts)
    torch.testing.assert_close(full, expected, rtol=1e-4, atol=1e-4)
    alone = run([a[2:3] if isinstance(a, torch.Tensor) and a.shape[0] == 6 else a for a in args])
    assert torch.equal(alone, full[2:3])
    # the splits added by each tile's last program instead of a second kernel: the same bits, and
    # the tiles' counters back at zero for the next call
    serial = call(lambda *x, **kw: interpreted.decode_linear(
        *x, block_n=16, block_k=32, split_k=split_k, serial=True, **kw), args, opts)
    assert torch.equal(serial, full)
    assert not interpreted.module._COUNTERS.get(torch.device("cpu"), torch.zeros(1)).any()
    with pytest.raises(AssertionError, match="multiple of block_k"):
        interpreted.decode_linear(args[0], args[1], block_k=32, split_k=48)


@needs_triton
def test_interpreted_kv_write_fills_the_caches_as_a_scatter_would(interpreted):
    """A fused q/k/v projection with kv_write: its output as without, and its key and value
    columns in the caches at each row's slot (the scratch slot too), nothing else touched."""
    B, T, H, Dh, S = 2, 3, 2, 16, 10
    x, weight, bias, ln, _ = inputs(B * T, 32, 3 * H * Dh, torch.float32, seed=7)
    pos = torch.tensor([[0, 1, 2], [4, 9, 7]])
    k_cache, v_cache = torch.randn(B, H, S, Dh), torch.randn(B, H, S, Dh)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    plain = interpreted.decode_linear(x, weight, bias, layer_norm=ln, block_n=32, block_k=32)
    got = interpreted.decode_linear(x, weight, bias, layer_norm=ln, kv_write=(k_cache, v_cache, pos),
                                    block_n=32, block_k=32)
    assert torch.equal(got, plain)
    q, k, v = (t.view(B, T, H, Dh).transpose(1, 2) for t in plain.chunk(3, dim=-1))
    index = pos[:, None, :, None].expand_as(k)
    k_expected.scatter_(2, index, k)
    v_expected.scatter_(2, index, v)
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)


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


@on_cuda
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("name", LARGE_V3)
def test_cuda_rows_are_independent_and_match_reference(name, dtype):
    from specwhisper.backends import ops  # noqa: F401 (the compiled kernels' import path)
    from specwhisper.backends.ops import _import_kernels

    kernel = _import_kernels("decode_ops")

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


@on_cuda
@pytest.mark.parametrize("name", ["fc1", "fc2"])
def test_cuda_serial_reductions_equal_the_second_kernels_across_calls_and_graph_replays(name):
    """The splits added by each tile's last program (one launch) give the epilogue kernel's bits,
    call after call (the tiles' counters back at zero) and in a captured CUDA graph's replays; the
    attention's chunks combined serially give the combine kernel's."""
    from specwhisper.backends.ops import _import_kernels

    kernel = _import_kernels("decode_ops")
    K, N, opts = LARGE_V3[name]
    for rows in (1, 5, 40):
        args = inputs(rows, K, N, torch.float16, seed=rows, device="cuda")
        lin = lambda serial: call(lambda *a, **kw: kernel.decode_linear(  # noqa: E731
            *a, split_k=1024, serial=serial, **kw), args, opts)
        expected = lin(False)
        for _ in range(3):
            assert torch.equal(lin(True), expected), rows
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = lin(True)
        for _ in range(3):
            captured.zero_()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(captured, expected), rows
    # the attention's chunks combined serially: the combine kernel's bits (1500 audio frames, 9 queries)
    q, k, v, n = attention_inputs(4, 20, 9, 1500, 64, torch.float16, seed=1, device="cuda", full=True)
    expected = kernel.decode_attention(q, k, v, n, serial=False)
    for _ in range(3):
        assert torch.equal(kernel.decode_attention(q, k, v, n, serial=True), expected)


# --- the decoder on the GPU decode ops (Whisper.fuse_decode_ops) ------------------------------------

def decoder_pair(folder, device, dtype, kernel):
    """(plain, fused) loaded models of one checkpoint and a filled cache for each."""
    from specwhisper.engine.decoding import LoadedModel
    from specwhisper.model.whisper import DecoderCache

    plain, fused = (LoadedModel.load(folder, torch.device(device), dtype) for _ in range(2))
    fused.model.fuse_decode_ops(kernel)
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

    class Counting:  # the fused layers must run the kernels: 6 linears and 2 attentions a layer
        calls = 0

        def decode_linear(self, *args, **kwargs):
            Counting.calls += 1
            return interpreted.decode_linear(*args, **kwargs)

        def decode_attention(self, *args, **kwargs):
            Counting.calls += 1
            return interpreted.decode_attention(*args, **kwargs)

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
    assert Counting.calls == 8 * 2 * 2
    logits = lambda m, h: m.model.decoder.logits(h)  # noqa: E731
    assert torch.equal(logits(fused, h_fused).argmax(-1), logits(plain, h_plain).argmax(-1))


def verify_and_steps(tmp_path, device, dtype, kernel, d_model):
    """A random checkpoint's decoder on the decode ops after a 4-token prompt: the hidden states of
    5 tokens in one pass, and of the same tokens in 5 one-token passes from a copy of the cache."""
    from checkpoints import make_checkpoint
    from specwhisper.model.whisper import DecoderCache

    folder = make_checkpoint(tmp_path / "ckpt", vocab_size=51865, d_model=d_model, decoder_layers=2, heads=4)
    _, fused, (_, cache) = decoder_pair(folder, device, dtype, kernel)
    prompt = torch.tensor([[50258, 50259, 50359, 50363]] * 2, device=device)
    fused.model.decoder.hidden(prompt, torch.arange(4, device=device).expand(2, 4).contiguous(), cache)
    tokens = torch.randint(0, 50000, (2, 5), generator=torch.Generator().manual_seed(4)).to(device)
    copy = DecoderCache(*(t.clone() for t in cache.buffers()))
    pos = (4 + torch.arange(5, device=device)).expand(2, 5).contiguous()
    decoder = fused.model.decoder
    one_pass = decoder.hidden(tokens, pos, cache)
    steps = torch.cat([decoder.hidden(tokens[:, t:t + 1], pos[:, t:t + 1].contiguous(), copy) for t in range(5)], 1)
    return one_pass, steps


@needs_triton
def test_interpreted_fused_decoder_verify_pass_equals_single_steps(interpreted, tmp_path):
    """Rows and queries independent: a 5-token pass gives each token the bits of 5 one-token steps
    (the property that makes speculative decoding exact in half precision on the GPU)."""
    one_pass, steps = verify_and_steps(tmp_path, "cpu", torch.float32, interpreted, d_model=64)
    assert torch.equal(one_pass, steps)


@on_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_fused_decoder_verify_pass_equals_single_steps(tmp_path, dtype):
    one_pass, steps = verify_and_steps(tmp_path, "cuda", dtype, None, d_model=256)
    assert torch.equal(one_pass, steps)


@on_cuda
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


# --- attention ------------------------------------------------------------------------------------

def attention_inputs(B, H, T, S, Dh, dtype, seed=0, device="cpu", full=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, Dh, generator=g) * Dh**-0.5 * 3
    k, v = torch.randn(B, H, S, Dh, generator=g), torch.randn(B, H, S, Dh, generator=g)
    n = torch.full((B, T), S) if full else torch.randint(1, S + 1, (B, T), generator=g)
    if not full:
        n[0, 0] = 1  # one slot only
        n[-1, -1] = S  # every slot
    to = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return to(q), to(k), to(v), n.to(device)


@needs_triton
@pytest.mark.parametrize("B,H,T,S,Dh,dtype", [(1, 2, 1, 7, 16, "fp32"), (2, 3, 5, 100, 32, "fp16"),
                                              (2, 2, 17, 130, 64, "fp32"), (1, 4, 3, 449, 64, "fp16")])
def test_interpreted_attention_matches_reference(interpreted, monkeypatch, B, H, T, S, Dh, dtype):
    monkeypatch.setattr(interpreted.module, "CHUNK", 64)  # several chunks a cache, combined in order
    q, k, v, n = attention_inputs(B, H, T, S, Dh, DTYPES[dtype], seed=B + T + S)
    got = interpreted.decode_attention(q, k, v, n)
    expected = interpreted.module.decode_attention_reference(q, k, v, n)
    assert got.shape == (B, T, H * Dh) and got.dtype == q.dtype
    tol = TOLERANCE[DTYPES[dtype]]
    torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol)


@needs_triton
def test_interpreted_attention_serial_combine_gives_the_combine_kernels_bits(interpreted, monkeypatch):
    """The chunks combined by each (row, head, queries) tile's last chunk program instead of the
    combine kernel: the same bits, call after call (the tiles' counters back at zero)."""
    monkeypatch.setattr(interpreted.module, "CHUNK", 32)
    q, k, v, n = attention_inputs(2, 3, 17, 130, 32, torch.float32, seed=9)
    expected = interpreted.decode_attention(q, k, v, n, serial=False)
    for _ in range(2):
        assert torch.equal(interpreted.decode_attention(q, k, v, n, serial=True), expected)
    assert not interpreted.module._COUNTERS[torch.device("cpu")].any()


@needs_triton
def test_interpreted_attention_reference_is_masked_softmax_attention(interpreted):
    """The reference itself, in float32, is torch's attention with the slots past n masked."""
    q, k, v, n = attention_inputs(2, 3, 4, 50, 32, torch.float32, seed=4)
    mask = torch.arange(50) < n[:, None, :, None]
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
    got = interpreted.module.decode_attention_reference(q, k, v, n)
    torch.testing.assert_close(got, expected.transpose(1, 2).reshape(2, 4, 96), rtol=1e-5, atol=1e-5)


@needs_triton
def test_interpreted_attention_ignores_slots_past_n(interpreted, monkeypatch):
    """Slots a query does not read (past n, a wider cache) change nothing, bit for bit."""
    monkeypatch.setattr(interpreted.module, "CHUNK", 64)
    q, k, v, n = attention_inputs(2, 2, 3, 70, 32, torch.float16, seed=5)
    n = n.clamp(max=60)
    got = interpreted.decode_attention(q, k, v, n)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 60:], v2[:, :, 60:] = 100.0, -100.0
    assert torch.equal(interpreted.decode_attention(q, k2, v2, n), got)
    wide = [torch.cat([t, torch.randn_like(t)], 2) for t in (k, v)]  # 140 slots, 3 chunks
    assert torch.equal(interpreted.decode_attention(q, *wide, n), got)


@on_cuda
@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_cuda_attention_queries_are_independent_and_match_reference(dtype):
    """large-v3's heads: 449 self slots with per-query lengths, 1500 audio frames; a query's bits
    do not depend on the other queries, rows, or the cache's width."""
    from specwhisper.backends.ops import _import_kernels

    kernel = _import_kernels("decode_ops")
    for S, full in ((449, False), (1500, True)):
        q, k, v, n = attention_inputs(4, 20, 9, S, 64, DTYPES[dtype], seed=S, device="cuda", full=full)
        got = kernel.decode_attention(q, k, v, n)
        expected = kernel.decode_attention_reference(q, k, v, n)
        tol = TOLERANCE[DTYPES[dtype]]
        torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol)
        one = kernel.decode_attention(q[1:2, :, 3:4], k[1:2], v[1:2], n[1:2, 3:4].contiguous())
        assert torch.equal(one, got[1:2, 3:4])
        five = kernel.decode_attention(q[2:3, :, 2:7], k[2:3], v[2:3], n[2:3, 2:7].contiguous())
        assert torch.equal(five, got[2:3, 2:7])


# --- the engine on the GPU decode ops (Engine(decode_ops=True)) ------------------------------------

def test_engine_refuses_decode_ops_off_cuda(tmp_path):
    from checkpoints import make_checkpoint
    from specwhisper import Engine

    folder = make_checkpoint(tmp_path / "ckpt", d_model=64, decoder_layers=1, encoder_layers=1)
    with pytest.raises(ValueError, match="decode_ops=True runs Triton kernels on a CUDA device"):
        Engine(folder, device="cpu", decode_ops=True)


def test_decode_ops_refuse_a_head_size_they_cannot_tile(tmp_path, interpreted):
    from checkpoints import make_checkpoint
    from specwhisper.engine.decoding import LoadedModel

    folder = make_checkpoint(tmp_path / "ckpt", d_model=72, heads=3, decoder_layers=1, encoder_layers=1)
    model = LoadedModel.load(folder, torch.device("cpu"), torch.float32).model
    with pytest.raises(ValueError, match="power of two >= 16, this model's is 24"):
        model.fuse_decode_ops(interpreted)
    assert model.decoder.fused_ops is None


@on_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_engine_on_decode_ops_is_token_exact_in_half_precision(tmp_path, dtype):
    """With rows and queries independent, a speculative engine in half precision (self draft and
    another draft, k = 2 and 5, 4 rows in a batch bucket) gives target-only's tokens: what torch's
    kernels cannot promise (README, GPU: near-tie flips)."""
    from checkpoints import make_checkpoint
    from specwhisper import Engine

    target = make_checkpoint(tmp_path / "target", d_model=256, decoder_layers=2, heads=4, init_std=0.05)
    draft = make_checkpoint(tmp_path / "draft", d_model=256, decoder_layers=1, heads=4, init_std=0.05,
                            encoder_from=target)
    mel = torch.randn(4, 80, 3000, generator=torch.Generator().manual_seed(0))
    plain = Engine(target, device="cuda", dtype=dtype, decode_ops=True)
    expected = [r.tokens for r in plain.transcribe(mel, language="en", max_new_tokens=40)]
    assert any(len(t) > 10 for t in expected)
    for d in (target, draft):
        engine = Engine(target, draft=d, device="cuda", dtype=dtype, decode_ops=True)
        for k in (2, 5):
            got = [r.tokens for r in engine.transcribe(mel, language="en", max_new_tokens=40, num_draft_tokens=k)]
            assert got == expected, (d.name, k)


@needs_triton
def test_interpreted_engine_on_decode_ops_speculative_equals_target_only(interpreted, tmp_path, monkeypatch):
    """The engine's graph-shaped path (rows padded to a bucket, fixed widths: what a GPU captures),
    every decoder pass on the interpreted decode ops: speculative tokens (self draft and another
    draft, k = 3, 2 rows) equal target-only's on the same ops. Engine(decode_ops=True) is
    for CUDA; here the models are switched by hand."""
    from checkpoints import make_checkpoint
    from specwhisper import Engine

    target = make_checkpoint(tmp_path / "target", d_model=64, decoder_layers=2, encoder_layers=1, heads=2,
                             init_std=0.1)
    draft = make_checkpoint(tmp_path / "draft", d_model=64, decoder_layers=1, encoder_layers=1, heads=2, init_std=0.1,
                            encoder_from=target)
    mel = torch.randn(2, 80, 3000, generator=torch.Generator().manual_seed(0))
    # the interpreter pays per program and per element: attention in chunks of 2048 slots (one per
    # cache: any fixed size keeps the property), linears over 1024 outputs a program (`block_n`
    # only splits the work: the head's 51865 outputs took 1621 programs a pass) and 64 features a
    # step, in one split (the model's width: the default 256 would compute 4x the padding)
    monkeypatch.setattr(interpreted.module, "CHUNK", 2048)

    class Wide:
        def __getattr__(self, name):
            return getattr(interpreted, name)

        def decode_linear(self, *args, **kwargs):
            return interpreted.decode_linear(*args, **{"block_n": 1024, "block_k": 64, "split_k": 0, **kwargs})

    def engine(d):
        e = Engine(target, draft=d, device="cpu", background=False, cuda_graphs=True, compact_draft=False)
        e.target.model.fuse_decode_ops(Wide())
        if e.drafter is not None:
            e.drafter.draft.model.fuse_decode_ops(Wide())
        return e

    expected = [r.tokens for r in engine(None).transcribe(mel, language="en", max_new_tokens=6)]
    assert all(len(t) >= 4 for t in expected)  # more than one verify pass a row at k = 3
    # the two windows were admitted in one prefill (rows independent on the decode ops): the
    # tokens they get admitted one at a time
    from specwhisper.engine.runner import Runner

    assert engine(None).runner.admits_together()
    monkeypatch.setattr(Runner, "admit_together", False)
    assert [r.tokens for r in engine(None).transcribe(mel, language="en", max_new_tokens=6)] == expected
    monkeypatch.setattr(Runner, "admit_together", True)
    for d in (target, draft):
        e = engine(d)
        got = [r.tokens for r in e.transcribe(mel, language="en", max_new_tokens=6, num_draft_tokens=3)]
        assert got == expected, d.name


def test_engine_default_falls_back_to_torch_ops_with_a_warning(tmp_path, monkeypatch):
    """Engine(decode_ops=None) where the backend would fuse but the model cannot be tiled (head
    size 24): a warning naming the reason, torch's ops, and the engine decodes."""
    from checkpoints import make_checkpoint
    from specwhisper import Engine
    from specwhisper.backends.cpu import CpuBackend

    folder = make_checkpoint(tmp_path / "ckpt", d_model=72, heads=3, decoder_layers=1, encoder_layers=1)
    assert Engine(folder, device="cpu").decode_ops is False  # off the GPU: never
    monkeypatch.setattr(CpuBackend, "fuses_decode_ops", lambda self, dtype: True)
    with pytest.warns(UserWarning, match="power of two >= 16.*the target decodes on torch's ops"):
        engine = Engine(folder, device="cpu")
    assert engine.decode_ops is False and engine.target.model.decoder.fused_ops is None
    mel = torch.randn(80, 3000, generator=torch.Generator().manual_seed(0))
    assert len(engine.transcribe(mel, language="en", max_new_tokens=4).tokens) > 0


@on_cuda
def test_cuda_engine_defaults_to_decode_ops_in_half_precision_and_longform_is_token_exact(tmp_path):
    """Engine() on CUDA in float16 runs the decode ops (float32: torch's ops); long-form audio (two
    windows a request, three requests decoded together, each window conditioned on the last) gives
    target-only's tokens with a self draft and another draft."""
    from checkpoints import make_checkpoint
    from specwhisper import Engine

    target = make_checkpoint(tmp_path / "target", d_model=256, decoder_layers=2, heads=4, init_std=0.05)
    draft = make_checkpoint(tmp_path / "draft", d_model=256, decoder_layers=1, heads=4, init_std=0.05,
                            encoder_from=target)
    assert Engine(target, device="cuda", dtype=torch.float32).decode_ops is False
    g = torch.Generator().manual_seed(1)
    mels = [torch.randn(80, 4500, generator=g) for _ in range(3)]  # 45 s each
    plain = Engine(target, device="cuda", dtype=torch.float16)
    assert plain.decode_ops is True and plain.target.model.decoder.fused_ops is not None
    expected = [r.tokens for r in plain.transcribe(mels, language="en", temperature=(0.0,))]
    assert all(len(t) > 10 for t in expected)
    for d in (target, draft):
        engine = Engine(target, draft=d, device="cuda", dtype=torch.float16)
        assert engine.decode_ops is True
        got = [r.tokens for r in engine.transcribe(mels, language="en", temperature=(0.0,), num_draft_tokens=3)]
        assert got == expected, d.name


@on_cuda
def test_cuda_windows_admitted_together_get_the_bits_they_get_alone(tmp_path, monkeypatch):
    """On the GPU decode ops in float16 (rows independent), windows whose prompts are one length
    share one prefill: the tokens, log-probabilities and no-speech probabilities of one-window and
    long-form requests equal those of windows admitted one at a time."""
    from checkpoints import make_checkpoint
    from specwhisper import Engine
    from specwhisper.engine.runner import Runner

    target = make_checkpoint(tmp_path / "target", d_model=256, decoder_layers=2, heads=4, init_std=0.05)
    g = torch.Generator().manual_seed(2)
    mels = [torch.randn(80, 3000, generator=g) for _ in range(4)]
    got = {}
    for together in (True, False):
        monkeypatch.setattr(Runner, "admit_together", together)
        engine = Engine(target, device="cuda", dtype=torch.float16)
        assert engine.runner.admits_together() == together
        short = engine.transcribe(mels, language="en", max_new_tokens=20)
        longform = engine.transcribe(mels[:2], language="en", timestamps=True, temperature=(0.0,), max_new_tokens=20)
        got[together] = [(r.tokens, [(s.avg_logprob, s.no_speech_prob) for s in r.segments]) for r in short + longform]
    assert got[True] == got[False]


@on_cuda
def test_cuda_draft_with_other_mel_bins_drafts_from_the_audio(tmp_path):
    """A draft with 80 mel bins and its own encoder drafting a 128-bin target on CUDA in float16
    (tiny drafting large-v3): from audio, the draft drafts and the tokens are target-only's."""
    from checkpoints import make_checkpoint
    from specwhisper import Engine

    target = make_checkpoint(tmp_path / "v3", vocab_size=51866, n_mels=128, d_model=256, heads=4, init_std=0.05)
    draft = make_checkpoint(tmp_path / "tiny", vocab_size=51865, n_mels=80, d_model=128, heads=2, init_std=0.05)
    audio = 0.1 * torch.randn(40 * 16000, generator=torch.Generator().manual_seed(4))
    plain = Engine(target, device="cuda", dtype=torch.float16)
    drafted = Engine(target, draft=draft, device="cuda", dtype=torch.float16)
    for options in (dict(language="en", max_new_tokens=20), dict(language="en", temperature=(0.0,))):
        x = audio[:20 * 16000] if "max_new_tokens" in options else audio
        expected = plain.transcribe(x, **options)
        got = drafted.transcribe(x, num_draft_tokens=3, **options)
        assert got.tokens == expected.tokens and got.stats.draft_passes > 0 and got.stats.draft_skipped is None
