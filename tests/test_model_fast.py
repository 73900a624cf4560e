"""The CPU decode ops (`cpu_ops`, csrc/decode_ops.cpp) against their PyTorch references, and the
properties exact speculation rests on: a row's hidden states do not depend, bit for bit, on the
other rows of the batch or on how many positions run at once (fp32 and bf16); the bf16 engine is
exact relative to itself (speculative == target-only)."""
from __future__ import annotations

import contextlib
import os

import pytest
import torch

from specwhisper import Engine
from specwhisper.backends import cpu_ops
from specwhisper.engine.decoding import LoadedModel
from specwhisper.model.head import ScreenedHead
from specwhisper.model.whisper import DecoderCache


@pytest.fixture(autouse=True)
def inference():
    """The C++ decode ops serve inference only (with gradients on, the PyTorch path runs)."""
    with torch.inference_mode():
        yield


needs_ops = pytest.mark.skipif(cpu_ops._ops() is None, reason="C++ decode ops unavailable")
pytestmark = needs_ops


@pytest.fixture(scope="module")
def head64(ckpt_dir):
    """Head size 64 (every real Whisper): the vectorised attention path."""
    return ckpt_dir("head64", vocab_size=51865, n_mels=80, d_model=128, heads=2, seed=5)


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("K", [3, 8, 37, 512])
def test_linear_matches_reference(wdtype, K):
    gen = torch.Generator().manual_seed(K)
    weight = torch.randn(23, K, generator=gen).to(wdtype)
    bias = torch.randn(23, generator=gen).to(wdtype)
    for M in [1, 2, 3, 4, 5, 7, 10]:
        x = torch.randn(M, K, generator=gen).to(wdtype)
        out = cpu_ops.linear(x, weight, bias)
        assert out.dtype == wdtype and out.shape == (M, 23)
        ref = cpu_ops.linear_reference(x, weight, bias)
        tol = 1e-5 if wdtype == torch.float32 else 1e-2
        torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * K**0.5)
        # each row alone gives the same bits as inside the block
        for m in range(M):
            assert torch.equal(cpu_ops.linear(x[m:m + 1], weight, bias), out[m:m + 1])


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("K", [520, 1030, 2048])
def test_linear_output_does_not_depend_on_the_rows_tile(wdtype, K):
    """A thread's weight rows are read as four strided streams (row n shares a tile with rows a
    quarter of the range apart; the last N % 4 rows are single dot products): each output must be
    the same bits whatever rows surround it. Slices of the weight move every row to another tile,
    quarter or tail; 1 and 3 to 9 input rows take every tile shape (AVX2 and AVX-512: up to 9 rows in one group; the
    AVX2 halves of 4-5 rows, 512 features at a time: 520 = 512 + 8, 1030 = 2 x 512 + 6, the last a
    scalar tail, 2048 = 4 x 512), and each row is the bits it has alone."""
    gen = torch.Generator().manual_seed(11)
    weight = torch.randn(203, K, generator=gen).to(wdtype)
    for M in [1, 3, 4, 5, 6, 7, 8, 9]:
        x = torch.randn(M, K, generator=gen)
        for level in (2, 1):
            with cpu_ops.vector_level(level):
                full = cpu_ops.linear(x, weight)
                for i in range(M):
                    assert torch.equal(cpu_ops.linear(x[i:i + 1], weight), full[i:i + 1]), (M, level, i)
                for a, b in [(0, 1), (1, 2), (5, 9), (3, 50), (100, 203), (7, 201)]:
                    assert torch.equal(cpu_ops.linear(x, weight[a:b].contiguous()), full[:, a:b]), (M, level, a, b)


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("K,N", [(72, 61), (520, 61), (2048, 61), (132, 203), (520, 203), (2048, 203), (132, 1001)])
def test_linear_blocks_of_many_rows_give_each_rows_bits(wdtype, K, N):
    """16 rows and more (a prompt pass, cross K/V, a window's logits) run in blocks of rows that
    fit in L2 (96 KB of features: 45 rows of 520 features, 12 of 2048, 339 of 72), each block
    against every weight tile in groups of 3 (AVX2; float16 and bfloat16 tiles widened first where a
    block has 24 rows or more: not for K = 2048), or with AVX-512 in groups of 6 against blocks
    of 16 tiles two at a time (203 outputs: 50 tiles, so whole and partial blocks, an odd tile
    left; K = 132: a scalar tail after the groups of 8); with full-width AVX-512 the blocks' tiles
    paired in float32 first (8 tiles a block for K = 2048, 62 for K = 132: 2048 x 203 and 132 x
    1001 have several blocks a thread, partial and odd): every output is still the bits of its row
    alone, across whole blocks, a last partial block and a last partial group, at each level."""
    gen = torch.Generator().manual_seed(K)
    weight = torch.randn(N, K, generator=gen).to(wdtype)
    bias = torch.randn(N, generator=gen)
    x = torch.randn(350, K, generator=gen)
    for M in [16, 29, 50, 350]:
        for level in (2, 1):
            with cpu_ops.vector_level(level):
                full = cpu_ops.linear(x[:M], weight, bias)
                rows = range(M) if M < 100 else range(0, M, 7)
                for i in rows:
                    assert torch.equal(cpu_ops.linear(x[i:i + 1], weight, bias), full[i:i + 1]), (M, level, i)
                assert torch.equal(cpu_ops.linear(x[:M], weight[5:40].contiguous(), bias[5:40]), full[:, 5:40])


@pytest.mark.parametrize("K", [3, 64, 100, 300, 512])  # 3, 100, 300: scalar tails after the groups of 8
def test_float16_weights_give_the_bits_of_their_float32_values(K):
    """float16 weights are widened exactly where they are read (F16C; AVX-512; the scalar twin):
    every output equals, bit for bit, the product with the same values stored in float32, at
    every vector level, for 1..9 rows (every tile shape) and a bias, with rows in quarter tiles
    and tails (203 outputs)."""
    gen = torch.Generator().manual_seed(K)
    w16 = (torch.randn(203, K, generator=gen) * 0.3).to(torch.float16)
    w32 = w16.float()
    bias = torch.randn(203, generator=gen)
    x = torch.randn(9, K, generator=gen)
    first = None
    for level in (2, 1, 0):
        with cpu_ops.vector_level(level):
            for M in range(1, 10):
                half = cpu_ops.linear(x[:M], w16, bias)
                assert half.dtype == torch.float32
                assert torch.equal(half, cpu_ops.linear(x[:M], w32, bias)), (level, M)
            first = half if first is None else first
            assert torch.equal(half, first), level


