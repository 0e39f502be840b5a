"""Gated RMSNorm: y = weight * rmsnorm(x) * sigmoid(gate), per row (KDA's per-head output norm and gate).

One program normalizes BLOCK_T rows held whole in registers; x, gate and y are each touched once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.kernels.moe._common import pow2, warps_for


@triton.jit
def _gated_rmsnorm_kernel(x_ptr, g_ptr, w_ptr, y_ptr, T, N, sx, sg, sy, eps,
                          BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    mask = (rows < T)[:, None] & cmask[None, :]
    rows = rows.to(tl.int64)
    x = tl.load(x_ptr + rows[:, None] * sx + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + rows[:, None] * sg + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
    y = x * inv[:, None] * w[None, :] * tl.sigmoid(g)
    tl.store(y_ptr + rows[:, None] * sy + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def gated_rmsnorm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """x, gate: [T, N] (last dim contiguous); weight [N]; out [T, N] (default: gate's dtype)."""
    T, N = x.shape
    if out is None:
        out = torch.empty((T, N), dtype=gate.dtype, device=x.device)
    if T == 0:
        return out
    block_n = pow2(N)
    block_t = min(max(1, min(64, 4096 // block_n)), pow2(T))
    _gated_rmsnorm_kernel[(triton.cdiv(T, block_t),)](
        x, gate, weight, out, T, N, x.stride(0), gate.stride(0), out.stride(0), float(eps),
        BLOCK_T=block_t, BLOCK_N=block_n, num_warps=warps_for(block_t * block_n))
    return out


@triton.jit
def _sigmoid_mul_kernel(x_ptr, g_ptr, y_ptr, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < numel
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, (x * tl.sigmoid(g)).to(y_ptr.dtype.element_ty), mask=m)


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x * sigmoid(gate), elementwise over contiguous tensors of one shape (fp32 math)."""
    if out is None:
        out = torch.empty_like(x)
    n = x.numel()
    if n:
        block = 1024
        _sigmoid_mul_kernel[(triton.cdiv(n, block),)](x, gate, out, n, BLOCK=block, num_warps=4)
    return out
