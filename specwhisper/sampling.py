"""Sampling reference: processed probabilities, greedy and speculative acceptance, resampling.

This module is the spec. The Triton kernel (`kernels/spec_sample.py`) and the C++ op
(`csrc/spec_sample.cpp`) reproduce `speculative_sample_noise` bit for bit on tokens and counts.

Speculative sampling (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023, arXiv 2302.01318):
the draft proposed x_i ~ q_i; accept x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first
rejection emit a token from normalize(max(0, p_i - q_i)) (the *recovered* token); if all k drafts
are accepted emit a *bonus* token from p_k. The emitted tokens are distributed exactly as if the
target had sampled them one at a time from p.

Arithmetic contract (why the code looks the way it does). A decision (accept, which token) must
come out the same whatever order a kernel reduces a vocabulary row in, so:
- exp is a fixed sequence of fp32 multiplies and adds (`_exp_f32`, Cody-Waite reduction plus a
  degree-7 polynomial), not the platform's `exp`, whose last bit differs between libraries;
- each token's unnormalised probability is rounded to an integer *weight* in [0, 2^36] held in
  float64. A row sums at most 2^17 weights, so every partial sum is an integer of at most 2^53 and
  the sum is exact in any order. Tokens below 2^-37 of the row's most likely token get weight 0
  (they are beneath what an fp32 softmax sum resolves) and are never sampled; the rounding moves
  a row's distribution by less than V * 2^-37 in total variation, below fp32 softmax error;
- every later step is a single IEEE operation (float64 compare, multiply, divide), identical on
  every backend.
"""
from __future__ import annotations

import math
import struct

import torch

# fp32 constants of `_exp_f32`, written as exactly representable values.
_EXP_MIN_ARG = -64.0  # weights round to 0 below -25.6 anyway; the clamp keeps 2^n normal
_LOG2E = 1.4426950216293335  # fp32(log2 e)
_ROUND_MAGIC = 12582912.0  # 1.5 * 2^23: (t + M) - M rounds |t| < 2^22 to the nearest integer
_LN2_HI = 0.693359375  # ln 2 split so that n * _LN2_HI is exact (Cody-Waite)
_LN2_LO = -0.00021219444170128554
_EXP_POLY = (  # Taylor coefficients 1/7! .. 1/0! in fp32, evaluated by Horner
    0.00019841270113829523, 0.0013888889225199819, 0.008333333767950535,
    0.0416666679084301, 0.1666666716337204, 0.5, 1.0, 1.0,
)
WEIGHT_BITS = 36  # weights are integers in [0, 2^WEIGHT_BITS]
_WEIGHT_SCALE = 2.0 ** WEIGHT_BITS
_ROUND_MAGIC64 = 2.0 ** 52  # (x + M) - M rounds 0 <= x < 2^52 to the nearest integer in float64
MAX_VOCAB = 2 ** (53 - WEIGHT_BITS)  # keeps every row sum of weights exact in float64
TOP_P_ITERS = WEIGHT_BITS  # bisection steps that shrink [1, 2^36 + 1) to one weight value


def f32(x: float) -> float:
    """`x` rounded to the nearest float32, as a Python float (what a kernel's fp32 scalar holds)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def inv_temperature(temperature: float) -> float:
    """fp32(1 / temperature): the scale applied to `logits - max(logits)`."""
    inv_t = f32(1.0 / temperature)
    if not math.isfinite(inv_t):
        raise ValueError(f"temperature {temperature!r} is too small for float32 (use 0 for greedy)")
    return inv_t


def _exp_f32(s: torch.Tensor) -> torch.Tensor:
    """exp(s) for fp32 s <= 0 with a fixed sequence of fp32 operations (about 1 ulp)."""
    s = s.clamp_min(_EXP_MIN_ARG)
    n = (s * _LOG2E + _ROUND_MAGIC) - _ROUND_MAGIC  # round(s / ln 2), an integer in [-93, 0]
    r = (s - n * _LN2_HI) - n * _LN2_LO  # |r| <= ln(2) / 2
    poly = torch.full_like(r, _EXP_POLY[0])
    for c in _EXP_POLY[1:]:
        poly = poly * r + c
    two_n = ((n.to(torch.int32) + 127) << 23).view(torch.float32)  # 2^n from its exponent bits
    return poly * two_n


def _weights(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Integer weights (float64) proportional to softmax(logits / temperature) over the last dim."""
    x = logits.float()
    s = (x - x.amax(-1, keepdim=True)) * inv_temperature(temperature)  # fp32, <= 0
    scaled = (_exp_f32(s) * _WEIGHT_SCALE).double()  # exact: a power-of-two scale
    return (scaled + _ROUND_MAGIC64) - _ROUND_MAGIC64


