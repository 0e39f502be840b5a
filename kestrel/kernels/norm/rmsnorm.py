"""RMSNorm with an optional fused residual add.

    r = x + residual            (rounded once to residual's dtype, written back into `residual`)
    y = weight * (r * rsqrt(mean(r^2) + eps))      (fp32 math on the rounded r, one cast to y's dtype)

r is rounded to nearest even on every backend (spelled out under the interpreter, whose bf16 cast truncates), so
it matches torch's `x + residual` bit for bit. One program normalizes BLOCK_T rows held whole in registers (BLOCK_N = next_pow2(N) <= 16384), so every
element is read once and written once: N = 7168 gives one row a program, per-head N = 128 gives 32 rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.kernels import interpreting
from kestrel.kernels.moe._common import pow2, warps_for

MAX_N = 16384


@triton.jit
def _bf16_rne(x):
    """fp32 -> bf16 rounding to nearest even, spelled out: the interpreter's own cast truncates."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)


# T is every step's token count: unspecialized (Triton would compile a variant per ==1 / %16 class of it), so the
# steps of serving meet only the BLOCK_T variants the warm-up and the graph captures compiled
@triton.jit(do_not_specialize=["T"])
def _add_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, T, N, sx, sr, sy, eps,
                        HAS_RES: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                        RNE_BF16: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    mask = (rows < T)[:, None] & cmask[None, :]
    rows = rows.to(tl.int64)
    x = tl.load(x_ptr + rows[:, None] * sx + cols[None, :], mask=mask, other=0.0)
    if HAS_RES:
        res = tl.load(res_ptr + rows[:, None] * sr + cols[None, :], mask=mask, other=0.0)
        if RNE_BF16:
            r = _bf16_rne(x.to(tl.float32) + res.to(tl.float32))
        else:
            r = (x.to(tl.float32) + res.to(tl.float32)).to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + rows[:, None] * sr + cols[None, :], r, mask=mask)
        rf = r.to(tl.float32)
    else:
        rf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(rf * rf, axis=1) / N + eps)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    y = rf * inv[:, None] * w[None, :]
    tl.store(y_ptr + rows[:, None] * sy + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [T, N] (last dim contiguous, any row stride); weight [N]. Returns (y, r); r is `residual`
    itself (updated in place) when given, else `x`."""
    T, N = x.shape
    if out is None:
        out = torch.empty((T, N), dtype=x.dtype, device=x.device)
    if T == 0:
        return out, (residual if residual is not None else x)
    block_n = pow2(N)
    block_t = max(1, min(64, 4096 // block_n))
    block_t = min(block_t, pow2(T))
    res = residual if residual is not None else x
    grid = (triton.cdiv(T, block_t),)
    _add_rmsnorm_kernel[grid](x, res, weight, out, T, N, x.stride(0), res.stride(0), out.stride(0), float(eps),
                              HAS_RES=residual is not None, BLOCK_T=block_t, BLOCK_N=block_n,
                              RNE_BF16=interpreting() and res.dtype == torch.bfloat16,
                              num_warps=warps_for(block_t * block_n))
    return out, res
