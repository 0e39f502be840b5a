"""MoE combine + RMSNorm in one pass (K3's latent MoE: the weighted sum of each token's expert rows on the 3584
latent, then `routed_expert_norm`, before `routed_expert_up_proj`).

    c[t] = sum_j topk_weights[t, j] * y[slot_to_sorted[t*k + j]]   (fp32, rounded once to y's dtype, as the
                                                                   separate combine stores it)
    out[t] = norm_weight * (c * rsqrt(mean(c^2) + eps))          (fp32 math, one cast)
One program owns one token's whole row (BLOCK_N = next_pow2(N)), so the norm needs no second pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.kernels import interpreting
from kestrel.kernels.moe._common import pow2, warps_for
from kestrel.kernels.norm.add_mix_rmsnorm import rounded_rmsnorm

MAX_N = 16384


@triton.jit
def _combine_norm_kernel(y_ptr, w_ptr, pos_ptr, nw_ptr, o_ptr, N, s_y, s_o, eps,
                         TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, RNE_BF16: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in range(TOP_K):
        p = tl.load(pos_ptr + t * TOP_K + j).to(tl.int64)
        wt = tl.load(w_ptr + t * TOP_K + j).to(tl.float32)
        acc += wt * tl.load(y_ptr + p * s_y + cols, mask=cmask, other=0.0).to(tl.float32)
    out = rounded_rmsnorm(acc, nw_ptr, cols, cmask, N, eps, y_ptr.dtype.element_ty, RNE_BF16)
    tl.store(o_ptr + t * s_o + cols, out.to(o_ptr.dtype.element_ty), mask=cmask)


def moe_combine_rmsnorm(y: torch.Tensor, topk_weights: torch.Tensor, slot_to_sorted: torch.Tensor,
                        norm_weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """y [S, N] (sorted expert rows, unit stride along N), topk_weights fp32 [T, k] contiguous, slot_to_sorted
    int32 [T*k], norm_weight [N] -> out [T, N] in y's dtype."""
    T, k = topk_weights.shape
    N = y.shape[1]
    if out is None:
        out = torch.empty((T, N), dtype=y.dtype, device=y.device)
    if T == 0:
        return out
    block_n = pow2(N)
    _combine_norm_kernel[(T,)](y, topk_weights, slot_to_sorted, norm_weight, out, N, y.stride(0), out.stride(0),
                               float(eps), TOP_K=k, BLOCK_N=block_n,
                               RNE_BF16=interpreting() and y.dtype == torch.bfloat16,
                               num_warps=warps_for(2 * block_n))
    return out
