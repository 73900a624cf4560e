"""Kernels == reference, bit for bit, over odd shapes: the rejection-sampling step (tokens and
n_emitted, with shared noise), counter-based noise and race sampling, for the Triton kernels
(interpreted on CPU tensors; compiled on CUDA), the C++ CPU ops, and the dispatcher (backends/ops.py)."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # Before anything imports Triton: without a GPU its kernels run in the interpreter. (With a GPU
    # the CUDA tests need compiled kernels; the CPU cases load an interpreted copy below.)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math

import pytest

from specwhisper import sampling as S
from specwhisper.backends import ops
from triton_interp import Interpreted, needs_triton, on_cuda


DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def make_inputs(B, k, V, dtype=torch.float32, temperature=1.0, top_p=1.0, seed=0, spread=3.0,
                mismatch=0.5, device="cpu"):
    """Target/draft logits (rounded to `dtype`), drafts sampled from the processed draft
    distribution, uniforms and exponential noise: the arguments of speculative_sample_noise."""
    g = torch.Generator().manual_seed(seed)
    target = (torch.randn(B, k + 1, V, generator=g) * spread).to(dtype)
    draft = (target[:, :k].float() + torch.randn(B, k, V, generator=g) * mismatch).to(dtype)
    drafts = S.sample(draft, temperature if temperature > 0 else 1.0, top_p, g)
    u = S.draw_uniforms((B, k), "cpu", g)
    noise = S.draw_exp_noise((B, V), "cpu", g)
    tensors = [t.to(device) for t in (target, draft, drafts, u, noise)]
    return (*tensors[:3], temperature, top_p, *tensors[3:])


def assert_same(got, expected):
    tokens, n = got
    ref_tokens, ref_n = expected
    assert tokens.dtype == torch.int64 and n.dtype == torch.int64
    assert torch.equal(n.cpu(), ref_n.cpu()), (n, ref_n)
    assert torch.equal(tokens.cpu(), ref_tokens.cpu()), (tokens, ref_tokens)


@pytest.fixture(scope="module")
def interpreted():
    pytest.importorskip("triton", reason="triton is not importable")
    return Interpreted()


# --- Triton kernel, interpreted ------------------------------------------------------------------
# (B, k, V, dtype, temperature, top_p): every shape value, dtype and mode appears; the interpreter
# pays per executed op, so large vocabularies run at B = 1, k = 1.
TRITON_CASES = [
    (3, 4, 7, "fp32", 1.0, 1.0),
    (17, 1, 7, "fp16", 0.7, 0.9),
    (1, 8, 111, "bf16", 1.3, 1.0),
    (3, 8, 111, "fp32", 0.9, 0.5),
    (17, 4, 111, "fp32", 1.0, 1.0),
    (3, 1, 111, "fp16", 1.0, 1e-6),
    (1, 1, 8193, "fp16", 1.0, 1.0),
    (1, 1, 51865, "fp32", 1.0, 1.0),
    (1, 1, 51866, "bf16", 0.8, 0.95),
    (17, 8, 111, "fp32", 0.0, 1.0),
    (3, 4, 51866, "fp16", 0.0, 1.0),
]


@needs_triton
@pytest.mark.parametrize("B,k,V,dtype,temperature,top_p", TRITON_CASES)
def test_triton_matches_reference(interpreted, B, k, V, dtype, temperature, top_p):
    args = make_inputs(B, k, V, DTYPES[dtype], temperature, top_p, seed=B * 1000 + k * 100 + V)
    assert_same(interpreted.speculative_sample_triton(*args), S.speculative_sample_noise(*args))


def edge_cases():
    """(name, args) of the corner cases every backend must agree on."""
    B, k, V = 5, 3, 37
    cases = []
    target, draft, drafts, T, top_p, u, noise = make_inputs(B, k, V, seed=1)
    cases.append(("k=1", make_inputs(4, 1, 19, seed=2)))
    cases.append(("all_accepted", (target, target[:, :k].clone(), S.sample(target[:, :k], 1.0, 1.0),
                                   1.0, 1.0, u, noise)))
    p = S.processed_probs(target, 1.0, 0.4)
    outside = torch.where(p[:, 0] > 0, -math.inf, target[:, 0]).argmax(-1)
    first_bad = drafts.clone()
    first_bad[:, 0] = outside  # p(x) = 0: rejected at the first position
    cases.append(("first_rejected", (target, draft, first_bad, 1.0, 0.4, u, noise)))
    ties = torch.randint(-2, 3, (B, k + 1, V), generator=torch.Generator().manual_seed(3)).float()
    cases.append(("ties", (ties, ties[:, :k] + (ties[:, :k] > 0), drafts, 1.0, 0.5, u, noise)))
    cases.append(("ties_top_p_1", (ties, ties[:, :k].flip(-1).contiguous(), drafts, 0.5, 1.0, u,
                                   noise)))
    cases.append(("tiny_top_p", (target, draft, drafts, 1.0, 1e-9, u, noise)))
    suppressed = target.clone()
    suppressed[..., ::3] = -math.inf
    cases.append(("suppressed", (suppressed, draft, drafts, 1.2, 0.9, u, noise)))
    same = target.clone()
    same[..., 0] = -math.inf  # q == p and q(0) = 0: rejected with an all-zero residual
    cases.append(("zero_residual", (same, same[:, :k].clone(), torch.zeros_like(drafts), 1.0, 1.0,
                                    u, noise)))
    greedy_drafts = target[:, :k].argmax(-1)
    greedy_drafts[1:, 1] = (greedy_drafts[1:, 1] + 1) % V
    cases.append(("greedy", (target, draft, greedy_drafts, 0.0, 1.0, u, noise)))
    cases.append(("hot", (target, draft, drafts, 25.0, 1.0, u, noise)))
    cases.append(("cold", (target, draft, drafts, 0.05, 0.9, u, noise)))
    return cases


EDGE_CASES = edge_cases()


@needs_triton
@pytest.mark.parametrize("name,args", EDGE_CASES, ids=[c[0] for c in EDGE_CASES])
def test_triton_edge_cases(interpreted, name, args):
    expected = S.speculative_sample_noise(*args)
    assert_same(interpreted.speculative_sample_triton(*args), expected)
    if name == "all_accepted":
        assert (expected[1] == args[2].shape[1] + 1).all()
    if name in ("first_rejected", "zero_residual"):
        assert (expected[1] == 1).all()


@needs_triton
def test_triton_result_does_not_depend_on_tiling(interpreted):
    args = make_inputs(2, 3, 100, temperature=0.9, top_p=0.8, seed=4)
    expected = S.speculative_sample_noise(*args)
    for block in (16, 64):
        assert_same(interpreted.speculative_sample_triton(*args, block_size=block), expected)


@needs_triton
def test_triton_launcher_asserts(interpreted):
    target, draft, drafts, T, top_p, u, noise = make_inputs(2, 2, 10)
    with pytest.raises(AssertionError):
        interpreted.speculative_sample_triton(target.transpose(0, 1).contiguous().transpose(0, 1),
                                              draft, drafts, T, top_p, u, noise)
    with pytest.raises(AssertionError):
        interpreted.speculative_sample_triton(target, draft, drafts, T, top_p, u.float(), noise)
    with pytest.raises(AssertionError):
        interpreted.speculative_sample_triton(target.double(), draft, drafts, T, top_p, u, noise)


# --- C++ op --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cpp_op():
    op = ops.cpp_op()
    if op is None:
        pytest.skip("the C++ extension is disabled (SPECWHISPER_NO_EXT) or failed to build")
    return op


def cpp_grid():
    """Every V x k x B x dtype, with the (temperature, top_p) mode rotating; top-p at the largest
    shapes only where the (slow, 36-step) reference bisection stays affordable."""
    modes = [(1.0, 1.0), (0.7, 0.9), (1.3, 0.5), (0.0, 1.0)]
    cases, i = [], 0
    for V in (7, 111, 8193, 51865, 51866):
        for k in (1, 4, 8):
            for B in (1, 3, 17):
                for dtype in DTYPES:
                    temperature, top_p = modes[i % len(modes)]
                    i += 1
                    if V > 1000 and B * (2 * k + 1) > 30 and top_p < 1:
                        temperature, top_p = 1.0, 1.0
                    cases.append((B, k, V, dtype, temperature, top_p))
    return cases


@pytest.mark.parametrize("B,k,V,dtype,temperature,top_p", cpp_grid())
def test_cpp_matches_reference(cpp_op, B, k, V, dtype, temperature, top_p):
    args = make_inputs(B, k, V, DTYPES[dtype], temperature, top_p, seed=B * 1000 + k * 100 + V)
    assert_same(cpp_op(*args), S.speculative_sample_noise(*args))


@pytest.mark.parametrize("name,args", EDGE_CASES, ids=[c[0] for c in EDGE_CASES])
def test_cpp_edge_cases(cpp_op, name, args):
    assert_same(cpp_op(*args), S.speculative_sample_noise(*args))


def test_cpp_mixed_dtypes_and_strides(cpp_op):
    target, draft, drafts, T, top_p, u, noise = make_inputs(4, 3, 500, temperature=0.8, top_p=0.9)
    wide = torch.zeros(4, 4, 1000)
    wide[..., ::2] = target  # non-contiguous view
    args = (wide[..., ::2], draft.half(), drafts, T, top_p, u, noise)
    assert_same(cpp_op(*args), S.speculative_sample_noise(*args))


def test_cpp_opcheck(cpp_op):
    for temperature, top_p in [(1.0, 1.0), (0.8, 0.9), (0.0, 1.0)]:
        torch.library.opcheck(cpp_op, make_inputs(2, 3, 50, temperature=temperature, top_p=top_p))


def test_cpp_rejects_bad_arguments(cpp_op):
    target, draft, drafts, T, top_p, u, noise = make_inputs(2, 2, 10)
    with pytest.raises(RuntimeError, match="draft_logits"):
        cpp_op(target, draft[:, :1], drafts, T, top_p, u, noise)
    with pytest.raises(RuntimeError, match="uniforms"):
        cpp_op(target, draft, drafts, T, top_p, u.float(), noise)
    with pytest.raises(RuntimeError, match="outside"):
        cpp_op(target, draft, drafts + 10, T, top_p, u, noise)


# --- dispatcher ----------------------------------------------------------------------------------

def test_dispatcher_on_cpu():
    assert ops.which_backend("cpu") in ("cpp", "reference")
    args = make_inputs(3, 4, 1000, temperature=0.9, top_p=0.95, seed=5)
    assert_same(ops.speculative_sample_noise(*args), S.speculative_sample_noise(*args))
    target, draft, drafts, T, top_p, *_ = args
    g1, g2 = torch.Generator().manual_seed(6), torch.Generator().manual_seed(6)
    assert_same(ops.speculative_sample(target, draft, drafts, T, top_p, g1),
                ops.speculative_sample(target, draft, drafts, T, top_p, g2))


def test_no_ext_env_disables_the_cpp_op(monkeypatch):
    monkeypatch.setenv("SPECWHISPER_NO_EXT", "1")
    ops.cpp_ops.cache_clear()
    try:
        assert ops.cpp_op() is None
        assert ops.which_backend("cpu") == "reference"
        args = race_inputs(3, 50, seed=9)
        assert torch.equal(ops.race_sample(*args), S.race_sample(*args))
    finally:
        monkeypatch.delenv("SPECWHISPER_NO_EXT")
        ops.cpp_ops.cache_clear()


# --- counter-based noise and race sampling -------------------------------------------------------

BIG = [0, 1, -1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**62 + 12345, 2**63 - 1, -2**63]


def noise_keys(N, seed=0):
    """seed [N], position [N] int64 mixing small, 32-bit-boundary and extreme int64 values."""
    g = torch.Generator().manual_seed(seed)
    big = torch.tensor(BIG)
    seeds = torch.cat([big, torch.randint(-2**63, 2**63 - 1, (N,), generator=g)])[:N]
    positions = torch.cat([big.flip(0), torch.randint(0, 448, (N,), generator=g)])[:N]
    return seeds, positions


def noise_ids(V, mode, seed=0):
    """Column keys: arange(V), a permutation shifted past a vocabulary, or arbitrary int64s."""
    g = torch.Generator().manual_seed(seed)
    if mode == "arange":
        return torch.arange(V)
    if mode == "mapped":
        return torch.randperm(V, generator=g) + 51866
    return torch.randint(-2**63, 2**63 - 1, (V,), generator=g)


def race_inputs(N, V, dtype=torch.float32, seed=0, spread=3.0, greedy_every=4, ids=None):
    """(logits, temperature, top_p, seed, position, noise_ids): per-row temperatures incl. greedy
    rows (0), per-row top_p incl. 1, seeds/positions incl. extreme int64 values."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(N, V, generator=g) * spread).to(dtype)
    temperature = torch.tensor([0.0, 1.0, 0.7, 1.3, 25.0, 0.05][:N] * (N // 6 + 1))[:N]
    if greedy_every:
        temperature[::greedy_every] = 0.0
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.5, 1e-6, 0.99, 1.0][:N] * (N // 7 + 1))[:N]
    seeds, positions = noise_keys(N, seed)
    return logits, temperature.float(), top_p.float(), seeds, positions, ids


def race_edge_cases():
    cases = []
    ties = torch.randint(-2, 3, (9, 40), generator=torch.Generator().manual_seed(3)).float()
    t, tp, sd, pos = torch.full((9,), 1.0), torch.full((9,), 0.5), *noise_keys(9)
    cases.append(("ties", (ties, t, tp, sd, pos, None)))
    cases.append(("ties_greedy", (ties, torch.zeros(9), tp, sd, pos, None)))
    flat = torch.zeros(9, 40)  # every token equally likely: the noise alone decides
    cases.append(("flat", (flat, t, torch.ones(9), sd, pos, None)))
    suppressed = torch.randn(9, 40, generator=torch.Generator().manual_seed(4))
    suppressed[:, ::3] = -math.inf
    cases.append(("suppressed", (suppressed, t * 1.2, tp * 1.8, sd, pos, noise_ids(40, "mapped"))))
    one = torch.full((9, 40), -math.inf)
    one[:, 17] = 0.0
    cases.append(("one_finite", (one, t, tp, sd, pos, None)))
    cases.append(("V=1", (torch.randn(9, 1), t, tp, sd, pos, None)))
    return cases


RACE_EDGE_CASES = race_edge_cases()


@pytest.mark.parametrize("V", [1, 7, 111, 8193, 51864, 51866])
@pytest.mark.parametrize("mode", ["arange", "mapped", "any"])
def test_cpp_noise_matches_reference(cpp_op, V, mode):
    seeds, positions = noise_keys(12, V)
    ids = noise_ids(V, mode, V)
    expected = S.exp_noise(seeds, positions, ids)
    got = ops.cpp_ops().exp_noise(seeds, positions, ids)
    assert got.dtype == torch.float32 and got.shape == (12, V)
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))
    assert (expected > 0).all() and torch.isfinite(expected).all()


