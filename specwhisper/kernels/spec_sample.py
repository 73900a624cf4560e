"""Sampling kernels: the fused speculative-sampling step (accept / reject / resample in one
launch), counter-based Exp(1) noise, and race sampling.

Algorithm: speculative sampling (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023,
arXiv 2302.01318). One program per batch row walks the draft positions in order; at each it
builds the processed target and draft distributions p and q (softmax at a temperature, then a
sort-free top-p threshold found by bisection, as FlashInfer's pivot search), accepts the draft
token x iff q(x) > 0 and u * q(x) < p(x), and stops at the first rejection. The recovered token
(or the bonus token after k acceptances) is the exponential race argmax(max(p - q, 0) / E).

Race sampling (Gumbel-max trick as an exponential race): one program per row returns
argmax_v p(v) / E(v), E(v) = exp_noise(seed, position, noise_ids[v]) computed in registers by
an fmix32 hash on uint32 lanes and a fixed fp32 log (Cephes logf), or the logits' argmax for
rows with temperature <= 0. Noise: one program per (row, vocabulary tile).

References: `specwhisper.sampling.speculative_sample_noise`, `exp_noise` and `race_sample`,
reproduced bit for bit. That rests on the reference's arithmetic contract: the same fp32 exp polynomial, integer
weights whose float64 sums are exact in any reduction order, and IEEE float64 compares and
divides. fp32 `/` is avoided (Triton lowers it to the approximate div.full.f32) and FMA
contraction is disabled at launch. Tiles past the vocabulary load -inf logits, hence weight 0, and
score -1 in the argmax, below every real score (>= 0): they never win a reduction.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specwhisper import sampling

_EXP_MIN_ARG = tl.constexpr(sampling._EXP_MIN_ARG)
_LOG2E = tl.constexpr(sampling._LOG2E)
_ROUND_MAGIC = tl.constexpr(sampling._ROUND_MAGIC)
_LN2_HI = tl.constexpr(sampling._LN2_HI)
_LN2_LO = tl.constexpr(sampling._LN2_LO)
_C7, _C6, _C5, _C4, _C3, _C2, _C1, _C0 = (tl.constexpr(c) for c in sampling._EXP_POLY)
_WEIGHT_SCALE = tl.constexpr(sampling._WEIGHT_SCALE)
_ROUND_MAGIC64 = tl.constexpr(sampling._ROUND_MAGIC64)
_INF = tl.constexpr(float("inf"))
_KEY_SEED = tl.constexpr(sampling._KEY_SEED)
_KEY_B = tl.constexpr(sampling._KEY_B)
_TWO_M24 = tl.constexpr(sampling._TWO_M24)
_SQRT_HALF = tl.constexpr(sampling._SQRT_HALF)
_L0, _L1, _L2, _L3, _L4, _L5, _L6, _L7, _L8 = (tl.constexpr(c) for c in sampling._LOG_POLY)


@triton.jit
def _exp_f32(s):
    """exp(s), s <= 0: the reference's fixed sequence of fp32 operations."""
    s = tl.maximum(s, _EXP_MIN_ARG)
    n = (s * _LOG2E + _ROUND_MAGIC) - _ROUND_MAGIC
    r = (s - n * _LN2_HI) - n * _LN2_LO
    poly = r * _C7 + _C6
    poly = poly * r + _C5
    poly = poly * r + _C4
    poly = poly * r + _C3
    poly = poly * r + _C2
    poly = poly * r + _C1
    poly = poly * r + _C0
    two_n = ((n.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
    return poly * two_n


@triton.jit
def _weights(logits, row_max, inv_t):
    """Integer weights (float64) of a tile of fp32 logits; -inf logits give 0."""
    scaled = (_exp_f32((logits - row_max) * inv_t) * _WEIGHT_SCALE).to(tl.float64)
    return (scaled + _ROUND_MAGIC64) - _ROUND_MAGIC64


@triton.jit
def _load_tile(row_ptr, start, V, BLOCK: tl.constexpr):
    offs = start + tl.arange(0, BLOCK)
    mask = offs < V
    return tl.load(row_ptr + offs, mask=mask, other=-_INF).to(tl.float32), mask


@triton.jit
def _distribution(row_ptr, V, inv_t, top_p, TOP_P: tl.constexpr, BLOCK: tl.constexpr):
    """(row max, top-p threshold tau, 1 / kept mass) of one row of logits."""
    row_max = tl.full([], -_INF, tl.float32)
    for start in range(0, V, BLOCK):
        logits, mask = _load_tile(row_ptr, start, V, BLOCK)
        row_max = tl.maximum(row_max, tl.max(logits, axis=0))
    total = tl.full([], 0.0, tl.float64)
    for start in range(0, V, BLOCK):
        logits, mask = _load_tile(row_ptr, start, V, BLOCK)
        total += tl.sum(_weights(logits, row_max, inv_t), axis=0)  # exact: integers < 2^53
    tau = tl.full([], 1.0, tl.float64)
    kept = total
    if TOP_P:
        tau, kept = _top_p_threshold(row_ptr, V, row_max, inv_t, total, top_p, BLOCK)
    return row_max, tau, 1.0 / kept


@triton.jit
def _top_p_threshold(row_ptr, V, row_max, inv_t, total, top_p, BLOCK: tl.constexpr):
    """(tau, kept mass) of top-p: bisection over the threshold value, snapped to weights (the kept
    set of sampling._top_p_threshold); it stops as soon as no weight lies strictly between lo
    (feasible) and hi (infeasible)."""
    target = total * tl.cast(top_p, tl.float64)
    tau = tl.full([], 1.0, tl.float64)
    kept = total
    hi = tl.full([], _WEIGHT_SCALE + 1.0, tl.float64)
    while hi - tau > 1.0:
        mid = tl.floor((tau + hi) * 0.5)
        mass = tl.full([], 0.0, tl.float64)
        min_kept = tl.full([], _INF, tl.float64)
        max_dropped = tl.full([], -1.0, tl.float64)
        for start in range(0, V, BLOCK):
            logits, mask = _load_tile(row_ptr, start, V, BLOCK)
            weights = _weights(logits, row_max, inv_t)
            keep = weights >= mid
            mass += tl.sum(tl.where(keep, weights, 0.0), axis=0)
            min_kept = tl.minimum(min_kept, tl.min(tl.where(keep, weights, _INF), axis=0))
            max_dropped = tl.maximum(
                max_dropped, tl.max(tl.where(mask & (weights < mid), weights, -1.0), axis=0))
        if mass >= target:
            tau = min_kept
            kept = mass
        else:
            hi = max_dropped + 1.0
    return tau, kept


@triton.jit
def _prob_at(row_ptr, x, V, row_max, inv_t, tau, inv_kept):
    """Processed probability (float64) of token x; 0 if x is outside [0, V)."""
    in_vocab = (x >= 0) & (x < V)
    logit = tl.load(row_ptr + x, mask=in_vocab, other=-_INF).to(tl.float32)
    weight = _weights(logit, row_max, inv_t)
    return tl.where(weight >= tau, weight, 0.0) * inv_kept


@triton.jit
def _argmax_row(row_ptr, V, BLOCK: tl.constexpr):
    """First index of the row's maximum (greedy)."""
    best = tl.full([], -_INF, tl.float32)
    best_idx = tl.full([], 0, tl.int64)
    for start in range(0, V, BLOCK):
        logits, mask = _load_tile(row_ptr, start, V, BLOCK)
        tile_best, tile_idx = tl.max(logits, axis=0, return_indices=True)
        if tile_best > best:
            best = tile_best
            best_idx = start + tile_idx.to(tl.int64)
    return best_idx


@triton.jit
def _spec_sample_kernel(
    target_logits_ptr,  # [B, k+1, V] fp32 / fp16 / bf16
    draft_logits_ptr,  # [B, k, V] fp32 / fp16 / bf16
    draft_tokens_ptr,  # [B, k] int64
    uniforms_ptr,  # [B, k] float64
    exp_noise_ptr,  # [B, V] float32
    tokens_ptr,  # [B, k+1] int64, out
    n_emitted_ptr,  # [B] int64, out
    k,
    V,
    inv_t,  # fp32(1 / temperature)
    top_p,  # fp32(top_p)
    GREEDY: tl.constexpr,
    TOP_P: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    target_ptr = target_logits_ptr + b * (k + 1) * V
    draft_ptr = draft_logits_ptr + b * k * V
    out_ptr = tokens_ptr + b * (k + 1)
    n_accepted = tl.full([], 0, tl.int64)
    rejected = tl.full([], 0, tl.int32)
    if GREEDY:
        while (n_accepted < k) & (rejected == 0):
            x = tl.load(draft_tokens_ptr + b * k + n_accepted)
            if x == _argmax_row(target_ptr + n_accepted * V, V, BLOCK):
                tl.store(out_ptr + n_accepted, x)
                n_accepted += 1
            else:
                rejected = 1
        token = _argmax_row(target_ptr + n_accepted * V, V, BLOCK)
    else:
        # Distributions at the current position; after the loop, those of the first rejection.
        p_max = tl.full([], 0.0, tl.float32)
        p_tau = tl.full([], 1.0, tl.float64)
        p_inv = tl.full([], 0.0, tl.float64)
        q_max = tl.full([], 0.0, tl.float32)
        q_tau = tl.full([], 1.0, tl.float64)
        q_inv = tl.full([], 0.0, tl.float64)
        while (n_accepted < k) & (rejected == 0):
            p_row = target_ptr + n_accepted * V
            q_row = draft_ptr + n_accepted * V
            p_max, p_tau, p_inv = _distribution(p_row, V, inv_t, top_p, TOP_P, BLOCK)
            q_max, q_tau, q_inv = _distribution(q_row, V, inv_t, top_p, TOP_P, BLOCK)
            x = tl.load(draft_tokens_ptr + b * k + n_accepted)
            u = tl.load(uniforms_ptr + b * k + n_accepted)
            p_x = _prob_at(p_row, x, V, p_max, inv_t, p_tau, p_inv)
            q_x = _prob_at(q_row, x, V, q_max, inv_t, q_tau, q_inv)
            if (q_x > 0.0) & (u * q_x < p_x):
                tl.store(out_ptr + n_accepted, x)
                n_accepted += 1
            else:
                rejected = 1
        if rejected == 0:  # bonus position: p_k, and q = 0 below
            p_max, p_tau, p_inv = _distribution(target_ptr + k * V, V, inv_t, top_p, TOP_P, BLOCK)
        p_row = target_ptr + n_accepted * V
        q_row = draft_ptr + n_accepted * V
        noise_ptr = exp_noise_ptr + b * V
        best = tl.full([], -1.0, tl.float64)  # every real score is >= 0
        token = tl.full([], 0, tl.int64)
        residual_max = tl.full([], 0.0, tl.float64)
        for start in range(0, V, BLOCK):
            logits, mask = _load_tile(p_row, start, V, BLOCK)
            weights = _weights(logits, p_max, inv_t)
            p = tl.where(weights >= p_tau, weights, 0.0) * p_inv
            offs = start + tl.arange(0, BLOCK)
            q_logits = tl.load(q_row + offs, mask=offs < V * rejected, other=-_INF)  # q = 0 if bonus
            weights = _weights(q_logits.to(tl.float32), q_max, inv_t)
            residual = tl.maximum(p - tl.where(weights >= q_tau, weights, 0.0) * q_inv, 0.0)
            residual_max = tl.maximum(residual_max, tl.max(residual, axis=0))
            noise = tl.load(noise_ptr + offs, mask=mask, other=1.0).to(tl.float64)
            tile_best, tile_idx = tl.max(tl.where(mask, residual / noise, -1.0), axis=0,
                                         return_indices=True)
            if tile_best > best:
                best = tile_best
                token = start + tile_idx.to(tl.int64)
        if residual_max == 0.0:  # p == q numerically: race on p instead
            best = tl.full([], -1.0, tl.float64)
            for start in range(0, V, BLOCK):
                logits, mask = _load_tile(p_row, start, V, BLOCK)
                weights = _weights(logits, p_max, inv_t)
                p = tl.where(weights >= p_tau, weights, 0.0) * p_inv
                offs = start + tl.arange(0, BLOCK)
                noise = tl.load(noise_ptr + offs, mask=mask, other=1.0).to(tl.float64)
                tile_best, tile_idx = tl.max(tl.where(mask, p / noise, -1.0), axis=0,
                                             return_indices=True)
                if tile_best > best:
                    best = tile_best
                    token = start + tile_idx.to(tl.int64)
    tl.store(out_ptr + n_accepted, token)
    for i in range(0, k + 1):
        if i > n_accepted:
            tl.store(out_ptr + i, -1)
    tl.store(n_emitted_ptr + b, n_accepted + 1)


@triton.jit
def _fmix32(h):
    """murmur3's 32-bit finalizer on uint32 (wrapping multiplies, logical shifts)."""
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    h ^= h >> 16
    return h


@triton.jit
def _row_keys(seed, position):
    """The two uint32 keys of a row from int64 seed and position (sampling._row_keys)."""
    key = _fmix32(seed.to(tl.uint32) ^ _KEY_SEED)
    key = _fmix32(key ^ (seed >> 32).to(tl.uint32))
    key = _fmix32(key ^ position.to(tl.uint32))
    key = _fmix32(key ^ (position >> 32).to(tl.uint32))
    return key, _fmix32(key ^ _KEY_B)


@triton.jit
def _exp_noise(key_a, key_b, ids):
    """Exp(1) noise (fp32, > 0) of int64 ids under a row's keys (sampling.exp_noise)."""
    h = _fmix32(key_a ^ ids.to(tl.uint32))
    h = _fmix32(h ^ key_b ^ (ids >> 32).to(tl.uint32))
    u = ((h >> 9) * 2 + 1).to(tl.float32) * _TWO_M24  # in [2^-24, 1 - 2^-24], exact
    # -log(u), Cephes logf (sampling._neg_log_f32)
    bits = u.to(tl.int32, bitcast=True)
    e = (bits >> 23) - 126
    m = ((bits & 0x7FFFFF) | 0x3F000000).to(tl.float32, bitcast=True)
    small = m < _SQRT_HALF
    e = tl.where(small, e - 1, e).to(tl.float32)
    x = tl.where(small, (m + m) - 1.0, m - 1.0)
    z = x * x
    poly = x * _L0 + _L1
    poly = poly * x + _L2
    poly = poly * x + _L3
    poly = poly * x + _L4
    poly = poly * x + _L5
    poly = poly * x + _L6
    poly = poly * x + _L7
    poly = poly * x + _L8
    y = (poly * x) * z
    y = y + e * _LN2_LO
    y = y - z * 0.5
    return -((x + y) + e * _LN2_HI)


@triton.jit
def _exp_noise_kernel(
    seed_ptr,  # [N] int64
    position_ptr,  # [N] int64
    noise_ids_ptr,  # [V] int64
    out_ptr,  # [N, V] float32, out
    V,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < V
    key_a, key_b = _row_keys(tl.load(seed_ptr + row), tl.load(position_ptr + row))
    ids = tl.load(noise_ids_ptr + offs, mask=mask, other=0)
    tl.store(out_ptr + row * V + offs, _exp_noise(key_a, key_b, ids), mask=mask)


@triton.jit
def _race_tile(row_ptr, start, V, row_max, inv_t, tau, inv_kept, key_a, key_b, noise_ids_ptr,
               HAS_IDS: tl.constexpr, BLOCK: tl.constexpr):
    """(best race score p / E, its first index) of the BLOCK columns from `start`; -1 past V."""
    logits, mask = _load_tile(row_ptr, start, V, BLOCK)
    weights = _weights(logits, row_max, inv_t)
    p = tl.where(weights >= tau, weights, 0.0) * inv_kept
    offs = start + tl.arange(0, BLOCK).to(tl.int64)
    if HAS_IDS:
        ids = tl.load(noise_ids_ptr + offs, mask=mask, other=0)
    else:
        ids = offs
    noise = _exp_noise(key_a, key_b, ids).to(tl.float64)
    best, idx = tl.max(tl.where(mask, p / noise, -1.0), axis=0, return_indices=True)
    return best, start + idx.to(tl.int64)


@triton.jit
def _race_sample_kernel(
    logits_ptr,  # [N, V] fp32 / fp16 / bf16, rows row_stride apart
    temperature_ptr,  # [N] float32
    top_p_ptr,  # [N] float32
    seed_ptr,  # [N] int64
    position_ptr,  # [N] int64
    noise_ids_ptr,  # [V] int64 (unused without HAS_IDS)
    tokens_ptr,  # [N] int64, out
    V,
    row_stride,
    HAS_IDS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_stride
    temperature = tl.load(temperature_ptr + row)
    if temperature > 0.0:
        inv_t = (1.0 / temperature.to(tl.float64)).to(tl.float32)
        top_p = tl.load(top_p_ptr + row)
        if top_p < 1.0:
            row_max, tau, inv_kept = _distribution(row_ptr, V, inv_t, top_p, True, BLOCK)
        else:
            row_max, tau, inv_kept = _distribution(row_ptr, V, inv_t, top_p, False, BLOCK)
        key_a, key_b = _row_keys(tl.load(seed_ptr + row), tl.load(position_ptr + row))
        best = tl.full([], -1.0, tl.float64)  # every real score is >= 0
        token = tl.full([], 0, tl.int64)
        for start in range(0, V, BLOCK):
            tile_best, tile_token = _race_tile(row_ptr, start, V, row_max, inv_t, tau, inv_kept, key_a, key_b,
                                               noise_ids_ptr, HAS_IDS, BLOCK)
            if tile_best > best:
                best = tile_best
                token = tile_token
    else:
        token = _argmax_row(row_ptr, V, BLOCK)
    tl.store(tokens_ptr + row, token)


# --- race sampling split over the vocabulary --------------------------------------------------
# One program per row walks the whole vocabulary (three passes, the race's noise computed in
# registers), so a row costs ~95 us on an H200 whatever the batch: the GPU is nearly idle. Here each
# row is cut into chunks of CHUNK columns, one program per (row, chunk), in four launches (chunk
# maxima; chunk weight sums; each row's top-p threshold, only for rows with top_p < 1; chunk race
# winners) and a fifth that picks each row's token. The result is the same token bit for bit: the
# maximum and the exact float64 integer sums do not depend on the order of reduction, every
# element's weight and score are computed by the same operations as in the row kernel, and ties
# resolve to the lowest index in both (first index within a tile, strict '>' across tiles there,
# the first chunk here).


@triton.jit
def _race_chunk_max_kernel(logits_ptr, pmax_ptr, pidx_ptr, V, row_stride, S, CHUNK: tl.constexpr):
    """pmax[row, c], pidx[row, c]: the maximum logit of chunk c and its first index."""
    row, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    start = chunk * CHUNK
    logits, mask = _load_tile(logits_ptr + row * row_stride, start, V, CHUNK)
    best, idx = tl.max(logits, axis=0, return_indices=True)
    tl.store(pmax_ptr + row * S + chunk, best)
    tl.store(pidx_ptr + row * S + chunk, start + idx.to(tl.int64))


@triton.jit
def _row_max_of_chunks(pmax_ptr, row, S, S_POW2: tl.constexpr):
    c = tl.arange(0, S_POW2)
    return tl.max(tl.load(pmax_ptr + row * S + c, mask=c < S, other=-_INF), axis=0)


@triton.jit
def _inv_temperature(temperature):
    return (1.0 / temperature.to(tl.float64)).to(tl.float32)


@triton.jit
def _race_chunk_sum_kernel(logits_ptr, temperature_ptr, pmax_ptr, psum_ptr, V, row_stride, S,
                           CHUNK: tl.constexpr, S_POW2: tl.constexpr):
    """psum[row, c]: the chunk's integer weights summed (float64, exact) for sampled rows."""
    row, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    temperature = tl.load(temperature_ptr + row)
    if temperature > 0.0:
        row_max = _row_max_of_chunks(pmax_ptr, row, S, S_POW2)
        logits, mask = _load_tile(logits_ptr + row * row_stride, chunk * CHUNK, V, CHUNK)
        tl.store(psum_ptr + row * S + chunk,
                 tl.sum(_weights(logits, row_max, _inv_temperature(temperature)), axis=0))


@triton.jit
def _race_params_kernel(logits_ptr, temperature_ptr, top_p_ptr, pmax_ptr, psum_ptr, tau_ptr, inv_kept_ptr,
                        V, row_stride, S, S_POW2: tl.constexpr, BLOCK: tl.constexpr):
    """tau[row], inv_kept[row] of sampled rows: 1 and 1 / total, or top-p's threshold and mass
    (the only serial pass over a row left, for rows with top_p < 1)."""
    row = tl.program_id(0).to(tl.int64)
    temperature = tl.load(temperature_ptr + row)
    if temperature > 0.0:
        c = tl.arange(0, S_POW2)
        total = tl.sum(tl.load(psum_ptr + row * S + c, mask=c < S, other=0.0), axis=0)  # exact
        tau = tl.full([], 1.0, tl.float64)
        kept = total
        top_p = tl.load(top_p_ptr + row)
        if top_p < 1.0:
            row_max = _row_max_of_chunks(pmax_ptr, row, S, S_POW2)
            tau, kept = _top_p_threshold(logits_ptr + row * row_stride, V, row_max,
                                         _inv_temperature(temperature), total, top_p, BLOCK)
        tl.store(tau_ptr + row, tau)
        tl.store(inv_kept_ptr + row, 1.0 / kept)


@triton.jit
def _race_chunk_kernel(logits_ptr, temperature_ptr, seed_ptr, position_ptr, noise_ids_ptr, pmax_ptr,
                       tau_ptr, inv_kept_ptr, pbest_ptr, pbidx_ptr, V, row_stride, S,
                       HAS_IDS: tl.constexpr, CHUNK: tl.constexpr, S_POW2: tl.constexpr):
    """pbest[row, c], pbidx[row, c]: the chunk's best race score p / E and its first index."""
    row, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    temperature = tl.load(temperature_ptr + row)
    if temperature > 0.0:
        row_max = _row_max_of_chunks(pmax_ptr, row, S, S_POW2)
        tau, inv_kept = tl.load(tau_ptr + row), tl.load(inv_kept_ptr + row)
        key_a, key_b = _row_keys(tl.load(seed_ptr + row), tl.load(position_ptr + row))
        best, token = _race_tile(logits_ptr + row * row_stride, chunk * CHUNK, V, row_max,
                                 _inv_temperature(temperature), tau, inv_kept, key_a, key_b, noise_ids_ptr,
                                 HAS_IDS, CHUNK)
        tl.store(pbest_ptr + row * S + chunk, best)
        tl.store(pbidx_ptr + row * S + chunk, token)


@triton.jit
def _race_pick_kernel(temperature_ptr, pmax_ptr, pidx_ptr, pbest_ptr, pbidx_ptr, tokens_ptr, S,
                      S_POW2: tl.constexpr):
    """tokens[row]: the first chunk's winner among the best (race score, or logit for greedy rows)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, S_POW2)
    # both reductions, then the row's pick (an if/else binding one name to float64 scores in one
    # branch and float32 logits in the other does not compile on a GPU)
    _best, best_chunk = tl.max(tl.load(pbest_ptr + row * S + c, mask=c < S, other=-2.0), axis=0,
                           return_indices=True)
    _max, max_chunk = tl.max(tl.load(pmax_ptr + row * S + c, mask=c < S, other=-_INF), axis=0,
                          return_indices=True)
    if tl.load(temperature_ptr + row) > 0.0:
        token = tl.load(pbidx_ptr + row * S + best_chunk.to(tl.int64))
    else:
        token = tl.load(pidx_ptr + row * S + max_chunk.to(tl.int64))
    tl.store(tokens_ptr + row, token)


def _race_sample_split(logits, temperature, top_p, seed, position, noise_ids, chunk: int, block: int):
    N, V = logits.shape
    S = triton.cdiv(V, chunk)
    S_POW2 = triton.next_power_of_2(S)
    device = logits.device
    pmax = torch.empty((N, S), dtype=torch.float32, device=device)
    pidx = torch.empty((N, S), dtype=torch.int64, device=device)
    psum = torch.empty((N, S), dtype=torch.float64, device=device)
    pbest = torch.empty((N, S), dtype=torch.float64, device=device)
    pbidx = torch.empty((N, S), dtype=torch.int64, device=device)
    tau = torch.empty((N,), dtype=torch.float64, device=device)
    inv_kept = torch.empty((N,), dtype=torch.float64, device=device)
    tokens = torch.empty((N,), dtype=torch.int64, device=device)
    stride = logits.stride(0)
    warps = 8 if chunk >= 2048 else 4
    _race_chunk_max_kernel[(N, S)](logits, pmax, pidx, V, stride, S, CHUNK=chunk, num_warps=warps)
    _race_chunk_sum_kernel[(N, S)](logits, temperature, pmax, psum, V, stride, S, CHUNK=chunk, S_POW2=S_POW2,
                                   num_warps=warps, enable_fp_fusion=False)
    _race_params_kernel[(N,)](logits, temperature, top_p, pmax, psum, tau, inv_kept, V, stride, S,
                              S_POW2=S_POW2, BLOCK=block, num_warps=8 if block >= 2048 else 4,
                              enable_fp_fusion=False)
    _race_chunk_kernel[(N, S)](logits, temperature, seed, position, noise_ids if noise_ids is not None else seed,
                               pmax, tau, inv_kept, pbest, pbidx, V, stride, S, HAS_IDS=noise_ids is not None,
                               CHUNK=chunk, S_POW2=S_POW2, num_warps=warps, enable_fp_fusion=False)
    _race_pick_kernel[(N,)](temperature, pmax, pidx, pbest, pbidx, tokens, S, S_POW2=S_POW2)
    return tokens


def _block_size(V: int, device: torch.device) -> int:
    # A GPU pays per register, the interpreter (CPU tensors) per executed op: larger tiles there.
    return min(2048 if device.type == "cuda" else 8192, triton.next_power_of_2(V))


def speculative_sample_triton(target_logits: torch.Tensor, draft_logits: torch.Tensor,
                              draft_tokens: torch.Tensor, temperature: float, top_p: float,
                              uniforms: torch.Tensor, exp_noise: torch.Tensor, *,
                              block_size: int | None = None):
    """Launcher with the signature and contract of `sampling.speculative_sample_noise`.

    Inputs must be contiguous: logits fp32 / fp16 / bf16, draft_tokens int64, uniforms float64,
    exp_noise float32. `block_size` (a power of two) only changes the tiling, never the result.
    Returns tokens [B, k+1] int64 and n_emitted [B] int64.
    """
    assert target_logits.ndim == 3 and draft_logits.ndim == 3, "logits must be [B, k+1, V], [B, k, V]"
    B, k1, V = target_logits.shape
    k = k1 - 1
    assert k >= 1 and draft_logits.shape == (B, k, V), (target_logits.shape, draft_logits.shape)
    assert draft_tokens.shape == (B, k) and uniforms.shape == (B, k), (draft_tokens.shape, uniforms.shape)
    assert exp_noise.shape == (B, V), exp_noise.shape
    for t in (target_logits, draft_logits):
        assert t.dtype in (torch.float32, torch.float16, torch.bfloat16), t.dtype
    assert draft_tokens.dtype == torch.int64 and uniforms.dtype == torch.float64
    assert exp_noise.dtype == torch.float32
    tensors = (target_logits, draft_logits, draft_tokens, uniforms, exp_noise)
    assert all(t.is_contiguous() for t in tensors), "inputs must be contiguous"
    assert all(t.device == target_logits.device for t in tensors), "inputs must share a device"
    assert V <= sampling.MAX_VOCAB, V
    assert temperature >= 0 and 0 < top_p <= 1, (temperature, top_p)
    greedy = temperature == 0
    tokens = torch.empty((B, k1), dtype=torch.int64, device=target_logits.device)
    n_emitted = torch.empty((B,), dtype=torch.int64, device=target_logits.device)
    block = block_size or _block_size(V, target_logits.device)
    _spec_sample_kernel[(B,)](
        target_logits, draft_logits, draft_tokens, uniforms, exp_noise, tokens, n_emitted,
        k, V, 1.0 if greedy else sampling.inv_temperature(temperature), sampling.f32(top_p),
        GREEDY=greedy, TOP_P=top_p < 1.0, BLOCK=block,
        num_warps=8 if block >= 2048 else 4, enable_fp_fusion=False,
    )
    return tokens, n_emitted


def exp_noise_triton(seed: torch.Tensor, position: torch.Tensor, noise_ids: torch.Tensor, *,
                     block_size: int | None = None) -> torch.Tensor:
    """Launcher of `sampling.exp_noise`: seed [N], position [N], noise_ids [V] (int64,
    contiguous) -> [N, V] float32."""
    assert seed.ndim == 1 and position.shape == seed.shape and noise_ids.ndim == 1
    tensors = (seed, position, noise_ids)
    assert all(t.dtype == torch.int64 and t.is_contiguous() for t in tensors), "int64, contiguous"
    assert all(t.device == seed.device for t in tensors), "inputs must share a device"
    N, V = seed.shape[0], noise_ids.shape[0]
    out = torch.empty((N, V), dtype=torch.float32, device=seed.device)
    block = block_size or min(1024, triton.next_power_of_2(max(V, 1)))
    if N and V:
        _exp_noise_kernel[(N, triton.cdiv(V, block))](seed, position, noise_ids, out, V,
                                                       BLOCK=block, enable_fp_fusion=False)
    return out


def race_sample_triton(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                       seed: torch.Tensor, position: torch.Tensor,
                       noise_ids: torch.Tensor | None = None, *,
                       block_size: int | None = None, chunk_size: int | None = None,
                       split: bool = True) -> torch.Tensor:
    """Launcher of `sampling.race_sample`: logits [N, V] fp32 / fp16 / bf16 with a contiguous
    vocabulary dim, temperature [N] and top_p [N] float32, seed [N] and position [N] int64,
    noise_ids [V] int64 or None -> tokens [N] int64. `split` (default): one program per (row,
    chunk of `chunk_size` columns) in five launches; else one program per row. `block_size` and
    `chunk_size` (powers of two) only change the tiling, never the result."""
    assert logits.ndim == 2 and logits.stride(-1) == 1, "logits must be [N, V], V contiguous"
    assert logits.dtype in (torch.float32, torch.float16, torch.bfloat16), logits.dtype
    N, V = logits.shape
    for t, dtype in ((temperature, torch.float32), (top_p, torch.float32), (seed, torch.int64),
                     (position, torch.int64)):
        assert t.shape == (N,) and t.dtype == dtype and t.is_contiguous(), (t.shape, t.dtype)
    if noise_ids is not None:
        assert noise_ids.shape == (V,) and noise_ids.dtype == torch.int64
        assert noise_ids.is_contiguous()
    tensors = (logits, temperature, top_p, seed, position) + (() if noise_ids is None else (noise_ids,))
    assert all(t.device == logits.device for t in tensors), "inputs must share a device"
    assert 1 <= V <= sampling.MAX_VOCAB, V
    tokens = torch.empty((N,), dtype=torch.int64, device=logits.device)
    block = block_size or _block_size(V, logits.device)
    if N and split:
        chunk = chunk_size or (1024 if logits.device.type == "cuda" else 8192)
        return _race_sample_split(logits, temperature, top_p, seed, position, noise_ids, chunk, block)
    if N:
        _race_sample_kernel[(N,)](
            logits, temperature, top_p, seed, position,
            noise_ids if noise_ids is not None else seed, tokens, V, logits.stride(0),
            HAS_IDS=noise_ids is not None, BLOCK=block,
            num_warps=8 if block >= 2048 else 4, enable_fp_fusion=False,
        )
    return tokens