def test_ops_run_on_every_thread_with_thread_independent_bits():
    """The extension is built with OpenMP (else at::parallel_for silently runs one thread), and a
    result never depends on how many threads computed it."""
    before = torch.get_num_threads()
    gen = torch.Generator().manual_seed(1)
    weight, x = torch.randn(4099, 512, generator=gen), torch.randn(5, 512, generator=gen)
    try:
        torch.set_num_threads(2)
        assert cpu_ops._ops().parallel_threads() == 2
        two = cpu_ops.linear(x, weight)
        torch.set_num_threads(1)
        assert cpu_ops._ops().parallel_threads() == 1
        assert torch.equal(cpu_ops.linear(x, weight), two)
    finally:
        torch.set_num_threads(before)


def test_ops_in_another_thread_run_on_the_extensions_pool_with_the_same_bits():
    """Outside the main thread the ops' sections run on their own workers (decode_ops.cpp's
    SpinPool): two threads, and every result bit-identical to the main thread's, also with
    several threads calling at once (one of them then computes alone)."""
    import threading

    gen = torch.Generator().manual_seed(2)
    weight, x = torch.randn(4099, 512, generator=gen), torch.randn(5, 512, generator=gen)
    head = ScreenedHead(torch.randn(8000, 512, generator=gen))
    expected = (cpu_ops.linear(x, weight), head.argmax(x))
    seen, errors = [], []

    def work():
        try:
            with torch.inference_mode():
                for _ in range(20):
                    seen.append((cpu_ops._ops().parallel_threads(), cpu_ops.linear(x, weight), head.argmax(x)))
        except Exception as exc:  # reported below
            errors.append(exc)

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        threads = [threading.Thread(target=work) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        torch.set_num_threads(before)
    assert not errors and len(seen) == 60
    assert max(n for n, _, _ in seen) == 2
    assert all(torch.equal(a, expected[0]) and torch.equal(b, expected[1]) for _, a, b in seen)


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K", [96, 100])  # 100: each dot product ends with a scalar tail
def test_every_vector_level_gives_the_same_bits(wdtype, K):
    """The scalar, AVX2 and AVX-512 forms of the ops compute the same operations in the same
    order (the determinism contract of csrc/decode_ops.cpp): equal bits, whichever path a CPU
    takes. A level the CPU lacks runs the best it has. 7 input rows and 3 queries: the tiles'
    sums are taken two rows at a time and for a lone row (`hsum8_many`)."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(1003, K, generator=gen).to(wdtype)
    bias = torch.randn(1003, generator=gen)
    x = torch.randn(7, K, generator=gen)
    q = torch.randn(2, 3, 4, 64, generator=gen)
    kc, vc = (torch.randn(2, 4, 300, 64, generator=gen).to(wdtype) for _ in range(2))
    n_keys = torch.tensor([[300, 17, 1], [5, 299, 64]])
    ids = torch.randint(0, 1003, (7, 5), generator=gen)
    results = []
    for level in (2, 1, 0):
        with cpu_ops.vector_level(level):
            out = [cpu_ops.linear(x, weight, bias), cpu_ops.attention(q, kc, vc, n_keys, 0.125)]
            if wdtype == torch.float32:
                out.append(cpu_ops.gather_dot(x, weight, ids))
            results.append(out)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [7, 64, 100, 512])  # 7, 100: a scalar tail after the groups of 8
def test_layer_norm_and_gelu_match_reference_with_the_same_bits_at_every_level(dtype, d):
    """The step's own layer norm and gelu equal torch's to float rounding (the gelu's erf is
    Abramowitz & Stegun 7.1.26, within 1.5e-7), and the scalar, AVX2 and AVX-512 forms give
    equal bits."""
    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(6, d, generator=gen) * 3 + 1).to(dtype)
    weight, bias = torch.randn(d, generator=gen).to(dtype), torch.randn(d, generator=gen).to(dtype)
    values = torch.cat([torch.linspace(-12, 12, 4001), torch.tensor([-1e30, -100.0, -0.0, 0.0, 1e-30, 100.0, 1e30]),
                        torch.randn(3 * d, generator=gen) * 4]).to(dtype)
    results = []
    for level in (2, 1, 0):
        with cpu_ops.vector_level(level):
            results.append((cpu_ops.layer_norm(x, weight, bias, 1e-5), cpu_ops.gelu(values)))
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))
    norm, gelu = results[0]
    tol = 2e-6 if dtype == torch.float32 else 2.0**-7
    ref = cpu_ops.layer_norm_reference(x, weight, bias, 1e-5).float()
    assert (norm.float() - ref).abs().max() <= tol * ref.abs().max()
    ref = cpu_ops.gelu_reference(values).float()
    big = values.float().abs() > 1e20  # 1e30: the product overflows inside torch's formula too
    assert torch.equal(gelu.float()[big], ref[big])
    assert ((gelu.float() - ref).abs() <= tol * ref.abs().clamp(min=1.0))[~big].all()


def test_vector_level_from_the_environment():
    """SPECWHISPER_VECTOR_LEVEL holds the ops to a level from their first use (bench/cpu.py
    --vector-level 1 measures an AVX2-only CPU that way); a value outside 0..2 is refused."""
    import os
    import subprocess
    import sys

    probe = ("from specwhisper.backends import cpu_ops\n"
             "try:\n    ops = cpu_ops._ops()\nexcept ValueError as exc:\n    print('refused', exc)\n"
             "else:\n    print('level', ops.set_vector_level(2))")
    for value, expected in (("0", "level 0"), ("1", "level 1"), ("avx2", "refused")):
        env = dict(os.environ, SPECWHISPER_VECTOR_LEVEL=value)
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
        assert out.stdout.startswith(expected), (value, out.stdout, out.stderr[-2000:])


@pytest.mark.parametrize("M", [1, 2, 3, 5, 9, 17, 40])
def test_int8_linear_matches_reference_at_every_vector_level(M):
    """An int8 draft's projections (`linear_q8`, rows rounded to 16 bits, exact integer products):
    the reference's bits at every vector level (AVX-512 with and without VNNI, AVX2, scalar), for
    each row alone as inside the block (a step's few rows quantized by each thread, a prompt's many
    once), zero and non-finite rows as the reference makes them; the float product of the int8
    weights within the rounding's bound (half a step s_m per feature: 0.5 s_m sum_k |q_nk| scale_n)."""
    from specwhisper.model.head import pack_int8, q16_range

    gen = torch.Generator().manual_seed(M)
    K = 136 if M < 40 else 2048  # q16_range(2048) = 8256: the rounding's range shrinks with K
    weight = torch.randn(96, K, generator=gen)
    weight[3] *= 40  # rows with their own scales
    packed, scale = pack_int8(weight)
    bias = torch.randn(96, generator=gen)
    x = torch.randn(M, K, generator=gen)
    x[0, 5] = 30.0  # one large feature: the others keep fewer bits
    if M > 2:
        x[1] = 0.0
        x[2, 7] = float("nan")
    if M > 3:
        x[3, 9] = float("-inf")
    ref = cpu_ops.linear_q8_reference(x, packed, scale, bias)
    q = packed.transpose(1, 2).reshape(96, K).float()
    dequantized = x @ (q * scale[:, None]).T + bias
    ok = torch.isfinite(x).all(dim=1)
    step = x.abs().amax(dim=1, keepdim=True) / q16_range(K)
    bound = 0.5 * step * (q.abs().sum(dim=1) * scale)[None] + 1e-5 * dequantized.abs() + 1e-5
    assert ((ref - dequantized).abs() <= bound)[ok].all()
    assert not torch.equal(ref[ok], dequantized[ok])  # really rounded
    if M > 2:
        assert torch.equal(ref[1], bias) and ref[2].isnan().all()
    outs = []
    for level, vnni in ((2, True), (2, False), (1, True), (1, False), (0, True)):
        with cpu_ops.vector_level(level), (contextlib.nullcontext() if vnni else cpu_ops.without_vnni()):
            outs.append(cpu_ops.linear_q8(x, packed, scale, bias))
    for o in outs:
        assert torch.equal(o[ok], ref[ok]) and o[~ok].isnan().all()
    for m in range(M):
        one = cpu_ops.linear_q8(x[m:m + 1], packed, scale, bias)
        assert torch.equal(one, outs[0][m:m + 1]) or (one.isnan().all() and not ok[m])
    with pytest.raises(ValueError, match="multiples of 8"):
        pack_int8(torch.randn(10, 16))


def test_gather_dot_equals_linear_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(1000, 77, generator=gen)
    x = torch.randn(6, 77, generator=gen)
    full = cpu_ops.linear(x, weight, None, torch.float32)
    ids = torch.randint(0, 1000, (6, 9), generator=gen)
    assert torch.equal(cpu_ops.gather_dot(x, weight, ids), full.gather(1, ids))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [16, 64])
