"""Decoder-step ops for the GPU, the twins of csrc/decode_ops.cpp's: a few rows at a time, each
row's bits independent of the others. A large-v3 step is ~780 kernels of ~3.4 us each on an H200
(GEMVs, layer norms, residual adds, cache scatters, cuDNN attention; bench/measured/gpu-h200-3.md).

`decode_linear`: a linear layer with its neighbours fused: an optional layer norm before it, the
bias, an optional GELU and an optional residual add after it,

    out = residual + gelu(layer_norm(x) @ weight.T + bias)      (each part optional)

Rows are independent bit for bit: every output element is computed by the same operations in the
same order whatever the number of rows or their values (a fixed tile of BLOCK_M rows, the features
in fixed splits each walked BLOCK_K at a time and the splits added in order, each row's layer-norm
statistics from that row alone; no autotuning, which would pick tiles by timing). So a verify pass
of k + 1 tokens and a one-token step give each token the same bits, in float16 too: what exact
speculative decoding in half precision needs (torch's GEMMs pick kernels by shape).

`decode_attention`: attention of a few queries per row to the first n[b, t] slots of a cache
(self-attention: the slots up to the query's position; cross-attention: every audio frame), the
cache cut into chunks of CHUNK slots (one program per (row, head, 16 queries, chunk): the cache is
read once for all of a row's queries, by many programs), then the chunks combined in order. A
query's bits depend only on its own q, n and the slots it reads: not on the other queries, the
number of rows, or how wide the cache is (chunks past n add exact zeros).

References: `decode_linear_reference`, `decode_attention_reference` (float32 arithmetic, the same
roundings to the input dtype).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # rows per tile (the smallest tensor-core tile); more rows take more tiles
# decode_linear's default (block_n, block_k, num_warps, split_k), read at each call; block_k and
# split_k fix the arithmetic. The fastest of those swept on an H200 (bench/gpu_profile.py
# --decode-ops, large-v3 float16, B = 1): a one-token step 2.47 ms, (32, 128, 4, 0) 3.30 ms
LINEAR_TILE = (32, 256, 4, 1024)
# The linear's splits and the attention's chunks added by the last program of each tile to finish
# (a counter per tile) instead of a second kernel: the same bits, half the launches. Read at each
# call. On an H100 (bench/gpu_profile.py's decode-ops section, large-v3 float16, B = 1, graphed)
# a one-token step 2.35 ms against 2.61 ms with the second kernels, 5 tokens 2.55 against 2.83 ms
SERIAL = True
_SQRT_HALF = tl.constexpr(1.0 / math.sqrt(2.0))


@triton.jit
def _linear_epilogue(acc, rm, rn, m_in, n_in, bias_ptr, res_ptr, out_ptr, k_cache_ptr, v_cache_ptr, pos_ptr,
                     stride_rm, stride_om, T, D, stride_cb, stride_ch, stride_cs, stride_pb,
                     HAS_BIAS: tl.constexpr, GELU: tl.constexpr, RESIDUAL: tl.constexpr,
                     KV_WRITE: tl.constexpr, DH: tl.constexpr):
    """bias, GELU, residual, the store and the cache writes of a [rows, cols] float32 tile."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_in, other=0.0).to(tl.float32)[None, :]
    if GELU:  # exact (erf) GELU, as torch's default and Whisper's
        acc = 0.5 * acc * (1.0 + tl.math.erf(acc * _SQRT_HALF))
    out_mask = m_in[:, None] & n_in[None, :]
    if RESIDUAL:  # the sum rounded once, from the float32 result and the residual's value
        r = tl.load(res_ptr + rm[:, None].to(tl.int64) * stride_rm + rn[None, :], mask=out_mask, other=0.0)
        acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32) + r.to(tl.float32)
    tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    if KV_WRITE:  # columns D..2D-1 are keys, 2D..3D-1 values: into the caches at each row's slot
        b, t = rm.to(tl.int64) // T, rm.to(tl.int64) % T
        slot = tl.load(pos_ptr + b * stride_pb + t, mask=m_in, other=0).to(tl.int64)
        is_k = (rn >= D) & (rn < 2 * D)
        is_v = rn >= 2 * D
        c = tl.where(is_v, rn - 2 * D, rn - D).to(tl.int64)
        at = b[:, None] * stride_cb + (c // DH)[None, :] * stride_ch + slot[:, None] * stride_cs + (c % DH)[None, :]
        value = acc.to(k_cache_ptr.dtype.element_ty)
        tl.store(k_cache_ptr + at, value, mask=out_mask & is_k[None, :])
        tl.store(v_cache_ptr + at, value, mask=out_mask & is_v[None, :])


@triton.jit
def _sum_splits(part_ptr, rm, rn, m_in, n_in, M, N, SPLITS, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """part[0] + part[1] + ... (float32, in order) of a [rows, cols] tile; read past L1 (.cg): a
    serial reduction reads what other programs wrote."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for split in range(0, SPLITS):
        at = (split * M + rm[:, None]).to(tl.int64) * N + rn[None, :]
        acc += tl.load(part_ptr + at, mask=m_in[:, None] & n_in[None, :], other=0.0, cache_modifier=".cg")
    return acc


@triton.jit
def _decode_linear_kernel(
    x_ptr, w_ptr, bias_ptr, ln_w_ptr, ln_b_ptr, res_ptr, out_ptr, part_ptr, count_ptr,
    k_cache_ptr, v_cache_ptr, pos_ptr,
    M, N, K, K_SPLIT, eps,
    stride_xm, stride_wn, stride_rm, stride_om,
    T, D, stride_cb, stride_ch, stride_cs, stride_pb,
    HAS_BIAS: tl.constexpr, LN: tl.constexpr, GELU: tl.constexpr, RESIDUAL: tl.constexpr,
    KV_WRITE: tl.constexpr, DH: tl.constexpr, PARTIAL: tl.constexpr, SERIAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):
    """One (BLOCK_N columns, BLOCK_M rows, K_SPLIT features) tile of the product. PARTIAL: its
    float32 sum into part[split, row, col], the splits then added in order (0, 1, ...) by the
    epilogue kernel, or (SERIAL) by whichever of the tile's programs arrives last (a counter per
    tile, left at zero for the next launch), then the epilogue; else (one split) the epilogue."""
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    m_in, n_in = rm < M, rn < N
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm
    if LN:  # each row's mean and variance, float32, from that row alone (every split its own copy)
        total = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_rows + rk[None, :], mask=m_in[:, None] & (rk < K)[None, :], other=0.0)
            total += tl.sum(x.to(tl.float32), axis=1)
        mean = total / K
        squares = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            mask = m_in[:, None] & (rk < K)[None, :]
            x = tl.load(x_rows + rk[None, :], mask=mask, other=0.0)
            d = tl.where(mask, x.to(tl.float32) - mean[:, None], 0.0)
            squares += tl.sum(d * d, axis=1)
        rstd = 1.0 / tl.sqrt(squares / K + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    w_cols = w_ptr + rn[None, :].to(tl.int64) * stride_wn
    k_start = split * K_SPLIT
    for k0 in range(k_start, k_start + K_SPLIT, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_in = rk < K
        x = tl.load(x_rows + rk[None, :], mask=m_in[:, None] & k_in[None, :], other=0.0)
        w = tl.load(w_cols + rk[:, None], mask=k_in[:, None] & n_in[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        if LN:
            g = tl.load(ln_w_ptr + rk, mask=k_in, other=0.0).to(tl.float32)
            b = tl.load(ln_b_ptr + rk, mask=k_in, other=0.0).to(tl.float32)
            x = ((x.to(tl.float32) - mean[:, None]) * rstd[:, None] * g[None, :] + b[None, :]).to(w.dtype)
        if IEEE:  # float32: full-precision products (Triton's default for float32 is TF32)
            acc = tl.dot(x.to(w.dtype), w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x.to(w.dtype), w, acc)
    if PARTIAL:
        at = (split * M + rm[:, None]).to(tl.int64) * N + rn[None, :]
        tl.store(part_ptr + at, acc, mask=m_in[:, None] & n_in[None, :])
        if SERIAL:
            splits = tl.num_programs(2)
            tile = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
            tl.debug_barrier()  # every thread's partial stored before the counter moves
            if tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu") == splits - 1:
                summed = _sum_splits(part_ptr, rm, rn, m_in, n_in, M, N, splits, BLOCK_M, BLOCK_N)
                tl.store(count_ptr + tile, 0)
                _linear_epilogue(summed, rm, rn, m_in, n_in, bias_ptr, res_ptr, out_ptr, k_cache_ptr, v_cache_ptr,
                                 pos_ptr, stride_rm, stride_om, T, D, stride_cb, stride_ch, stride_cs, stride_pb,
                                 HAS_BIAS, GELU, RESIDUAL, KV_WRITE, DH)
    else:
        _linear_epilogue(acc, rm, rn, m_in, n_in, bias_ptr, res_ptr, out_ptr, k_cache_ptr, v_cache_ptr, pos_ptr,
                         stride_rm, stride_om, T, D, stride_cb, stride_ch, stride_cs, stride_pb,
                         HAS_BIAS, GELU, RESIDUAL, KV_WRITE, DH)


@triton.jit
def _decode_linear_epilogue_kernel(
    part_ptr, bias_ptr, res_ptr, out_ptr, k_cache_ptr, v_cache_ptr, pos_ptr,
    M, N, SPLITS, stride_rm, stride_om, T, D, stride_cb, stride_ch, stride_cs, stride_pb,
    HAS_BIAS: tl.constexpr, GELU: tl.constexpr, RESIDUAL: tl.constexpr, KV_WRITE: tl.constexpr,
    DH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The splits' partial sums added in order (0, 1, ...), then the epilogue."""
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_in, n_in = rm < M, rn < N
    acc = _sum_splits(part_ptr, rm, rn, m_in, n_in, M, N, SPLITS, BLOCK_M, BLOCK_N)
    _linear_epilogue(acc, rm, rn, m_in, n_in, bias_ptr, res_ptr, out_ptr, k_cache_ptr, v_cache_ptr, pos_ptr,
                     stride_rm, stride_om, T, D, stride_cb, stride_ch, stride_cs, stride_pb,
                     HAS_BIAS, GELU, RESIDUAL, KV_WRITE, DH)


def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  layer_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None, gelu: bool = False,
                  residual: torch.Tensor | None = None,
                  kv_write: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                  block_n: int | None = None, block_k: int | None = None,
                  num_warps: int | None = None, split_k: int | None = None,
                  serial: bool | None = None) -> torch.Tensor:
    """x [M, K], weight [N, K] (the same float dtype, K contiguous), bias [N] or None;
    layer_norm = (weight [K], bias [K], eps) applied to x first; residual [M, N] added last
    -> [M, N] in x's dtype. `kv_write` = (k_cache, v_cache [B, H, S, Dh], write_pos [B, T]) for a
    fused q/k/v projection (N = 3 H Dh, M = B T): its key and value columns are also written into
    the caches at each row's slot (the scatter the layer would do next).

    The tiling (None takes `LINEAR_TILE`'s): `block_n` columns and `num_warps` a program only
    change the parallel split; `block_k` and `split_k` fix the arithmetic (keep them fixed for
    results that must match): the features are cut into splits of `split_k` (a multiple of
    block_k; 0: one split), each split's product summed in float32 by its own programs (many more
    programs than columns / block_n: a one-row product reads its weights at the GPU's bandwidth
    only with enough of them), and the splits added in order by a second kernel or (`serial`) by
    the last of a tile's programs to finish (the same bits, one launch; the tiles' counters are
    shared by every call on the device, so calls must not run concurrently on two streams)."""
    block_n = block_n or LINEAR_TILE[0]
    block_k = block_k or LINEAR_TILE[1]
    num_warps = num_warps or LINEAR_TILE[2]
    split_k = LINEAR_TILE[3] if split_k is None else split_k
    serial = SERIAL if serial is None else serial
    assert x.ndim == 2 and weight.ndim == 2 and x.shape[1] == weight.shape[1], (x.shape, weight.shape)
    assert x.dtype == weight.dtype and x.dtype in (torch.float16, torch.bfloat16, torch.float32), (x.dtype, weight.dtype)
    assert x.stride(1) == 1 and weight.stride(1) == 1, "the feature dim must be contiguous"
    assert split_k % block_k == 0, f"split_k {split_k}: a multiple of block_k {block_k}"
    M, K = x.shape
    N = weight.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if residual is not None:
        assert residual.shape == (M, N) and residual.stride(1) == 1, residual.shape
    if layer_norm is not None:
        ln_w, ln_b, eps = layer_norm
        assert ln_w.shape == (K,) and ln_b.shape == (K,)
    else:
        ln_w = ln_b = x
        eps = 0.0
    if kv_write is not None:
        k_cache, v_cache, pos = kv_write
        B, H, _, Dh = k_cache.shape
        T = pos.shape[1]
        assert v_cache.shape == k_cache.shape and v_cache.stride() == k_cache.stride(), "k/v caches alike"
        assert k_cache.stride(3) == 1 and pos.shape == (B, T) and pos.stride(1) == 1 and M == B * T
        assert N == 3 * H * Dh and k_cache.dtype == x.dtype, (N, H, Dh, k_cache.dtype)
        cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), pos.stride(0))
    else:
        k_cache = v_cache = pos = x
        T, H, Dh, cache_strides = 1, 1, 16, (0, 0, 0, 0)
    if M == 0:
        return out
    k_split = split_k if 0 < split_k < K else triton.cdiv(K, block_k) * block_k
    splits = triton.cdiv(K, k_split)
    partial = splits > 1
    part = torch.empty((splits, M, N), dtype=torch.float32, device=x.device) if partial else out
    grid = (triton.cdiv(N, block_n), triton.cdiv(M, BLOCK_M), splits)
    serial = serial and partial
    count = _tile_counters(x.device, grid[0] * grid[1]) if serial else out
    epilogue = (bias if bias is not None else x, residual if residual is not None else x, out,
                k_cache, v_cache, pos)
    flags = dict(HAS_BIAS=bias is not None, GELU=gelu, RESIDUAL=residual is not None,
                 KV_WRITE=kv_write is not None, DH=Dh)
    strides = (residual.stride(0) if residual is not None else 0, out.stride(0), T, H * Dh, *cache_strides)
    _decode_linear_kernel[grid](
        x, weight, epilogue[0], ln_w, ln_b, epilogue[1], out, part, count, *epilogue[3:],
        M, N, K, k_split, float(eps), x.stride(0), weight.stride(0), *strides,
        LN=layer_norm is not None, PARTIAL=partial, SERIAL=serial, **flags,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=x.dtype == torch.float32, num_warps=num_warps,
    )
    if partial and not serial:
        _decode_linear_epilogue_kernel[(triton.cdiv(N, 128), triton.cdiv(M, BLOCK_M))](
            part, *epilogue, M, N, splits, *strides, **flags, BLOCK_M=BLOCK_M, BLOCK_N=128, num_warps=4)
    return out


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _tile_counters(device: torch.device, n: int) -> torch.Tensor:
    """int32 zeros, one per output tile, kept per device (every serial launch leaves them at zero).
    Grown outside CUDA-graph capture only: a captured step's warm-up call sizes them first."""
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the decode ops' serial reduction first met this size inside CUDA-graph capture: "
                               "run the call once before capturing it")
        counters = _COUNTERS[device] = torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device)
    return counters


