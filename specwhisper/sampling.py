"""Sampling reference: processed probabilities, counter-based noise, race sampling, greedy and
speculative acceptance, resampling.

This module is the spec (a leaf: it imports nothing of ours). The Triton kernels
(`specwhisper/kernels/spec_sample.py`) and the C++ ops (`csrc/`) reproduce `exp_noise`, `race_sample` and
`speculative_sample_noise` bit for bit; `specwhisper.backends.ops` dispatches to them.

Race sampling (Gumbel-max / exponential race): token = argmax_v p(v) / E(v), E(v) ~ Exp(1), is a
sample of p. With counter-based noise E = exp_noise(seed, position, vocabulary id), a draft that
proposes its own race winner under the *same* noise and a target that emits its race winner give
output equal to target-only sampling with that seed, whatever k, batch or draft: the draft only
decides how many target winners one pass confirms.

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


# --- counter-based noise -------------------------------------------------------------------------
# E(seed, position, id) = -log(u), u in (0, 1) from a 32-bit integer hash. The hash works on 32-bit
# lanes (murmur3's fmix32 finalizer), which torch (int64 holding values < 2^32, products split so
# nothing overflows), Triton (uint32) and C++ (uint32_t) compute identically; -log is the fixed
# fp32 sequence of `_neg_log_f32` (Cephes logf), not the platform log.
_M32 = 0xFFFFFFFF
_FMIX_C1, _FMIX_C2 = 0x85EBCA6B, 0xC2B2AE35  # murmur3 fmix32 multipliers
_KEY_SEED = 0x9E3779B9  # golden-ratio constant: the chain's starting offset
_KEY_B = 0x7F4A7C15  # derives a row's second key from its first
_NOISE_SHIFT = 9  # the top 23 bits of the hash make u
_TWO_M24 = 2.0 ** -24  # u = (2 * b + 1) * 2^-24, b < 2^23: exact in fp32, in [2^-24, 1 - 2^-24]
_SQRT_HALF = 0.7071067690849304  # fp32(sqrt(1/2))
_LOG_POLY = (  # Cephes logf: log(1 + x) = x - x^2 / 2 + x^3 P(x), |x| <= sqrt(2) - 1 (fp32 values)
    0.07037683576345444, -0.11514610052108765, 0.11676998436450958, -0.12420140951871872,
    0.14249323308467865, -0.16668057441711426, 0.2000071406364441, -0.24999994039535522,
    0.3333333134651184,
)


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """(h * c) mod 2^32 for int64 h in [0, 2^32), split so no int64 product overflows."""
    return ((((h * (c >> 16)) & 0xFFFF) << 16) + h * (c & 0xFFFF)) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finalizer (a bijection) on int64 values in [0, 2^32)."""
    h = h ^ (h >> 16)
    h = _mul32(h, _FMIX_C1)
    h = h ^ (h >> 13)
    h = _mul32(h, _FMIX_C2)
    return h ^ (h >> 16)


def _row_keys(seed: torch.Tensor, position: torch.Tensor):
    """Two 32-bit keys per row (int64 tensors) from int64 seed and position (all 64 bits used)."""
    key = _fmix32((seed & _M32) ^ _KEY_SEED)
    for part in ((seed >> 32) & _M32, position & _M32, (position >> 32) & _M32):
        key = _fmix32(key ^ part)
    return key, _fmix32(key ^ _KEY_B)


def _neg_log_f32(u: torch.Tensor) -> torch.Tensor:
    """-log(u) for fp32 u in [2^-24, 1) by a fixed sequence of fp32 operations (Cephes logf)."""
    bits = u.view(torch.int32)
    e = (bits >> 23) - 126  # u = m * 2^e, m in [0.5, 1)
    m = ((bits & 0x7FFFFF) | 0x3F000000).view(torch.float32)
    small = m < _SQRT_HALF
    e = torch.where(small, e - 1, e).float()
    x = torch.where(small, (m + m) - 1.0, m - 1.0)  # exact; |x| <= sqrt(2) - 1
    z = x * x
    poly = torch.full_like(x, _LOG_POLY[0])
    for c in _LOG_POLY[1:]:
        poly = poly * x + c
    y = (poly * x) * z
    y = y + e * _LN2_LO
    y = y - z * 0.5
    return -((x + y) + e * _LN2_HI)


def exp_noise(seed: torch.Tensor, position: torch.Tensor, noise_ids: torch.Tensor) -> torch.Tensor:
    """Counter-based Exp(1) noise [N, V] float32 (> 0, finite) keyed by (seed [N] int64,
    position [N] int64, noise_ids [V] int64): the same three integers give the same value on
    every backend, device and batch. noise_ids names each column's token; the same id means the
    same noise (a mapped draft keys its columns by target ids)."""
    key_a, key_b = _row_keys(seed.long()[:, None], position.long()[:, None])  # [N, 1]
    ids = noise_ids.long()[None, :]  # [1, V]
    h = _fmix32(key_a ^ (ids & _M32))
    h = _fmix32(h ^ key_b ^ ((ids >> 32) & _M32))  # [N, V]
    b = (h >> _NOISE_SHIFT).to(torch.int32)  # 23 bits
    u = (b * 2 + 1).float() * _TWO_M24
    return _neg_log_f32(u)