@pytest.mark.parametrize("T", [5, 9, 17])  # 17 queries: AVX-512 sums the values in groups of 8
def test_attention_matches_reference(dtype, D, T):
    gen = torch.Generator().manual_seed(D + T)
    B, H, S = 3, 2, 40
    q = torch.randn(B, T, H, D, generator=gen).to(dtype)
    k = torch.randn(B, H, S, D, generator=gen).to(dtype)
    v = torch.randn(B, H, S, D, generator=gen).to(dtype)
    n_keys = torch.randint(1, S + 1, (B, T), generator=gen)
    out = cpu_ops.attention(q, k, v, n_keys, D**-0.5)
    ref = cpu_ops.attention_reference(q.float(), k.float(), v.float(), n_keys, D**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
    # a query's output does not depend on the others
    for b in range(B):
        for t in range(T):
            one = cpu_ops.attention(q[b:b + 1, t:t + 1], k[b:b + 1], v[b:b + 1], n_keys[b:b + 1, t:t + 1], D**-0.5)
            assert torch.equal(one[0, 0], out[b, t])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [2, 5, 6, 7, 9, 17])
def test_attention_value_chunks_keep_each_querys_bits(dtype, T):
    """Several queries sum their values in one pass over chunks of 64 value rows (csrc:
    softmax_values_chunked_avx2), with AVX-512 in one pass over the rows (2..9 queries in groups
    of up to 6: values512) or in groups of 8 (more): over 150 keys (three chunks, the last
    partial) with each query's own number of keys, within or across chunks, every output has the
    bits of that query alone, of the AVX2 and the scalar levels, and matches the reference."""
    gen = torch.Generator().manual_seed(T)
    B, H, S, D = 2, 3, 150, 64
    q = torch.randn(B, T, H, D, generator=gen)
    k, v = (torch.randn(B, H, S, D, generator=gen).to(dtype) for _ in range(2))
    n_keys = torch.randint(1, S + 1, (B, T), generator=gen)
    n_keys[0, 0], n_keys[-1, -1] = 64, S  # a chunk's edge, all keys
    out = cpu_ops.attention(q, k, v, n_keys, 0.125)
    for level in (1, 0):
        with cpu_ops.vector_level(level):
            assert torch.equal(out, cpu_ops.attention(q, k, v, n_keys, 0.125))
    for b in range(B):
        for t in range(T):
            one = cpu_ops.attention(q[b:b + 1, t:t + 1], k[b:b + 1], v[b:b + 1], n_keys[b:b + 1, t:t + 1], 0.125)
            assert torch.equal(one[0, 0], out[b, t])
    torch.testing.assert_close(out, cpu_ops.attention_reference(q, k.float(), v.float(), n_keys, 0.125),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,S,D", [(16, 150, 64), (17, 77, 16), (40, 7, 64), (19, 64, 24), (33, 300, 40)])
def test_many_queries_score_packed_keys_with_each_querys_bits(dtype, T, S, D):
    """From 16 queries (a prompt pass) the scores come from keys packed transposed in blocks of 32
    (csrc: many_scores_avx2): blocks cut short, a last group of fewer than 8 keys, head dims that
    are multiples of 8 but not of 64; every output has the bits of that query alone (the tiles'
    dot products), of the scalar level, and matches the reference."""
    gen = torch.Generator().manual_seed(T + S + D)
    B, H = 2, 3
    q = torch.randn(B, T, H, D, generator=gen)
    k, v = (torch.randn(B, H, S, D, generator=gen).to(dtype) for _ in range(2))
    n_keys = torch.randint(1, S + 1, (B, T), generator=gen)
    n_keys[0, 0], n_keys[-1, -1] = S, 1
    out = cpu_ops.attention(q, k, v, n_keys, D**-0.5)
    with cpu_ops.vector_level(0):
        assert torch.equal(out, cpu_ops.attention(q, k, v, n_keys, D**-0.5))
    for b in range(B):
        for t in range(T):
            one = cpu_ops.attention(q[b:b + 1, t:t + 1], k[b:b + 1], v[b:b + 1], n_keys[b:b + 1, t:t + 1], D**-0.5)
            assert torch.equal(one[0, 0], out[b, t])
    torch.testing.assert_close(out, cpu_ops.attention_reference(q, k.float(), v.float(), n_keys, D**-0.5),
                               rtol=1e-5, atol=1e-5)


def test_attention_reads_bfloat16_caches_with_float32_queries():
    """A compact draft's cross K/V are bfloat16 while its queries are float32: the op widens them
    exactly, so the result has the bits of float32 caches holding the same values."""
    torch.manual_seed(3)
    q = torch.randn(2, 3, 4, 64)
    k, v = (torch.randn(2, 4, 40, 64).bfloat16() for _ in range(2))
    n_keys = torch.tensor([[40, 17, 1], [5, 40, 33]])
    out = cpu_ops.attention(q, k, v, n_keys, 0.125)
    assert out.dtype == torch.float32
    assert torch.equal(out, cpu_ops.attention(q, k.float(), v.float(), n_keys, 0.125))
    torch.testing.assert_close(out, cpu_ops.attention_reference(q, k.float(), v.float(), n_keys, 0.125),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="share a dtype"):
        cpu_ops.attention(q.bfloat16(), k.float(), v.float(), n_keys, 0.125)


def test_kv_write_matches_reference():
    gen = torch.Generator().manual_seed(0)
    caches = [torch.zeros(2, 3, 10, 8) for _ in range(4)]
    k, v = torch.randn(2, 4, 3, 8, generator=gen), torch.randn(2, 4, 3, 8, generator=gen)
    pos = torch.tensor([[0, 1, 2, 3], [5, 6, 9, 9]])  # the scratch slot (9) written twice: last wins
    cpu_ops.kv_write(caches[0], caches[1], k, v, pos)
    cpu_ops.kv_write_reference(caches[2], caches[3], k, v, pos)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_commit_tokens_matches_reference():
    """The fused append of a pass's tokens equals the reference on random states: done rows, EOT
    first / inside / after the emitted prefix, budgets cutting the prefix or already reached,
    slots in any order, T = 1 (a plain step) and T = 6 (a verify pass)."""
    gen = torch.Generator().manual_seed(3)
    eot, S, L = 7, 6, 24
    for trial in range(300):
        T = 1 if trial % 3 == 0 else 6
        B = int(torch.randint(1, S + 1, (1,), generator=gen))
        slots = torch.randperm(S, generator=gen)[:B]
        n_tokens = torch.randint(1, 12, (S,), generator=gen)
        budget = n_tokens + torch.randint(0, 8, (S,), generator=gen)
        done = torch.rand(S, generator=gen) < 0.2
        tokens = torch.randint(0, 10, (S, L), generator=gen)
        choice = torch.randint(0, 10, (B, T), generator=gen)  # eot = 7: often inside
        n_emit = torch.randint(1, T + 1, (B,), generator=gen)
        ours = [t.clone() for t in (tokens, n_tokens, done)]
        ref = [t.clone() for t in (tokens, n_tokens, done)]
        m = cpu_ops.commit_tokens(*ours, budget, slots, choice, n_emit, eot)
        m_ref = cpu_ops.commit_tokens_reference(*ref, budget, slots, choice, n_emit, eot)
        assert torch.equal(m, m_ref), trial
        for a, b in zip(ours, ref):
            assert torch.equal(a, b), trial
    assert cpu_ops.active(tokens)  # the fused op ran, not the reference twice


def test_commit_tokens_refuses_a_row_past_its_buffer():
    tokens, n, done = torch.zeros(1, 4, dtype=torch.long), torch.tensor([3]), torch.tensor([False])
    with pytest.raises(RuntimeError, match="past its buffer"):
        cpu_ops.commit_tokens(tokens, n, done, torch.tensor([9]), torch.tensor([0]), torch.tensor([[1, 2]]),
                              torch.tensor([2]), 7)


def decoder_setup(folder, dtype, batch, seed=0):
    model = LoadedModel.load(folder, "cpu", dtype)
    gen = torch.Generator().manual_seed(seed)
    cfg = model.config
    features = torch.randn(batch, cfg.max_source_positions, cfg.d_model, generator=gen).to(dtype)
    return model, features, gen


def fresh_cache(model, features, dtype):
    cache = DecoderCache.allocate(model.config, features.shape[0], "cpu", dtype)
    model.model.decoder.fill_cross(cache, features)
    return cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoder_hidden_matches_reference(head64, dtype):
    model, features, gen = decoder_setup(head64, dtype, batch=2)
    dec = model.model.decoder
    tokens = torch.randint(0, 50000, (2, 12), generator=gen)
    # rows at different positions; the last one past the end (scratch slot)
    pos = torch.stack([torch.arange(12), torch.arange(440, 452).clamp(max=449)])
    with torch.inference_mode():
        fast_cache, ref_cache = fresh_cache(model, features, dtype), fresh_cache(model, features, dtype)
        fast = dec.hidden(tokens, pos, fast_cache)
        with cpu_ops.reference():
            ref = dec.hidden(tokens, pos, ref_cache)
    if dtype == torch.float32:
        torch.testing.assert_close(fast, ref, rtol=2e-4, atol=2e-4)
        torch.testing.assert_close(fast_cache.self_k, ref_cache.self_k, rtol=2e-4, atol=2e-4)
    else:
        # the reference rounds intermediate results (attention, products) to bf16 where the fast
        # ops keep fp32 until each op's output: both err alike against an fp32 run (measured
        # mean 0.018, max 0.15-0.17 here); they differ by a few bf16 steps of the overall scale
        for a, b in ((fast, ref), (fast_cache.self_k, ref_cache.self_k)):
            diff, scale = (a.float() - b.float()).abs(), b.float().abs().max()
            assert diff.max() <= 0.05 * scale and diff.mean() <= 0.005 * scale, (diff.max(), diff.mean(), scale)
    # fast logits and greedy equal the slow path's on these hidden states
    with torch.inference_mode():
        logits = model.logits(fast)
        with cpu_ops.reference():
            slow = model.logits(fast)
    # bfloat16: the reference rounds each logit to bf16 (relative 2^-8); the fast head does not
    tol = 1e-4 if dtype == torch.float32 else 2.0**-7
    torch.testing.assert_close(logits, slow, rtol=tol, atol=tol * slow.abs().max().item())


@pytest.mark.parametrize("dtype,compact", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)])
def test_fused_step_equals_layer_by_layer(head64, dtype, compact, monkeypatch):
    """`cpu_ops.decoder_layers` (every layer in one C++ call) gives the bits of the per-layer
    `forward_rows` loop: hidden states and caches, rows at different positions, the scratch slot."""
    from specwhisper.model.whisper import Decoder

    model, features, gen = decoder_setup(head64, dtype, batch=2)
    if compact:
        model.model.compact_decoder()
    dec = model.model.decoder
    tokens = torch.randint(0, 50000, (2, 5), generator=gen)
    pos = torch.stack([torch.arange(30, 35), torch.arange(445, 450).clamp(max=448)])
    out = []
    for fused in (True, False):
        monkeypatch.setattr(Decoder, "fused_step", fused)
        cache = fresh_cache(model, features, dtype)
        dec.hidden(torch.randint(0, 50000, (2, 30), generator=torch.Generator().manual_seed(1)),
                   torch.arange(30).expand(2, 30), cache)
        out.append((dec.hidden(tokens, pos, cache, kv_len=450), cache))
    (a, ca), (b, cb) = out
    assert torch.equal(a, b)
    assert all(torch.equal(x, y) for x, y in zip(ca.buffers(), cb.buffers()))