def _top_p_threshold(weights: torch.Tensor, top_p: float) -> torch.Tensor:
    """Largest integer tau such that the weights >= tau hold at least top_p of the row's mass.

    Sort-free bisection over the threshold value, [..., 1]. Invariant: `lo` is feasible (kept
    mass >= target), `hi` is not; the interval [1, 2^36 + 1) halves every step, so after
    TOP_P_ITERS steps hi == lo + 1 and lo is tau. The kept set {weights >= tau} is unique, so the
    kernels may search differently (they snap to weight values and stop early) and still agree.
    """
    total = weights.sum(-1, keepdim=True)  # exact: integers below 2^53
    target = total * f32(top_p)
    lo = torch.ones_like(total)  # keeps every nonzero weight: mass == total
    hi = torch.full_like(total, _WEIGHT_SCALE + 1.0)  # above every weight: keeps nothing
    for _ in range(TOP_P_ITERS):
        mid = torch.floor((lo + hi) * 0.5)
        ok = torch.where(weights >= mid, weights, 0.0).sum(-1, keepdim=True) >= target
        lo = torch.where(ok, mid, lo)
        hi = torch.where(ok, hi, mid)
    return lo


def _probs64(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Processed probabilities in float64: the values every backend compares."""
    weights = _weights(logits, temperature)
    if top_p < 1.0:
        weights = torch.where(weights >= _top_p_threshold(weights, top_p), weights, 0.0)
    return weights * (1.0 / weights.sum(-1, keepdim=True))


def processed_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """top_p(softmax(logits.float() / temperature)) over the last dim, float32.

    softmax is computed as exp((logits - max) * fp32(1 / temperature)) normalised. Suppressed
    tokens arrive as -inf logits and get probability 0; every row needs one finite logit.
    Top-p (nucleus): keep every token whose probability is >= tau, where tau is the largest value
    for which the kept mass is still >= top_p, then renormalise. Hence ties at tau are all kept,
    at least one token is kept, and top_p = 1 keeps every token of nonzero probability (nonzero
    meaning at least 2^-37 of the likeliest token's, see the module docstring). On rows without
    ties this is the smallest set of most likely tokens holding top_p of the mass, i.e.
    transformers' `TopPLogitsWarper`. top_p is rounded to float32 first, as kernels receive it.
    temperature == 0 gives the one-hot argmax.
    """
    _check_sampling_params(temperature, top_p)
    if temperature == 0:
        return torch.nn.functional.one_hot(greedy(logits), logits.shape[-1]).float()
    return _probs64(logits, temperature, top_p).float()


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Argmax over the last dim (the first index among ties), int64."""
    return logits.argmax(-1)


def draw_exp_noise(shape, device, generator: torch.Generator | None = None) -> torch.Tensor:
    """Exp(1) noise in float32, strictly positive and finite (drawn in float64)."""
    u = torch.rand(shape, dtype=torch.float64, device=device, generator=generator)  # [0, 1)
    return (-torch.log1p(-u)).clamp_min(torch.finfo(torch.float32).tiny).float()


def draw_uniforms(shape, device, generator: torch.Generator | None = None) -> torch.Tensor:
    """U(0, 1] in float64 (never exactly 0)."""
    return 1.0 - torch.rand(shape, dtype=torch.float64, device=device, generator=generator)


def sample(logits: torch.Tensor, temperature: float, top_p: float,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of logits [..., V] from processed_probs, by the exponential race
    argmax(p / E), E ~ Exp(1). temperature == 0 is greedy. Returns int64 [...]."""
    _check_sampling_params(temperature, top_p)
    if temperature == 0:
        return greedy(logits)
    probs = _probs64(logits, temperature, top_p)
    noise = draw_exp_noise(logits.shape, logits.device, generator)
    return (probs / noise.double()).argmax(-1)


def greedy_accept(target_logits: torch.Tensor, draft_tokens: torch.Tensor):
    """Greedy verification: the longest prefix of draft_tokens [B, k] equal to the target's argmax
    over target_logits [B, k+1, V], then one target token (the correction, or the bonus token if
    every draft matched). Returns tokens [B, k+1] int64 padded with -1 and n_emitted [B] in 1..k+1.
    """
    B, k1, _ = target_logits.shape
    if draft_tokens.shape != (B, k1 - 1):
        raise ValueError(f"draft_tokens {tuple(draft_tokens.shape)} != {(B, k1 - 1)}")
    return greedy_accept_choices(greedy(target_logits), draft_tokens)


def greedy_accept_choices(target_tokens: torch.Tensor, draft_tokens: torch.Tensor):
    """`greedy_accept` given the target's own choices [B, k+1] instead of its logits (what an
    engine has when its head returns only the argmax). Same result contract."""
    k1 = target_tokens.shape[1]
    matches = draft_tokens == target_tokens[:, :-1]
    n_accepted = matches.long().cumprod(-1).sum(-1)  # [B]
    steps = torch.arange(k1, device=target_tokens.device)
    tokens = torch.where(steps <= n_accepted[:, None], target_tokens, -1)
    return tokens, n_accepted + 1


def speculative_sample_noise(target_logits: torch.Tensor, draft_logits: torch.Tensor,
                             draft_tokens: torch.Tensor, temperature: float, top_p: float,
                             uniforms: torch.Tensor, exp_noise: torch.Tensor):
    """Speculative sampling with pre-drawn noise (the deterministic core; the spec of the kernels).

    target_logits [B, k+1, V] and draft_logits [B, k, V] (any float dtype, computed in fp32);
    draft_tokens [B, k] int64, sampled from the processed draft distribution q;
    uniforms [B, k] float64 in (0, 1]; exp_noise [B, V] float32, Exp(1), > 0.
    p and q are both processed with (temperature, top_p) as in `processed_probs`.
    Draft i is accepted iff q(x_i) > 0 and u_i * q(x_i) < p(x_i) (probability min(1, p/q) for
    u ~ U(0, 1]; a draft the draft distribution could not have produced is rejected). At the first
    rejected position j the recovered token is argmax(max(p_j - q_j, 0) / E) (exponential race;
    one noise row per batch row, as each row resamples once); if that residual is all zero (p_j ==
    q_j numerically) p_j is used. If all k drafts are accepted the bonus token is argmax(p_k / E).
    temperature == 0 delegates to `greedy_accept` (draft_logits and the noise are unused).
    Returns tokens [B, k+1] int64 (accepted drafts, then the recovered or bonus token, then -1)
    and n_emitted [B] int64 in 1..k+1.
    """
    _check_step(target_logits, draft_logits, draft_tokens, temperature, top_p, uniforms, exp_noise)
    if temperature > 0:  # value checks need a host sync; the dispatched core skips them
        V = target_logits.shape[-1]
        if not bool(((draft_tokens >= 0) & (draft_tokens < V)).all()):
            raise ValueError(f"draft_tokens must lie in [0, {V})")
        if not bool(((uniforms > 0) & (uniforms <= 1)).all()):
            raise ValueError("uniforms must be finite and in (0, 1]")
        if not bool(((exp_noise > 0) & (exp_noise < math.inf)).all()):
            raise ValueError("exp_noise must be finite and > 0")
    return speculative_sample_core(target_logits, draft_logits, draft_tokens, temperature, top_p,
                                   uniforms, exp_noise)


def speculative_sample_core(target_logits, draft_logits, draft_tokens, temperature, top_p,
                            uniforms, exp_noise):
    """`speculative_sample_noise` without validation (what the dispatcher falls back to)."""
    if temperature == 0:
        return greedy_accept(target_logits, draft_tokens)
    B, k1, V = target_logits.shape
    k = k1 - 1
    target_probs = _probs64(target_logits, temperature, top_p)  # [B, k+1, V]
    draft_probs = _probs64(draft_logits, temperature, top_p)  # [B, k, V]
    drafted = draft_tokens.unsqueeze(-1)  # [B, k, 1]
    p_x = target_probs[:, :k].gather(-1, drafted).squeeze(-1)  # [B, k]
    q_x = draft_probs.gather(-1, drafted).squeeze(-1)
    accepted = (q_x > 0) & (uniforms * q_x < p_x)
    n_accepted = accepted.long().cumprod(-1).sum(-1)  # [B]

    at = n_accepted.view(B, 1, 1).expand(B, 1, V)
    p_j = target_probs.gather(1, at).squeeze(1)  # [B, V] at the first rejection, or p_k
    q_j = draft_probs.gather(1, at.clamp_max(k - 1)).squeeze(1)
    q_j = torch.where((n_accepted < k)[:, None], q_j, 0.0)  # no draft at the bonus position
    residual = (p_j - q_j).clamp_min(0.0)
    residual = torch.where((residual > 0).any(-1, keepdim=True), residual, p_j)
    resampled = (residual / exp_noise.double()).argmax(-1)  # [B]

    steps = torch.arange(k1, device=target_logits.device)
    drafts = torch.nn.functional.pad(draft_tokens, (0, 1), value=-1)  # [B, k+1]
    tokens = torch.where(steps < n_accepted[:, None], drafts, -1)
    tokens = torch.where(steps == n_accepted[:, None], resampled[:, None], tokens)
    return tokens, n_accepted + 1


def speculative_sample(target_logits: torch.Tensor, draft_logits: torch.Tensor,
                       draft_tokens: torch.Tensor, temperature: float, top_p: float,
                       generator: torch.Generator | None = None):
    """Speculative sampling step: draws the noise with `generator` on the logits' device and runs
    the fastest exact backend (Triton on CUDA, the C++ op on CPU, else the reference core).
    Same shapes and result contract as `speculative_sample_noise`."""
    _check_step(target_logits, draft_logits, draft_tokens, temperature, top_p)
    if temperature == 0:
        return greedy_accept(target_logits, draft_tokens)
    B, k1, V = target_logits.shape
    u = draw_uniforms((B, k1 - 1), target_logits.device, generator)
    noise = draw_exp_noise((B, V), target_logits.device, generator)
    from specwhisper import backend  # backend imports this module for its fallback

    return backend.speculative_sample_noise(target_logits, draft_logits, draft_tokens,
                                            temperature, top_p, u, noise)


def _check_sampling_params(temperature: float, top_p: float) -> None:
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be finite and >= 0, got {temperature!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if temperature > 0:
        inv_temperature(temperature)


def _check_step(target_logits, draft_logits, draft_tokens, temperature, top_p,
                uniforms=None, exp_noise=None) -> None:
    """Shape, dtype and device checks shared by every backend (no host sync); the noise is
    checked when given."""
    _check_sampling_params(temperature, top_p)
    if target_logits.ndim != 3 or target_logits.shape[1] < 2:
        raise ValueError(f"target_logits must be [B, k+1, V] with k >= 1, got "
                         f"{tuple(target_logits.shape)}")
    B, k1, V = target_logits.shape
    k = k1 - 1
    expected = {"draft_logits": (draft_logits, (B, k, V)), "draft_tokens": (draft_tokens, (B, k)),
                "uniforms": (uniforms, (B, k)), "exp_noise": (exp_noise, (B, V))}
    for name, (tensor, shape) in expected.items():
        if tensor is None:
            continue
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(tensor.shape)}")
        if tensor.device != target_logits.device:
            raise ValueError(f"{name} is on {tensor.device}, target_logits on {target_logits.device}")
    for name, tensor in (("target_logits", target_logits), ("draft_logits", draft_logits)):
        if not tensor.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor, got {tensor.dtype}")
    for name, tensor, dtype in (("draft_tokens", draft_tokens, torch.int64),
                                ("uniforms", uniforms, torch.float64),
                                ("exp_noise", exp_noise, torch.float32)):
        if tensor is not None and tensor.dtype != dtype:
            raise TypeError(f"{name} must be {dtype}, got {tensor.dtype}")
    if V > MAX_VOCAB:
        raise ValueError(f"vocabulary {V} exceeds {MAX_VOCAB} (exact float64 weight sums)")
