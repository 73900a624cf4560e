"""A decoder linear layer for a handful of rows, with its neighbours fused: an optional layer norm
before it, the bias, an optional GELU and an optional residual add after it. The first piece of a
fused GPU decode step (a large-v3 step is ~780 kernels of ~3.4 us each on an H200: GEMVs, layer
norms, residual adds; bench/measured/gpu-h200-3.md).

    out = residual + gelu(layer_norm(x) @ weight.T + bias)      (each part optional)

Rows are independent bit for bit: every output element is computed by the same operations in the
same order whatever the number of rows or their values (a fixed tile of BLOCK_M rows, a fixed
BLOCK_K walk over the features, each row's layer-norm statistics from that row alone; no
autotuning, which would pick tiles by timing). So a verify pass of k + 1 tokens and a one-token
step give each token the same bits, in float16 too: what exact speculative decoding in half
precision needs (torch's GEMMs pick kernels by shape).

Reference: `decode_linear_reference` (float32 arithmetic, the same roundings to the input dtype).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # rows per tile (the smallest tensor-core tile); more rows take more tiles
_SQRT_HALF = tl.constexpr(1.0 / math.sqrt(2.0))


@triton.jit
def _decode_linear_kernel(
    x_ptr, w_ptr, bias_ptr, ln_w_ptr, ln_b_ptr, res_ptr, out_ptr,
    M, N, K, eps,
    stride_xm, stride_wn, stride_rm, stride_om,
    HAS_BIAS: tl.constexpr, LN: tl.constexpr, GELU: tl.constexpr, RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_in, n_in = rm < M, rn < N
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm
    if LN:  # each row's mean and variance, float32, from that row alone
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
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_in = rk < K
        x = tl.load(x_rows + rk[None, :], mask=m_in[:, None] & k_in[None, :], other=0.0)
        w = tl.load(w_cols + rk[:, None], mask=k_in[:, None] & n_in[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        if LN:
            g = tl.load(ln_w_ptr + rk, mask=k_in, other=0.0).to(tl.float32)
            b = tl.load(ln_b_ptr + rk, mask=k_in, other=0.0).to(tl.float32)
            x = ((x.to(tl.float32) - mean[:, None]) * rstd[:, None] * g[None, :] + b[None, :]).to(w.dtype)
        acc = tl.dot(x.to(w.dtype), w, acc)
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


def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  layer_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None, gelu: bool = False,
                  residual: torch.Tensor | None = None, block_n: int = 32, block_k: int = 128) -> torch.Tensor:
    """x [M, K], weight [N, K] (the same float dtype, K contiguous), bias [N] or None;
    layer_norm = (weight [K], bias [K], eps) applied to x first; residual [M, N] added last
    -> [M, N] in x's dtype. `block_n` only changes the parallel split; `block_k` (with BLOCK_M) fixes
    the arithmetic, so keep it fixed for results that must match."""
    assert x.ndim == 2 and weight.ndim == 2 and x.shape[1] == weight.shape[1], (x.shape, weight.shape)
    assert x.dtype == weight.dtype and x.dtype in (torch.float16, torch.bfloat16, torch.float32), (x.dtype, weight.dtype)
    assert x.stride(1) == 1 and weight.stride(1) == 1, "the feature dim must be contiguous"
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
    if M == 0:
        return out
    grid = (triton.cdiv(N, block_n), triton.cdiv(M, BLOCK_M))
    _decode_linear_kernel[grid](
        x, weight, bias if bias is not None else x, ln_w, ln_b, residual if residual is not None else x, out,
        M, N, K, float(eps), x.stride(0), weight.stride(0),
        residual.stride(0) if residual is not None else 0, out.stride(0),
        HAS_BIAS=bias is not None, LN=layer_norm is not None, GELU=gelu, RESIDUAL=residual is not None,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )
    return out


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