@pytest.mark.parametrize("form", ["float32", "half", "compact", "int8"])
def test_keeping_the_last_positions_gives_their_bits_and_every_cache_entry(head64, form):
    """`Decoder.hidden(keep=k)` (the C++ step's last layer past its key/value projections for the
    last k positions only: a long-form prompt pass) gives the bits of the whole pass's last k
    positions and the same caches, for the target's forms (float32, float16-valued projections) and
    the drafts' (compact: bfloat16; int8), rows at different positions, the many-row paths (40
    rows) against a few; at every vector level. keep >= T is the whole pass; keep < 1 is refused."""
    model, features, gen = decoder_in_form(head64, form)
    dec = model.model.decoder
    tokens = torch.randint(0, 50000, (2, 20), generator=gen)
    pos = torch.stack([torch.arange(20), torch.arange(7, 27)])
    for level in range(cpu_ops._ops().vector_level() + 1):
        with cpu_ops.vector_level(level):
            whole_cache = fresh_cache(model, features, torch.float32)
            whole = dec.hidden(tokens, pos, whole_cache, kv_len=30)
            for keep in (1, 3, 19):
                cache = fresh_cache(model, features, torch.float32)
                part = dec.hidden(tokens, pos, cache, kv_len=30, keep=keep)
                assert part.shape == (2, keep, whole.shape[-1])
                assert torch.equal(part, whole[:, -keep:]), (level, keep)
                assert all(torch.equal(x, y) for x, y in zip(cache.buffers(), whole_cache.buffers())), (level, keep)
            assert torch.equal(dec.hidden(tokens, pos, fresh_cache(model, features, torch.float32), kv_len=30,
                                          keep=20), whole)
    with pytest.raises(ValueError, match="keep"):
        dec.hidden(tokens, pos, fresh_cache(model, features, torch.float32), keep=0)