@pytest.mark.parametrize("N,V,dtype", [(1, 1, "fp32"), (5, 7, "fp16"), (13, 111, "bf16"),
                                       (7, 8193, "fp32"), (13, 51864, "fp16"),
                                       (24, 51866, "fp32"), (6, 51866, "bf16")])
@pytest.mark.parametrize("mode", ["arange", "mapped"])
def test_cpp_race_matches_reference(cpp_op, N, V, dtype, mode):
    ids = None if mode == "arange" else noise_ids(V, "mapped", N)
    args = race_inputs(N, V, DTYPES[dtype], seed=N + V, ids=ids)
    got = ops.cpp_ops().race_sample(*args)
    assert got.dtype == torch.int64 and got.shape == (N,)
    assert torch.equal(got, S.race_sample(*args))
    leads = torch.full((N,), float("nan"))
    assert torch.equal(ops.cpp_ops().race_sample(*args, leads), got)  # the same tokens, and their leads
    assert torch.equal(leads, S.race_leads(*args))


@pytest.mark.parametrize("name,args", RACE_EDGE_CASES, ids=[c[0] for c in RACE_EDGE_CASES])
def test_cpp_race_edge_cases(cpp_op, name, args):
    expected = S.race_sample(*args)
    assert torch.equal(ops.cpp_ops().race_sample(*args), expected)
    leads = torch.full((len(expected),), float("nan"))
    assert torch.equal(ops.cpp_ops().race_sample(*args, leads), expected)
    assert torch.equal(leads, S.race_leads(*args))
    assert (leads >= 0).all()
    if name == "ties_greedy":  # a logit tied with the winner's: a lead of 0
        assert (leads == 0).any()
    if name in ("one_finite", "V=1"):  # nothing else could win
        assert torch.isinf(leads).all()
    if name == "ties_greedy":
        assert torch.equal(expected, args[0].argmax(-1))  # first index among ties
    if name == "one_finite":
        assert (expected == 17).all()