def decode_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                            layer_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                            gelu: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:
    """`decode_linear` in PyTorch: float32 arithmetic, the normalised input rounded to x's dtype
    before the product, the product's result rounded before the residual add, as the kernel does
    (equal to float rounding: the product's summation order differs)."""
    h = x.float()
    if layer_norm is not None:
        ln_w, ln_b, eps = layer_norm
        mean = h.mean(-1, keepdim=True)
        var = ((h - mean) ** 2).mean(-1, keepdim=True)
        h = ((h - mean) * torch.rsqrt(var + eps) * ln_w.float() + ln_b.float()).to(x.dtype).float()
    y = h @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    if gelu:
        y = torch.nn.functional.gelu(y)
    if residual is not None:
        y = y.to(x.dtype).float() + residual.float()
    return y.to(x.dtype)


# --- attention ------------------------------------------------------------------------------------

# cache slots per program (fixed: the combine's order, hence the bits, depend on it); 256 rather
# than 64: the combine of 1500 audio frames' chunks took 332 us a large-v3 step at 64, 148 at 256
CHUNK = 256
QUERIES = 16  # query rows per tile (the smallest tensor-core tile; padding rows are never stored)


@triton.jit
def _attention_chunk_kernel(
    q_ptr, k_ptr, v_ptr, n_ptr, m_ptr, l_ptr, acc_ptr, out_ptr, count_ptr,
    H, T, C, scale,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_nb, stride_ob, stride_ot,
    DH: tl.constexpr, QUERIES: tl.constexpr, CHUNK: tl.constexpr, IEEE: tl.constexpr, SERIAL: tl.constexpr,
):
    """One chunk of slots for up to QUERIES queries of one (row, head): the chunk's max score m,
    sum of exp(score - m) l and the weighted values acc, float32, into [.., C] scratch; SERIAL:
    the last of the tile's chunk programs to finish combines them (else the combine kernel)."""
    bh, qt, c = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    b, h = bh // H, bh % H
    rt = qt * QUERIES + tl.arange(0, QUERIES)
    rs = c * CHUNK + tl.arange(0, CHUNK)
    rd = tl.arange(0, DH)
    t_in = rt < T
    n = tl.load(n_ptr + b * stride_nb + rt, mask=t_in, other=0)  # slots each query reads
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + rt[:, None] * stride_qt + rd[None, :],
                mask=t_in[:, None], other=0.0)
    s_in = rs < tl.max(n, axis=0)
    k = tl.load(k_ptr + b * stride_kb + h * stride_kh + rs[:, None] * stride_ks + rd[None, :],
                mask=s_in[:, None], other=0.0)
    v = tl.load(v_ptr + b * stride_vb + h * stride_vh + rs[:, None] * stride_vs + rd[None, :],
                mask=s_in[:, None], other=0.0)
    if IEEE:  # float32: full-precision products (Triton's default for float32 is TF32)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")  # [QUERIES, CHUNK] float32
    else:
        scores = tl.dot(q, tl.trans(k))
    scores = scores * scale
    scores = tl.where(rs[None, :] < n[:, None], scores, -float("inf"))
    m = tl.max(scores, axis=1)
    m_safe = tl.where(m == -float("inf"), 0.0, m)  # a chunk past a query's slots: p = 0
    p = tl.exp(scores - m_safe[:, None])
    l = tl.sum(p, axis=1)
    if IEEE:
        acc = tl.dot(p, v, input_precision="ieee")  # [QUERIES, DH] float32
    else:
        acc = tl.dot(p.to(v.dtype), v)
    row = (bh * T + rt) * C + c  # scratch index of (row, head, query, chunk)
    tl.store(m_ptr + row, m, mask=t_in)
    tl.store(l_ptr + row, l, mask=t_in)
    tl.store(acc_ptr + row[:, None] * DH + rd[None, :], acc, mask=t_in[:, None])
    if SERIAL:
        tile = bh * tl.num_programs(1) + qt
        tl.debug_barrier()  # every thread's scratch stored before the counter moves
        if tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu") == C - 1:
            _combine_chunks(m_ptr, l_ptr, acc_ptr, out_ptr, bh, qt, H, T, C, stride_ob, stride_ot, DH, QUERIES)
            tl.store(count_ptr + tile, 0)