@pytest.mark.parametrize("form", ["float32", "half", "int8", "compact"])
def test_lean_step_gives_the_general_paths_bits(head64, form):
    """The C++ step's lean path (`decoder_layers_lean`: raw pointers, the biases, int8 scales, gelu
    and residual adds in the linears' own sections) gives the bits of its general path (tensor ops,
    those after each linear on the calling thread): hidden states and both caches, for the target's
    forms (float32, float16-valued projections) and the int8 drafts', 1..9 rows and a prompt's 20
    with the last positions kept, two rows at different positions (one into the scratch slot), at
    every vector level. A compact bfloat16 decoder (bfloat16 biases) takes the general path."""
    model, features, gen = decoder_in_form(head64, form)
    dec, calls = model.model.decoder, cpu_ops._ops().lean_step_calls
    prompt = torch.randint(0, 50000, (2, 6), generator=gen)
    for level in range(cpu_ops._ops().vector_level() + 1):
        with cpu_ops.vector_level(level):
            for T, keep in ((1, None), (2, None), (5, None), (9, None), (20, 3)):
                tokens = torch.randint(0, 50000, (2, T), generator=gen)
                pos = torch.stack([torch.arange(6, 6 + T), torch.arange(440, 440 + T).clamp(max=448)])
                out = []
                for lean in (True, False):
                    with cpu_ops.lean_step(lean):
                        before = calls()
                        cache = fresh_cache(model, features, torch.float32)
                        dec.hidden(prompt, torch.arange(6).expand(2, 6), cache)
                        out.append((dec.hidden(tokens, pos, cache, kv_len=450, keep=keep), cache, calls() - before))
                (a, ca, ran), (b, cb, ran_general) = out
                assert torch.equal(a, b), (level, T)
                assert all(torch.equal(x, y) for x, y in zip(ca.buffers(), cb.buffers())), (level, T)
                assert ran_general == 0 and (ran == 2) == (form != "compact") and ran in (0, 2), (form, ran)


def test_weight_stream_prefetch_choice_keeps_the_bits(head64):
    """Prefetching the weight streams to L2 (Intel's default) or non-temporally (elsewhere) reads the
    same weights: a step's hidden states and caches (float16-valued and int8 projections, 1, 5 and
    20 rows) and the screened head's tokens are the same bits at every vector level; the default
    follows the CPU's vendor, and the choice is restored after the block."""
    from specwhisper.model.head import ScreenedHead

    from test_encoder_cpu import _cpuinfo  # /proc/cpuinfo's first processor, read apart from the ops' cpuid

    vendor = _cpuinfo().get("vendor_id")
    assert cpu_ops.stream_prefetch_l2() == (vendor == "GenuineIntel")
    gen = torch.Generator().manual_seed(3)
    head = ScreenedHead(torch.randn(5000, 64, generator=gen))
    hidden = torch.randn(9, 64, generator=gen) * 3
    for form in ("half", "int8"):
        model, features, gen = decoder_in_form(head64, form)
        dec = model.model.decoder
        prompt = torch.randint(0, 50000, (2, 6), generator=gen)
        for level in range(cpu_ops._ops().vector_level() + 1):
            with cpu_ops.vector_level(level):
                for T in (1, 5, 20):
                    tokens = torch.randint(0, 50000, (2, T), generator=gen)
                    pos = torch.arange(6, 6 + T).expand(2, T)
                    out = []
                    for l2 in (True, False):
                        with cpu_ops.stream_prefetch(l2):
                            assert cpu_ops.stream_prefetch_l2() == l2
                            cache = fresh_cache(model, features, torch.float32)
                            dec.hidden(prompt, torch.arange(6).expand(2, 6), cache)
                            out.append((dec.hidden(tokens, pos, cache, kv_len=6 + T), cache,
                                        head.argmax(hidden[:min(T, 9)])))
                    (a, ca, ta), (b, cb, tb) = out
                    assert torch.equal(a, b) and torch.equal(ta, tb), (form, level, T)
                    assert all(torch.equal(x, y) for x, y in zip(ca.buffers(), cb.buffers())), (form, level, T)
    assert cpu_ops.stream_prefetch_l2() == (vendor == "GenuineIntel")


