"""Microbenchmark: one speculative-sampling step (accept / reject / resample) and one race-sampling
step (counter-based noise), backend by ops.

Question: how long does the step take on each backend, and at what rate does it consume the
logits it must read (GB/s of logits; the floor of any implementation)?
CPU: the PyTorch reference vs the C++ op. CUDA (when present): the reference vs the Triton kernel.
V = 51866 (large-v3), k in {4, 8}, B in {1, 8}; temperature 1 with top_p 1 and 0.9. The draft
equals the target, so every draft is accepted and every backend does the whole step (no early
exit at a rejection). Race sampling: N = B * (k + 1) rows (a verify pass's positions), T = 1.
Inputs are built and the C++ ops / Triton kernels compiled before timing.

    python -m pytest bench/bench_sampling.py --benchmark-only -s
"""
from __future__ import annotations

import pytest
import torch

from specwhisper import sampling as S
from specwhisper.backends import ops

V = 51866
SHAPES = [(1, 4), (8, 4), (1, 8), (8, 8)]  # (B, k)
MODES = {"top_p=1": (1.0, 1.0), "top_p=0.9": (1.0, 0.9)}
_MEANS: dict[tuple, float] = {}  # (device, impl, B, k, mode) -> mean seconds, for the summary


def _inputs(B, k, temperature, top_p, device):
    g = torch.Generator().manual_seed(0)
    target = torch.randn(B, k + 1, V, generator=g) * 3
    draft = target[:, :k].clone()  # q == p: all k drafts accepted, the full step runs
    drafts = S.sample(draft, temperature, top_p, g)
    u = S.draw_uniforms((B, k), "cpu", g)
    noise = S.draw_exp_noise((B, V), "cpu", g)
    tensors = [t.to(device) for t in (target, draft, drafts, u, noise)]
    return (*tensors[:3], temperature, top_p, *tensors[3:])


def _race_inputs(B, k, temperature, top_p, device):
    N = B * (k + 1)
    logits = torch.randn(N, V, generator=torch.Generator().manual_seed(0)) * 3
    rows = (torch.full((N,), temperature), torch.full((N,), top_p),
            torch.arange(N, dtype=torch.int64), torch.arange(N, dtype=torch.int64))
    return [t.to(device) for t in (logits, *rows)] + [None]


def _measure(benchmark, fn, args, key, rounds, cuda=False, race=False):
    def step():
        out = fn(*args)
        if cuda:
            torch.cuda.synchronize()
        return out

    out = step()  # warm-up: builds / compiles outside the timed region
    if not race:
        assert (out[1] == args[2].shape[1] + 1).all()
    benchmark.pedantic(step, rounds=rounds, iterations=1, warmup_rounds=1)
    mean = benchmark.stats.stats.mean
    logit_bytes = sum(t.numel() * t.element_size() for t in args[:1 if race else 2])
    benchmark.extra_info.update(logit_MB=logit_bytes / 1e6, GB_per_s=logit_bytes / mean / 1e9)
    if not race:
        benchmark.extra_info.update(mean_accepted=float((out[1] - 1).float().mean()))
    _MEANS[key] = mean
    print(f"\n{key}: {mean * 1e3:.3f} ms, {logit_bytes / mean / 1e9:.2f} GB/s of logits "
          f"({logit_bytes / 1e6:.1f} MB)")


@pytest.fixture(scope="module", autouse=True)
def _summary():
    yield
    print("\nspeedup over the reference (same device, shape and mode):")
    for (device, impl, B, k, mode), mean in sorted(_MEANS.items()):
        reference = "race-reference" if impl.startswith("race") else "reference"
        ref = _MEANS.get((device, reference, B, k, mode))
        if impl != reference and ref:
            print(f"  {device} {impl:9s} B={B} k={k} {mode:10s} {ref / mean:7.1f}x "
                  f"({ref * 1e3:.2f} ms -> {mean * 1e3:.3f} ms)")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("B,k", SHAPES)
@pytest.mark.parametrize("impl", ["reference", "cpp"])
def test_cpu_step(benchmark, impl, B, k, mode):
    args = _inputs(B, k, *MODES[mode], "cpu")
    if impl == "cpp":
        if ops.cpp_op() is None:
            pytest.skip("C++ op unavailable")
        fn, rounds = ops.cpp_op(), 30
    else:
        fn, rounds = S.speculative_sample_core, 3 if B * k > 8 else 10
    benchmark.group = f"cpu B={B} k={k} {mode}"
    _measure(benchmark, fn, args, ("cpu", impl, B, k, mode), rounds)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("B,k", SHAPES)
@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_cuda_step(benchmark, impl, B, k, mode):
    args = _inputs(B, k, *MODES[mode], "cuda")
    if impl == "triton":
        if ops.which_backend("cuda") != "triton":
            pytest.skip("Triton unavailable")
        fn = ops.speculative_sample_noise
    else:
        fn = S.speculative_sample_core
    benchmark.group = f"cuda B={B} k={k} {mode}"
    _measure(benchmark, fn, args, ("cuda", impl, B, k, mode), rounds=50, cuda=True)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("B,k", SHAPES)
@pytest.mark.parametrize("impl", ["race-reference", "race-cpp"])
def test_cpu_race(benchmark, impl, B, k, mode):
    args = _race_inputs(B, k, *MODES[mode], "cpu")
    if impl == "race-cpp":
        if ops.cpp_ops() is None:
            pytest.skip("C++ ops unavailable")
        fn, rounds = ops.cpp_ops().race_sample, 30
    else:
        fn, rounds = S.race_sample, 3
    benchmark.group = f"cpu race N={B * (k + 1)} {mode}"
    _measure(benchmark, fn, args, ("cpu", impl, B, k, mode), rounds, race=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("B,k", SHAPES)
@pytest.mark.parametrize("impl", ["race-reference", "race-triton"])
def test_cuda_race(benchmark, impl, B, k, mode):
    args = _race_inputs(B, k, *MODES[mode], "cuda")
    if impl == "race-triton":
        if ops.which_backend("cuda") != "triton":
            pytest.skip("Triton unavailable")
        fn = ops.race_sample
    else:
        fn = S.race_sample
    benchmark.group = f"cuda race N={B * (k + 1)} {mode}"
    _measure(benchmark, fn, args, ("cuda", impl, B, k, mode), rounds=50, cuda=True, race=True)