def test_cpp_race_strided_rows_and_opcheck(cpp_op):
    logits, t, tp, sd, pos, _ = race_inputs(8, 300, seed=5)
    row = logits[1:2].expand(8, 300)  # one row raced under 8 keys: stride 0
    assert torch.equal(ops.cpp_ops().race_sample(row, t, tp, sd, pos, None),
                       S.race_sample(row, t, tp, sd, pos))
    torch.library.opcheck(ops.cpp_ops().race_sample, (logits, t, tp, sd, pos, None))
    torch.library.opcheck(ops.cpp_ops().race_sample, (logits, t, tp, sd, pos, torch.arange(300)))
    torch.library.opcheck(ops.cpp_ops().race_sample, (logits, t, tp, sd, pos, None, torch.empty(8)))
    torch.library.opcheck(ops.cpp_ops().exp_noise, (sd, pos, torch.arange(300)))


def test_cpp_race_rejects_bad_arguments(cpp_op):
    logits, t, tp, sd, pos, _ = race_inputs(4, 30)
    race = ops.cpp_ops().race_sample
    with pytest.raises(RuntimeError, match="temperature"):
        race(logits, t.double(), tp, sd, pos, None)
    with pytest.raises(RuntimeError, match="seed"):
        race(logits, t, tp, sd[:2], pos, None)
    with pytest.raises(RuntimeError, match="noise_ids"):
        race(logits, t, tp, sd, pos, torch.arange(29))
    for bad in (torch.empty(3), torch.empty(4, dtype=torch.float64), torch.empty(8)[::2]):
        with pytest.raises(RuntimeError, match="leads"):
            race(logits, t, tp, sd, pos, None, bad)
        with pytest.raises(ValueError, match="leads"):
            ops.race_sample(logits, t, tp, sd, pos, None, bad)