def decoder_in_form(folder, form: str):
    """decoder_setup (float32, 2 rows) with the decoder's projections in `form`: float32, half
    (float16 values), compact (bfloat16) or int8."""
    with torch.inference_mode(False):  # float16_valued changes the weights in place
        model, features, gen = decoder_setup(folder, torch.float32, batch=2)
    if form == "half":
        float16_valued(model.model)
        assert model.model.half_projections()
    elif form == "compact":
        model.model.compact_decoder()
    elif form == "int8":
        model.model.int8_projections()
    return model, features, gen


def float16_valued(whisper) -> None:
    """Round a model's decoder projections to float16 values (what a float16 checkpoint holds,
    kept in float32), then fuse its q/k/v."""
    with torch.inference_mode(False), torch.no_grad():
        for layer in whisper.decoder.layers:
            for module in layer.modules():
                if isinstance(module, torch.nn.Linear):
                    module.weight.copy_(module.weight.half().float())
        whisper.fuse()


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 100_003])
def test_half_exact_rounds_in_one_pass_and_says_whether_every_value_came_back(n):
    """`cpu_ops.half_exact` (the float16 copies of float16-valued weights): the copy is torch's
    rounding at every vector level; it reports exact only when every value widens back to its
    float32 bits (a tail value off by one float32 step, a NaN, one too large for float16: not)."""
    from specwhisper.model.whisper import exact_half

    gen = torch.Generator().manual_seed(n)
    w = torch.randn(n, generator=gen).half().float()
    for level in (2, 1, 0):
        with cpu_ops.vector_level(level):
            h = torch.empty(n, dtype=torch.float16)
            assert cpu_ops.half_exact(w, h) and torch.equal(h, w.half())
            if n == 0:
                continue
            for bad in (torch.nextafter(w[-1], torch.tensor(float("inf"))).item(), float("nan"), 1e6):
                off = w.clone()
                off[-1] = bad
                assert not cpu_ops.half_exact(off, h)
                assert torch.equal(h[:-1], w[:-1].half())
    matrix = w[: n - n % 8].view(-1, 8) if n >= 8 else w.view(-1, 1)
    copy = exact_half(matrix)
    assert copy.dtype == torch.float16 and torch.equal(copy.float(), matrix)
    assert torch.equal(exact_half(matrix.t()).float(), matrix.t())  # a strided view: its values, copied
    if n >= 8:
        nudged = matrix + 1e-4
        assert exact_half(nudged) is nudged


def test_full_logits_read_a_float16_copy_of_a_float16_valued_head_with_the_same_bits(head64):
    """`Decoder.logits` on the CPU reads the tied head through `head_weight`: a float16 copy when
    the float32 embedding holds float16 values (half the bytes of a sampled step's head), the
    logits bit for bit those of the float32 weights; random float32 weights, or a change in place
    that leaves float16 values, read the float32 embedding itself."""
    with torch.inference_mode(False):
        model, features, gen = decoder_setup(head64, torch.float32, batch=1)
    dec = model.model.decoder
    emb = dec.embed_tokens.weight
    h = torch.randn(7, emb.shape[1], generator=gen)
    assert dec.half and dec.head_weight() is emb  # random float32 values: no copy
    with torch.inference_mode(False), torch.no_grad():
        emb.copy_(emb.half().float())
    head = dec.head_weight()
    assert head.dtype == torch.float16 and torch.equal(head.float(), emb)
    for level in range(cpu_ops._ops().vector_level() + 1):
        with cpu_ops.vector_level(level):
            assert torch.equal(dec.logits(h), cpu_ops.linear(h, emb.detach(), None, torch.float32))
    torch.testing.assert_close(dec.logits(h), h @ emb.detach().T, rtol=1e-5, atol=1e-5)
    with torch.inference_mode(False), torch.no_grad():
        emb[3, 5] += 2.0**-20  # no float16 value any more
    assert dec.head_weight() is emb
    assert torch.equal(dec.logits(h), cpu_ops.linear(h, emb.detach(), None, torch.float32))


def test_one_buffer_copies_side_by_side():
    """`one_buffer`: copies with the same values, dtypes and shapes, contiguous, 64-byte aligned,
    in one allocation (int8 blocks, float16, float32 and bfloat16, odd sizes, an empty tensor);
    the sources untouched."""
    from specwhisper.model.whisper import one_buffer

    g = torch.Generator().manual_seed(3)
    tensors = [torch.randint(-127, 128, (3, 4, 8, 8), generator=g, dtype=torch.int8),
               torch.randn(5, 7, generator=g).half(), torch.randn(13, generator=g),
               torch.randn(2, 3, generator=g).to(torch.bfloat16), torch.empty(0), torch.randn(1, generator=g)]
    before = [t.clone() for t in tensors]
    copies = one_buffer(tensors)
    storage = copies[0].untyped_storage().data_ptr()
    for t, c, b in zip(tensors, copies, before):
        assert c.dtype == t.dtype and c.shape == t.shape and c.is_contiguous()
        assert torch.equal(c, t) and torch.equal(t, b) and (c.numel() == 0 or c.data_ptr() != t.data_ptr())
        assert c.untyped_storage().data_ptr() == storage and (c.numel() == 0 or c.data_ptr() % 64 == 0)


def test_step_tensors_in_one_buffer_follow_in_place_changes(head64):
    """A float16-valued decoder's step reads copies of its tensors from one allocation
    (`Decoder.layer_params`): every tensor but float32 weights that are not float16 values, and
    a change in place of any tensor copied there (a layer norm, a bias, a projection) reaches the
    step without forget_layer_params, hidden states equal to the layer-by-layer path's."""
    from specwhisper.model.whisper import PROJECTIONS

    with torch.inference_mode(False):
        model, features, gen = decoder_setup(head64, torch.float32, batch=1)
    whisper, dec = model.model, model.model.decoder
    float16_valued(whisper)
    assert whisper.half_projections()
    params = dec.layer_params()
    assert len({t.untyped_storage().data_ptr() for t in params}) == 1  # all in one buffer
    tokens, pos = torch.randint(0, 50000, (1, 3), generator=gen), torch.arange(3)[None]

    def both():
        out = []
        for fused in (True, False):
            dec.fused_step = fused
            out.append(dec.hidden(tokens, pos, fresh_cache(model, features, torch.float32), kv_len=8))
        dec.fused_step = True
        return out

    first, _ = both()
    with torch.inference_mode(False), torch.no_grad():
        dec.layers[0].final_layer_norm.weight.mul_(1.5)  # small module tensors: copied too
        dec.layers[1].encoder_attn.out_proj.bias.add_(0.25)
    fused, layered = both()
    assert not torch.equal(fused, first) and torch.equal(fused, layered)
    with torch.inference_mode(False), torch.no_grad():
        dec.layers[1].fc2.weight[0, 0] += 2.0**-20  # no float16 value: the step reads it in place
    per = len(dec.layer_params()) // len(dec.layers)
    assert dec.layer_params()[per + 16].data_ptr() == dec.layers[1].fc2.weight.data_ptr()
    assert dec.layer_params()[per + PROJECTIONS[0]].dtype == torch.float16
    fused, layered = both()
    assert torch.equal(fused, layered)


