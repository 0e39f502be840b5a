"""K3's residual step in one pass: add a sublayer's output into the partial, mix over depth, RMSNorm.

Per token row (N wide), with v_i over blocks[0..NB) + [r]:
    r = partial + delta           (rounded once to partial's dtype; written to r_out, default partial in place;
                                   delta None: r = partial, copied to r_out when one is given)
    logit_i = (v_i . w) * rsqrt(mean(v_i^2) + eps),  a = softmax_i(logit),  h = sum_i a_i v_i
    h is rounded to partial's dtype (as the separate mix's output is), then
    y = norm_weight * (h * rsqrt(mean(h^2) + eps))     (fp32 math, one cast to partial's dtype)
One program holds one token's row whole and walks the stored blocks with an online softmax, so every block row is
read once; the add, the mix and the norm never leave registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.kernels import interpreting
from kestrel.kernels.moe._common import pow2, warps_for
from kestrel.kernels.norm.attn_res import depth_mix
from kestrel.kernels.norm.rmsnorm import _bf16_rne

MAX_N = 16384


@triton.jit
def rounded_rmsnorm(x, nw_ptr, cols, cmask, N, eps, dtype: tl.constexpr, RNE_BF16: tl.constexpr):
    """One fp32 row rounded to `dtype` (as a separate kernel would store it), then RMSNorm'd in fp32 (un-cast):
    the epilogue of the fused kernels whose unfused form writes the row and normalizes it in a second launch."""
    if RNE_BF16:
        r = _bf16_rne(x).to(tl.float32)
    else:
        r = x.to(dtype).to(tl.float32)
    inv = tl.rsqrt(tl.sum(r * r, axis=0) / N + eps)
    return r * inv * tl.load(nw_ptr + cols, mask=cmask, other=0.0).to(tl.float32)


@triton.jit
def _add_mix_rmsnorm_kernel(d_ptr, p_ptr, r_ptr, b_ptr, w_ptr, nw_ptr, y_ptr, NB, N,
                            sdt, spt, srt, sbb, sbt, syt, eps,
                            HAS_DELTA: tl.constexpr, WRITE_R: tl.constexpr, RNE_BF16: tl.constexpr,
                            BLOCK_N: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    p = tl.load(p_ptr + t * spt + cols, mask=cmask, other=0.0)
    if HAS_DELTA:
        s = p.to(tl.float32) + tl.load(d_ptr + t * sdt + cols, mask=cmask, other=0.0).to(tl.float32)
        if RNE_BF16:
            r = _bf16_rne(s)
        else:
            r = s.to(p_ptr.dtype.element_ty)
    else:
        r = p
    if WRITE_R:
        tl.store(r_ptr + t * srt + cols, r, mask=cmask)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    mixed = depth_mix(r.to(tl.float32), w, b_ptr, NB, sbb, sbt, t, cols, cmask, N, eps)
    y = rounded_rmsnorm(mixed, nw_ptr, cols, cmask, N, eps, p_ptr.dtype.element_ty, RNE_BF16)
    tl.store(y_ptr + t * syt + cols, y.to(y_ptr.dtype.element_ty), mask=cmask)


def add_mix_rmsnorm(delta: torch.Tensor | None, partial: torch.Tensor, blocks: torch.Tensor, w: torch.Tensor,
                    norm_weight: torch.Tensor, eps: float, out: torch.Tensor | None = None,
                    r_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """delta / partial [T, N] (last dim contiguous), blocks [NB, T, N] (NB may be 0), w [N] fp32, norm_weight [N].
    Returns (y [T, N] in partial's dtype, r): r is r_out when given, else partial (updated in place by the add)."""
    T, N = partial.shape
    NB = blocks.shape[0]
    if out is None:
        out = torch.empty((T, N), dtype=partial.dtype, device=partial.device)
    r = r_out if r_out is not None else partial
    if T == 0:
        return out, r
    sbb, sbt = (blocks.stride(0), blocks.stride(1)) if NB > 0 else (0, 0)
    block_n = pow2(N)
    _add_mix_rmsnorm_kernel[(T,)](
        delta if delta is not None else partial, partial, r, blocks, w, norm_weight, out, NB, N,
        delta.stride(0) if delta is not None else 0, partial.stride(0), r.stride(0), sbb, sbt, out.stride(0),
        float(eps), HAS_DELTA=delta is not None, WRITE_R=delta is not None or r_out is not None,
        RNE_BF16=interpreting() and partial.dtype == torch.bfloat16, BLOCK_N=block_n,
        num_warps=warps_for(2 * block_n))
    return out, r