def _row_inv_temperature(temperature) -> float | torch.Tensor:
    """fp32(1 / temperature) as a float, or per row [..., 1] for a float32 tensor [...] (rows with
    temperature <= 0 get 1: they are greedy and their probabilities are unused)."""
    if not isinstance(temperature, torch.Tensor):
        return inv_temperature(temperature)
    t = torch.where(temperature > 0, temperature, 1.0).double()
    return (1.0 / t).float().unsqueeze(-1)  # fp64 divide, then one rounding: as the kernels


def _weights(logits: torch.Tensor, temperature) -> torch.Tensor:
    """Integer weights (float64) proportional to softmax(logits / temperature) over the last dim;
    temperature is a float or a float32 tensor with one value per row."""
    x = logits.float()
    s = (x - x.amax(-1, keepdim=True)) * _row_inv_temperature(temperature)  # fp32, <= 0
    scaled = (_exp_f32(s) * _WEIGHT_SCALE).double()  # exact: a power-of-two scale
    return (scaled + _ROUND_MAGIC64) - _ROUND_MAGIC64


def _top_p_threshold(weights: torch.Tensor, top_p) -> torch.Tensor:
    """The largest weight value tau such that the weights >= tau hold at least top_p of the row's
    mass, [..., 1] (1 when no value does, i.e. top_p > 1: every nonzero weight is kept).

    By the definition: rank the weights, accumulate them (exact: integers below 2^53, in any
    order), and take the weight at the first rank whose running mass reaches the target; tied
    weights are all kept. The kept set {weights >= tau} is unique, so the kernels may search
    differently (a sort-free bisection over the threshold value) and still agree.
    """
    total = weights.sum(-1, keepdim=True)  # exact: integers below 2^53
    if isinstance(top_p, torch.Tensor):  # float32, one value per row
        target = total * top_p.double().unsqueeze(-1)
    else:
        target = total * f32(top_p)
    ranked = weights.sort(-1, descending=True).values
    first = torch.searchsorted(ranked.cumsum(-1), target)  # [..., 1] first rank reaching target
    V = weights.shape[-1]
    return torch.where(first < V, ranked.gather(-1, first.clamp_max(V - 1)), 1.0)


def _probs64(logits: torch.Tensor, temperature, top_p) -> torch.Tensor:
    """Processed probabilities in float64: the values every backend compares. temperature and
    top_p are floats, or float32 tensors with one value per row (no host sync: the threshold is
    then found on every row; with top_p >= 1 it keeps every nonzero weight, as skipping it would)."""
    weights = _weights(logits, temperature)
    if isinstance(top_p, torch.Tensor) or top_p < 1.0:
        weights = torch.where(weights >= _top_p_threshold(weights, top_p), weights, 0.0)
    return weights * (1.0 / weights.sum(-1, keepdim=True))