def test_half_projections_step_has_the_float32_bits(head64, monkeypatch):
    """A float32 model whose projections hold float16 values (Whisper's checkpoints are stored in
    float16) lets its C++ step read float16 copies (`Whisper.half_projections`): hidden states and
    caches bit for bit those of the layer-by-layer float32 path (`forward_rows`), for 1..9
    positions and two rows at different positions. A weight that is not a float16 value keeps its
    float32 copy (and the step its bits); a model of random float32 weights gets none."""
    from specwhisper.model.whisper import Decoder, PROJECTIONS

    with torch.inference_mode(False):  # weights with version counters, changed in place below
        model, features, gen = decoder_setup(head64, torch.float32, batch=2)
    whisper, dec = model.model, model.model.decoder
    assert not whisper.half_projections()  # random float32 weights: nothing to store in float16
    assert all(p.dtype == torch.float32 for p in dec.layer_params())
    float16_valued(whisper)  # the weights a float16 checkpoint would hold
    assert whisper.half_projections()
    params = dec.layer_params()
    per = len(params) // len(dec.layers)
    assert {params[per * i + j].dtype for i in range(len(dec.layers)) for j in PROJECTIONS} == {torch.float16}
    assert dec.layers[0].fc1.weight.dtype == torch.float32  # the modules keep float32
    before = dec.layer_params()[per + 16]
    with torch.inference_mode(False), torch.no_grad():
        dec.layers[1].fc2.weight[0, 0] += 2.0**-20  # no float16 value any more: stays float32
    after = dec.layer_params()[per + 16]  # the change in place is seen without forget_layer_params
    assert before.dtype == torch.float16 and after.dtype == torch.float32
    assert torch.equal(after, dec.layers[1].fc2.weight)
    assert not whisper.half_projections()
    assert dec.layer_params()[per + 16].dtype == torch.float32 and dec.layer_params()[per + 14].dtype == torch.float16
    prompt = torch.randint(0, 50000, (2, 8), generator=gen)
    for T in range(1, 10):
        tokens = torch.randint(0, 50000, (2, T), generator=gen)
        pos = torch.stack([torch.arange(8, 8 + T), torch.arange(440, 440 + T).clamp(max=448)])
        out = []
        for fused in (True, False):
            monkeypatch.setattr(Decoder, "fused_step", fused)
            cache = fresh_cache(model, features, torch.float32)
            dec.hidden(prompt, torch.arange(8).expand(2, 8), cache)
            out.append((dec.hidden(tokens, pos, cache, kv_len=449), cache))
        (a, ca), (b, cb) = out
        assert torch.equal(a, b), T
        assert all(torch.equal(x, y) for x, y in zip(ca.buffers(), cb.buffers())), T


def test_fused_step_names_a_bad_token_or_position(head64):
    """The one-call step checks what the embeddings would: a token outside the vocabulary or a
    negative position is a clear error, before anything is written."""
    model, features, gen = decoder_setup(head64, torch.float32, batch=1)
    dec, vocab = model.model.decoder, model.config.vocab_size
    cache = fresh_cache(model, features, torch.float32)
    before = cache.self_k.clone()
    with pytest.raises(RuntimeError, match=f"token {vocab} outside the vocabulary"):
        dec.hidden(torch.tensor([[1, vocab]]), torch.tensor([[0, 1]]), cache)
    with pytest.raises(RuntimeError, match="negative position -1"):
        dec.hidden(torch.tensor([[1]]), torch.tensor([[-1]]), cache)
    assert torch.equal(cache.self_k, before)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_fused_step_off_the_main_thread_starts_no_threads(head64):
    """Off the main thread (an engine's loop thread) a step starts no OpenMP team of that thread's
    own beside the ops' workers (torch's layer_norm over several rows did, and its spinning threads
    slowed the step), and the hidden states have the main thread's bits."""
    import threading

    model, features, gen = decoder_setup(head64, torch.float32, batch=1)
    dec = model.model.decoder
    tokens, pos = torch.randint(0, 50000, (1, 5), generator=gen), torch.arange(5)[None]

    def in_thread(record, cache):
        try:
            with torch.inference_mode():
                before = set(os.listdir("/proc/self/task"))
                record.append(dec.hidden(tokens, pos, cache))
                record.append((before, set(os.listdir("/proc/self/task"))))  # while this thread lives
        except Exception as exc:  # reported below
            record.append(exc)

    threads_before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        caches = [fresh_cache(model, features, torch.float32) for _ in range(3)]  # their GEMMs here
        expected = dec.hidden(tokens, pos, caches[0])
        warm, seen = [], []
        for record, cache in ((warm, caches[1]), (seen, caches[2])):  # the first starts the ops' workers
            t = threading.Thread(target=in_thread, args=(record, cache))
            t.start()
            t.join(timeout=120)
    finally:
        torch.set_num_threads(threads_before)
    assert len(seen) == 2 and not isinstance(seen[0], Exception), seen
    assert torch.equal(seen[0], expected)
    before, after = seen[1]
    # threads that started (one that ended meanwhile, another test's engine loop, say, is no concern)
    assert not after - before, f"the step started {len(after - before)} threads"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_results_do_not_depend_on_batch_or_t(head64, dtype):
    """Row 0 run alone one position at a time, in a batch of 3 with other rows, and as one
    4-position block: the same hidden states bit for bit."""
    model, features, gen = decoder_setup(head64, dtype, batch=3)
    dec = model.model.decoder
    prompt = torch.randint(0, 50000, (3, 4), generator=gen)
    new = torch.randint(0, 50000, (3, 4), generator=gen)
    with torch.inference_mode():
        alone = fresh_cache(model, features[:1], dtype)
        dec.hidden(prompt[:1], torch.arange(4)[None], alone)
        steps = torch.cat([dec.hidden(new[:1, t:t + 1], torch.tensor([[4 + t]]), alone) for t in range(4)], dim=1)

        batch = fresh_cache(model, features, dtype)
        # other rows at other positions, with another prompt length
        pos = torch.stack([torch.arange(4), torch.arange(4), torch.arange(4)])
        dec.hidden(prompt, pos, batch)
        block = dec.hidden(new, torch.stack([torch.arange(4, 8), torch.arange(6, 10), torch.arange(4, 8)]), batch,
                           kv_len=10)
    assert torch.equal(steps[0], block[0])
    head_alone = model.greedy(steps, model.suppress)
    assert torch.equal(head_alone[0], model.greedy(block, model.suppress)[0])


