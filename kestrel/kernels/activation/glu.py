"""Gated activations over a fused gate|up tensor gu [T, 2I] (gate half first, then up half) -> [T, I].

    silu:  y = silu(g) * u
    situ:  y = beta * tanh(g / beta) * sigmoid(g) * lin_beta * tanh(u / lin_beta)      (K3: beta 4, lin_beta 25)
fp32 math, one cast at the store. tanh is written out (no libdevice) so the same source runs under the
interpreter; a Taylor branch keeps it accurate to ~1e-7 relative near zero.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.kernels.moe._common import pow2, warps_for
from kestrel.kernels.norm.rmsnorm import _bf16_rne

ACTS = {"silu": 0, "situ": 1}


@triton.jit
def _tanh(x):
    a = tl.abs(x)
    t = tl.exp(-2.0 * a)
    big = (1.0 - t) / (1.0 + t)
    a2 = a * a
    small = a * (1.0 + a2 * (-1.0 / 3.0 + a2 * (2.0 / 15.0 + a2 * (-17.0 / 315.0))))
    y = tl.where(a < 0.125, small, big)
    return tl.where(x < 0, -y, y)


@triton.jit
def _sigmoid(x):
    z = tl.exp(-tl.abs(x))           # never overflows
    return tl.where(x >= 0, 1.0 / (1.0 + z), z / (1.0 + z))


@triton.jit
def gated(g, u, beta, lin_beta, ACT: tl.constexpr):
    """act(g) * u in fp32: the one formula of every GLU kernel (this one and the GEMM epilogues)."""
    if ACT == 0:
        y = g * _sigmoid(g) * u
    else:
        y = (beta * _tanh(g / beta)) * _sigmoid(g) * (lin_beta * _tanh(u / lin_beta))
    return y


@triton.jit
def glu_epilogue(acc_g, acc_u, beta, lin_beta, ACT: tl.constexpr, DTYPE: tl.constexpr, RNE_BF16: tl.constexpr):
    """A GEMM epilogue's GLU over its fp32 gate and up accumulators: both rounded to the output dtype first, as a
    separate GEMM would store them before the GLU kernel reads them (RNE_BF16: round to nearest even by hand,
    for bf16 under the interpreter, whose cast truncates)."""
    if RNE_BF16:
        g = _bf16_rne(acc_g).to(tl.float32)
        u = _bf16_rne(acc_u).to(tl.float32)
    else:
        g = acc_g.to(DTYPE).to(tl.float32)
        u = acc_u.to(DTYPE).to(tl.float32)
    return gated(g, u, beta, lin_beta, ACT)


@triton.jit
def _glu_kernel(gu_ptr, o_ptr, T, I, s_in, s_out, beta, lin_beta,
                ACT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_I: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (rows < T)[:, None] & (cols < I)[None, :]
    rows = rows.to(tl.int64)
    src = gu_ptr + rows[:, None] * s_in + cols[None, :]
    g = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(src + I, mask=mask, other=0.0).to(tl.float32)
    y = gated(g, u, beta, lin_beta, ACT)
    tl.store(o_ptr + rows[:, None] * s_out + cols[None, :], y.to(o_ptr.dtype.element_ty), mask=mask)


def glu(gu: torch.Tensor, act: str = "silu", beta: float = 4.0, linear_beta: float = 25.0,
        out: torch.Tensor | None = None) -> torch.Tensor:
    T, two_i = gu.shape
    I = two_i // 2
    if out is None:
        out = torch.empty((T, I), dtype=gu.dtype, device=gu.device)
    if T == 0:
        return out
    block_i = min(1024, pow2(I))
    block_t = max(1, min(16, 2048 // block_i, pow2(T)))
    grid = (triton.cdiv(T, block_t), triton.cdiv(I, block_i))
    _glu_kernel[grid](gu, out, T, I, gu.stride(0), out.stride(0), float(beta), float(linear_beta),
                      ACT=ACTS[act], BLOCK_T=block_t, BLOCK_I=block_i, num_warps=warps_for(block_t * block_i))
    return out