# Interpreted Triton: small vocabularies, and one row pair at V = 51866.
TRITON_RACE_CASES = [(1, 1, "fp32", "arange"), (6, 7, "fp16", "mapped"),
                     (13, 111, "bf16", "arange"), (7, 111, "fp32", "mapped"),
                     (2, 51866, "fp32", "arange")]


@needs_triton
@pytest.mark.parametrize("V", [1, 7, 1000])
@pytest.mark.parametrize("mode", ["arange", "any"])
def test_triton_noise_matches_reference(interpreted, V, mode):
    seeds, positions = noise_keys(10, V)
    ids = noise_ids(V, mode, V)
    got = interpreted.exp_noise_triton(seeds, positions, ids, block_size=256)
    assert torch.equal(got.view(torch.int32), S.exp_noise(seeds, positions, ids).view(torch.int32))


@needs_triton
@pytest.mark.parametrize("split", [True, False], ids=["split", "row"])
@pytest.mark.parametrize("N,V,dtype,mode", TRITON_RACE_CASES)
def test_triton_race_matches_reference(interpreted, N, V, dtype, mode, split):
    ids = None if mode == "arange" else noise_ids(V, "mapped", N)
    args = race_inputs(N, V, DTYPES[dtype], seed=N + V, greedy_every=2 if V > 1000 else 4, ids=ids)
    assert torch.equal(interpreted.race_sample_triton(*args, split=split), S.race_sample(*args))