def test_screened_head_equals_fast_logits_argmax(head64):
    model, features, gen = decoder_setup(head64, torch.float32, batch=1)
    hidden = torch.randn(3, 5, model.config.d_model, generator=gen) * 2
    banned = torch.rand(3, 5, model.config.vocab_size, generator=gen) < 0.3
    expected = model.logits(hidden).masked_fill(banned, -float("inf")).argmax(-1)
    assert torch.equal(model.greedy(hidden, banned), expected)
    assert torch.equal(model.greedy(hidden, model.suppress),
                       model.logits(hidden).masked_fill(model.suppress, -float("inf")).argmax(-1))


def test_screened_head_falls_back_when_candidates_overflow(monkeypatch):
    """Many tokens tied within int8 resolution: more candidates than MAX_CANDIDATES, so the
    row takes the full float32 head, and the answer is still exact (lowest id on exact ties)."""
    import specwhisper.model.head as heads

    monkeypatch.setattr(heads, "MAX_CANDIDATES", 4)
    gen = torch.Generator().manual_seed(3)
    d = 32
    weight = torch.randn(200, d, generator=gen) * 0.01
    h = torch.randn(2, d, generator=gen)
    unit = h[0] / h[0].norm()
    for i in range(10):
        weight[50 + i] = 3 * unit + 1e-6 * i * unit  # ten near-ties, the last one highest
    weight[70] = weight[59]  # an exact tie with 59 at a higher id
    head = ScreenedHead(weight)
    expected = cpu_ops.linear(h, weight, None, torch.float32).argmax(-1)
    assert head.argmax_reference(h).tolist() == expected.tolist() and expected[0] == 59
    assert head.argmax(h).tolist() == expected.tolist()  # the C++ op keeps every candidate


def test_bfloat16_speculative_equals_target_only(head64):
    from specwhisper import load_audio, log_mel_spectrogram
    from specwhisper.samples import sample_paths

    mel = log_mel_spectrogram(load_audio(sample_paths()[0]), n_mels=80)
    plain = Engine(head64, dtype=torch.bfloat16).transcribe(mel, language="en", max_new_tokens=20)
    spec = Engine(head64, head64, dtype=torch.bfloat16).transcribe(mel, language="en", max_new_tokens=20,
                                                                   num_draft_tokens=3)
    assert len(plain.tokens) >= 10
    assert spec.tokens == plain.tokens
    assert spec.stats.acceptance_rate == 1.0  # its own draft: every proposal is the target's choice


def test_bfloat16_model_with_bfloat16_arithmetic(head64, monkeypatch):
    """On a CPU with bfloat16 arithmetic (forced here) a bfloat16 model runs its encoder and
    cross K/V in bfloat16 too; speculative output stays the model's own."""
    from specwhisper import load_audio, log_mel_spectrogram
    from specwhisper.samples import sample_paths

    monkeypatch.setattr(cpu_ops, "native_bf16", lambda: True)
    mel = log_mel_spectrogram(load_audio(sample_paths()[0]), n_mels=80)
    engine = Engine(head64, dtype=torch.bfloat16)
    model = engine.target.model
    assert model.encoder.conv1.weight.dtype == torch.bfloat16 and model.decoder.native_bf16
    plain = engine.transcribe(mel, language="en", max_new_tokens=20)
    spec = Engine(head64, head64, dtype=torch.bfloat16).transcribe(mel, language="en", max_new_tokens=20,
                                                                   num_draft_tokens=3)
    assert len(plain.tokens) >= 10 and spec.tokens == plain.tokens


def test_compact_draft_keeps_output_exact(head64, ckpt_dir):
    """A float32 draft on the CPU stores its decoder projections in bfloat16 by default (half the
    bytes of a draft step); the target verifies every proposal, so the output is unchanged."""
    from specwhisper import load_audio, log_mel_spectrogram
    from specwhisper.samples import sample_paths

    other = ckpt_dir("head64-draft", vocab_size=51865, n_mels=80, d_model=128, heads=2, seed=6)
    mel = log_mel_spectrogram(load_audio(sample_paths()[0]), n_mels=80)
    plain = Engine(head64).transcribe(mel, language="en", max_new_tokens=24)
    compact = Engine(head64, other)
    full = Engine(head64, other, compact_draft=False)
    layer = compact.drafter.draft.model.decoder.layers[0]
    assert layer.fc1.weight.dtype == torch.bfloat16 and layer.self_attn.fused_weight.dtype == torch.bfloat16
    assert layer.final_layer_norm.weight.dtype == torch.float32
    assert full.drafter.draft.model.decoder.layers[0].fc1.weight.dtype == torch.float32
    assert compact.runner.draft_side.cache.cross_k.dtype == torch.bfloat16  # its cross K/V too
    step = compact.drafter.draft.model.decoder
    assert step.int8 and len(step.layer_params()) == 24 * len(step.layers)  # int8 projections in its C++ step
    packs = [t for layer in step.layers for pair in layer.int8 for t in pair]  # held once: in the step's buffer
    assert {t.untyped_storage().data_ptr() for t in packs} == {step.layer_params()[0].untyped_storage().data_ptr()}
    assert not full.drafter.draft.model.decoder.int8
    assert full.runner.draft_side.cache.cross_k.dtype == torch.float32
    assert compact.target.model.decoder.layers[0].fc1.weight.dtype == torch.float32  # never the target
    self_draft = Engine(head64, head64).drafter.draft.model.decoder.layers[0]
    assert self_draft.fc1.weight.dtype == torch.float32  # a self draft stays exact (acceptance 1.0)
    for engine in (compact, full):
        out = engine.transcribe(mel, language="en", max_new_tokens=24, num_draft_tokens=3)
        assert out.tokens == plain.tokens and out.stats.drafted > 0
    sampled = [e.transcribe(mel, language="en", max_new_tokens=24, num_draft_tokens=3, temperature=0.8, seed=3).tokens
               for e in (Engine(head64), compact)]
    assert sampled[0] == sampled[1]  # seeded sampling: the target's tokens whatever the draft