@triton.jit
def _attention_combine_kernel(
    m_ptr, l_ptr, acc_ptr, out_ptr,
    H, T, C, stride_ob, stride_ot,
    DH: tl.constexpr, QUERIES: tl.constexpr,
):
    _combine_chunks(m_ptr, l_ptr, acc_ptr, out_ptr, tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64),
                    H, T, C, stride_ob, stride_ot, DH, QUERIES)


@triton.jit
def _combine_chunks(m_ptr, l_ptr, acc_ptr, out_ptr, bh, qt, H, T, C, stride_ob, stride_ot,
                    DH: tl.constexpr, QUERIES: tl.constexpr):
    """The chunks of each query combined in order: out[b, t, h * DH:(h + 1) * DH] in out's dtype
    (scratch read past L1, .cg: a serial combine reads what other programs wrote)."""
    b, h = bh // H, bh % H
    rt = qt * QUERIES + tl.arange(0, QUERIES)
    rd = tl.arange(0, DH)
    t_in = rt < T
    base = (bh * T + rt) * C
    top = tl.full([QUERIES], -float("inf"), tl.float32)
    for c in range(0, C):
        top = tl.maximum(top, tl.load(m_ptr + base + c, mask=t_in, other=-float("inf"), cache_modifier=".cg"))
    top = tl.where(top == -float("inf"), 0.0, top)
    total = tl.zeros([QUERIES], dtype=tl.float32)
    acc = tl.zeros([QUERIES, DH], dtype=tl.float32)
    for c in range(0, C):
        scale = tl.exp(tl.load(m_ptr + base + c, mask=t_in, other=-float("inf"), cache_modifier=".cg") - top)
        total += tl.load(l_ptr + base + c, mask=t_in, other=0.0, cache_modifier=".cg") * scale
        acc += tl.load(acc_ptr + (base + c)[:, None] * DH + rd[None, :], mask=t_in[:, None], other=0.0,
                       cache_modifier=".cg") * scale[:, None]
    out = acc / tl.where(t_in, total, 1.0)[:, None]  # (padding queries: never stored)
    tl.store(out_ptr + b * stride_ob + rt[:, None] * stride_ot + h * DH + rd[None, :],
             out.to(out_ptr.dtype.element_ty), mask=t_in[:, None])


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: torch.Tensor,
                     scale: float = 1.0, serial: bool | None = None) -> torch.Tensor:
    """q [B, H, T, Dh], k / v [B, H, S, Dh] (a cache; Dh contiguous), n [B, T] int (each query
    reads slots 0..n-1, 1 <= n <= S), `scale` applied to the float32 scores (Whisper's Dh**-0.5 is
    a power of two for its 64-wide heads: the same bits as scaling q first) -> [B, T, H * Dh] in
    q's dtype, ready for the output projection."""
    B, H, T, Dh = q.shape
    S = k.shape[2]
    assert k.shape == (B, H, S, Dh) and v.shape == (B, H, S, Dh), (q.shape, k.shape, v.shape)
    assert q.dtype == k.dtype == v.dtype, (q.dtype, k.dtype, v.dtype)
    assert Dh >= 16 and Dh & (Dh - 1) == 0, f"head size {Dh}: a power of two >= 16"
    assert n.shape == (B, T) and n.stride(1) == 1, n.shape
    assert all(t.stride(3) == 1 for t in (q, k, v)), "the head dim must be contiguous"
    out = torch.empty((B, T, H * Dh), dtype=q.dtype, device=q.device)
    if B == 0 or T == 0:
        return out
    C = triton.cdiv(S, CHUNK)
    QT = triton.cdiv(T, QUERIES)
    m = torch.empty((B * H * T * C,), dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty((B * H * T * C, Dh), dtype=torch.float32, device=q.device)
    serial = SERIAL if serial is None else serial
    count = _tile_counters(q.device, B * H * QT) if serial else out
    _attention_chunk_kernel[(B * H, QT, C)](
        q, k, v, n, m, l, acc, out, count, H, T, C, float(scale),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), n.stride(0), out.stride(0), out.stride(1),
        DH=Dh, QUERIES=QUERIES, CHUNK=CHUNK, IEEE=q.dtype == torch.float32, SERIAL=serial, num_warps=4)
    if not serial:
        _attention_combine_kernel[(B * H, QT)](
            m, l, acc, out, H, T, C, out.stride(0), out.stride(1), DH=Dh, QUERIES=QUERIES, num_warps=4)
    return out


def decode_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: torch.Tensor,
                               scale: float = 1.0) -> torch.Tensor:
    """`decode_attention` in PyTorch, float32 (the probabilities rounded to the input dtype before
    they weight the values, as the kernel does)."""
    B, H, T, Dh = q.shape
    S = k.shape[2]
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale  # [B, H, T, S]
    visible = torch.arange(S, device=q.device) < n[:, None, :, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    top = scores.amax(-1, keepdim=True)
    p = torch.exp(scores - top)
    out = (p.to(q.dtype).float() @ v.float()) / p.sum(-1, keepdim=True)
    return out.transpose(1, 2).reshape(B, T, H * Dh).to(q.dtype)