@needs_triton
@pytest.mark.parametrize("split", [True, False], ids=["split", "row"])
@pytest.mark.parametrize("name,args", RACE_EDGE_CASES, ids=[c[0] for c in RACE_EDGE_CASES])
def test_triton_race_edge_cases(interpreted, name, args, split):
    assert torch.equal(interpreted.race_sample_triton(*args, split=split, chunk_size=16), S.race_sample(*args))


@needs_triton
def test_triton_race_does_not_depend_on_tiling(interpreted):
    args = race_inputs(5, 100, seed=6, ids=noise_ids(100, "mapped"))
    expected = S.race_sample(*args)
    for block in (16, 64):
        assert torch.equal(interpreted.race_sample_triton(*args, block_size=block, split=False), expected)
    for chunk, block in ((16, 16), (32, 64), (128, 32)):  # chunks of a row, one past its end
        assert torch.equal(interpreted.race_sample_triton(*args, chunk_size=chunk, block_size=block), expected)
    row = args[0][2:3].expand(5, 100)
    assert torch.equal(interpreted.race_sample_triton(row, *args[1:]), S.race_sample(row, *args[1:]))


@needs_triton
def test_triton_split_race_at_the_gpu_chunk_size(interpreted):
    args = race_inputs(3, 51866, torch.float16, seed=8, greedy_every=3, ids=noise_ids(51866, "mapped"))
    assert torch.equal(interpreted.race_sample_triton(*args, chunk_size=1024), S.race_sample(*args))