def probs64(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Processed probabilities [N, V] float64 of logits [N, V] with per-row temperature [N] and
    top_p [N] (float32; rows with temperature <= 0 come out as softmax at temperature 1): exactly
    the probabilities `race_sample` races on. A mapped draft passes these (permuted into target
    ids by `permute_probs`) to `speculative_sample_mapped`."""
    return _probs64(logits, temperature, top_p)


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


def race_sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                seed: torch.Tensor, position: torch.Tensor,
                noise_ids: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of logits [N, V] by the exponential race with counter-based noise:
    argmax_v probs64(v) / exp_noise(seed, position, noise_ids)(v) (first index among ties), or the
    argmax of the logits for rows with temperature <= 0 (no noise). temperature [N] and top_p [N]
    are float32 (per row; top_p >= 1 keeps everything), seed [N] and position [N] int64,
    noise_ids [V] int64 or None for arange(V). Returns int64 [N]. No host sync."""
    scores = _race_scores(logits, temperature, top_p, seed, position, noise_ids)
    return torch.where(temperature > 0, scores.argmax(-1), logits.argmax(-1))


def _race_scores(logits, temperature, top_p, seed, position, noise_ids) -> torch.Tensor:
    """The race's scores [N, V] float64: probs64 / exp_noise (noise_ids None: arange(V))."""
    ids = torch.arange(logits.shape[1], device=logits.device) if noise_ids is None else noise_ids
    return _probs64(logits, temperature, top_p) / exp_noise(seed, position, ids).double()


def race_leads(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
               seed: torch.Tensor, position: torch.Tensor,
               noise_ids: torch.Tensor | None = None) -> torch.Tensor:
    """How far each row's `race_sample` winner leads the best other column, in logit units
    (float32 [N]): a raced row's T · ln(score / runner-up's score) (its scores probs64 / noise),
    an argmax row's (temperature <= 0) logit difference; +inf where no other column could win
    (every other score 0, every other logit -inf). Since the noise is keyed by token, a second
    model's winner differs only where its logits move the columns' difference by more than this:
    a draft stops proposing after a proposal with a small lead (`DraftSide.stop_margin`). The
    C++ op writes the same values (`ops.race_sample(..., leads=)`)."""
    N, V = logits.shape
    inf = torch.full((N,), float("inf"), device=logits.device)
    if V < 2:
        return inf
    top = _race_scores(logits, temperature, top_p, seed, position, noise_ids).topk(2, -1).values
    raced = torch.where(top[:, 1] > 0, (temperature.double() * (top[:, 0].log() - top[:, 1].log())).float(), inf)
    best = logits.float().topk(2, -1).values
    argmax = torch.where(best[:, 1] > -float("inf"), best[:, 0] - best[:, 1], inf)
    return torch.where(temperature > 0, raced, argmax)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits.float()) [N, V] at tokens [N] -> [N] float32 (openai-whisper's
    per-token log probability: suppression applied, temperature not)."""
    logprobs = torch.log_softmax(logits.float(), -1)
    return logprobs.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)


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
    target_probs = _probs64(target_logits, temperature, top_p)  # [B, k+1, V]
    draft_probs = _probs64(draft_logits, temperature, top_p)  # [B, k, V]
    return accept_probs(target_probs, draft_probs, draft_tokens, uniforms, exp_noise)


def accept_probs(target_probs, draft_probs, draft_tokens, uniforms, exp_noise):
    """The accept / recover / bonus rule of `speculative_sample_noise` on processed float64
    probabilities target_probs [B, k+1, V] and draft_probs [B, k, V]. Same result contract."""
    B, k1, V = target_probs.shape
    k = k1 - 1
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

    steps = torch.arange(k1, device=target_probs.device)
    drafts = torch.nn.functional.pad(draft_tokens, (0, 1), value=-1)  # [B, k+1]
    tokens = torch.where(steps < n_accepted[:, None], drafts, -1)
    tokens = torch.where(steps == n_accepted[:, None], resampled[:, None], tokens)
    return tokens, n_accepted + 1


def permute_probs(draft_probs: torch.Tensor, draft_to_target: torch.Tensor,
                  target_vocab: int) -> torch.Tensor:
    """A draft's processed probabilities [..., V_draft] float64 in target ids: [..., V + 1]
    float64 with V = target_vocab, draft id d's mass at draft_to_target[d] ([V_draft] int64,
    injective where >= 0) and the mass of every draft token the target cannot spell
    (draft_to_target == -1) in the extra column V."""
    index = torch.where(draft_to_target >= 0, draft_to_target, target_vocab)
    out = draft_probs.new_zeros((*draft_probs.shape[:-1], target_vocab + 1))
    return out.index_add_(-1, index.to(draft_probs.device), draft_probs)


def speculative_sample_mapped(target_logits: torch.Tensor, draft_probs: torch.Tensor,
                              draft_tokens: torch.Tensor, temperature: float, top_p: float,
                              uniforms: torch.Tensor, exp_noise: torch.Tensor):
    """Speculative sampling with a draft of another vocabulary, given the draft's exact processed
    probabilities instead of its logits.

    target_logits [B, k+1, V] (processed with temperature, top_p as in `processed_probs`);
    draft_probs [B, k, V+1] float64: the draft's `probs64` permuted into target ids by
    `permute_probs` (column V: draft tokens the target cannot spell, to which the target gives
    probability 0, so such a draft is always rejected); draft_tokens [B, k] int64 in [0, V]
    (V for an unspellable proposal); uniforms [B, k] float64 in (0, 1]; exp_noise [B, V+1]
    float32 > 0. The rule and result contract are `speculative_sample_noise`'s: emitted tokens
    follow the target's processed distribution exactly, and none is ever V. temperature == 0 is
    greedy acceptance (an unspellable proposal never matches)."""
    B, k1, V = target_logits.shape
    if draft_probs.shape != (B, k1 - 1, V + 1) or draft_probs.dtype != torch.float64:
        raise ValueError(f"draft_probs must be float64 [B, k, V+1] = {(B, k1 - 1, V + 1)}, got "
                         f"{draft_probs.dtype} {tuple(draft_probs.shape)}")
    _check_sampling_params(temperature, top_p)
    if temperature == 0:
        return greedy_accept(target_logits, draft_tokens)
    target_probs = torch.nn.functional.pad(_probs64(target_logits, temperature, top_p), (0, 1))
    return accept_probs(target_probs, draft_probs, draft_tokens, uniforms, exp_noise)


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