@needs_triton
def test_triton_split_race_ties_pick_the_first_chunk(interpreted):
    """Greedy rows with equal maxima in three chunks take the lowest index, as the reference does;
    sampled rows over the same logits (top-p too) equal the reference."""
    logits = torch.full((4, 64), -3.0)
    logits[:, [5, 21, 40]] = 2.0  # chunks 0, 1 and 2 of 16 each hold a maximum
    temperature = torch.tensor([0.0, 0.0, 1.0, 1.0])
    top_p = torch.tensor([1.0, 0.5, 1.0, 0.3])
    seeds, positions = noise_keys(4, 3)
    args = (logits, temperature, top_p, seeds, positions, None)
    expected = S.race_sample(*args)
    assert expected[:2].tolist() == [5, 5]
    assert torch.equal(interpreted.race_sample_triton(*args, chunk_size=16), expected)


def test_dispatched_race_on_cpu():
    args = race_inputs(9, 1000, seed=7, ids=noise_ids(1000, "mapped"))
    assert torch.equal(ops.race_sample(*args), S.race_sample(*args))
    seeds, positions = noise_keys(4)
    assert torch.equal(ops.exp_noise(seeds, positions, torch.arange(33)),
                       S.exp_noise(seeds, positions, torch.arange(33)))
    with pytest.raises(ValueError, match="temperature"):
        ops.race_sample(args[0], args[1].double(), *args[2:])
    with pytest.raises(ValueError, match="noise_ids"):
        ops.race_sample(*args[:5], torch.arange(999))


# --- Triton kernel, compiled on CUDA -------------------------------------------------------------

CUDA_CASES = [(B, k, V, dtype, T, top_p)
              for V in (7, 111, 8193, 51865, 51866) for k in (1, 4, 8) for B in (1, 3, 17)
              for dtype, (T, top_p) in zip(DTYPES, [(1.0, 1.0), (0.7, 0.9), (0.0, 1.0)])]


@on_cuda
@pytest.mark.parametrize("B,k,V,dtype,temperature,top_p", CUDA_CASES)
def test_triton_on_cuda_matches_reference(B, k, V, dtype, temperature, top_p):
    assert ops.which_backend("cuda") == "triton"
    args = make_inputs(B, k, V, DTYPES[dtype], temperature, top_p, seed=V + k + B, device="cuda")
    got = ops.speculative_sample_noise(*args)
    cpu_args = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
    assert_same(got, S.speculative_sample_noise(*cpu_args))  # the spec, on the CPU
    assert_same(got, S.speculative_sample_noise(*args))  # and the reference run on the GPU


@on_cuda
@pytest.mark.parametrize("name,args", EDGE_CASES, ids=[c[0] for c in EDGE_CASES])
def test_triton_on_cuda_edge_cases(name, args):
    cuda_args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
    assert_same(ops.speculative_sample_noise(*cuda_args), S.speculative_sample_noise(*args))


@on_cuda
@pytest.mark.parametrize("N,V,dtype", [(1, 1, "fp32"), (13, 111, "bf16"), (64, 51864, "fp16"),
                                       (33, 51866, "fp32")])
def test_triton_race_on_cuda_matches_reference(N, V, dtype):
    assert ops.which_backend("cuda") == "triton"
    args = race_inputs(N, V, DTYPES[dtype], seed=N + V, ids=noise_ids(V, "mapped"))
    cuda_args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
    expected = S.race_sample(*args)
    assert torch.equal(ops.race_sample(*cuda_args).cpu(), expected)  # the chunked kernel (default)
    kernels = ops.triton_kernels()
    assert torch.equal(kernels.race_sample_triton(*cuda_args, split=False).cpu(), expected)
    for chunk in (256, 4096):
        assert torch.equal(kernels.race_sample_triton(*cuda_args, chunk_size=chunk).cpu(), expected)
    seeds, positions = noise_keys(N)
    got = ops.exp_noise(seeds.cuda(), positions.cuda(), torch.arange(V).cuda())
    assert torch.equal(got.cpu(), S.exp_noise(seeds, positions, torch.arange(V)))
