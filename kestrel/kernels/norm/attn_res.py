"""K3 attention-residual mix over depth.

For each token, over the values v_i in blocks[0..NB) + [partial]:
    logit_i = (v_i . w) * rsqrt(mean(v_i^2) + eps),   a = softmax_i(logit),   out = sum_i a_i v_i
One program holds one token's row whole (BLOCK_N = next_pow2(N)) and runs an online softmax over the NB + 1
values, so each stored block state is read exactly once; fp32 throughout, one cast at the store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.kernels.moe._common import pow2, warps_for

MAX_N = 16384


@triton.jit
def _attn_res_mix_kernel(b_ptr, p_ptr, w_ptr, o_ptr, NB, N, sbb, sbt, spt, sot, eps,
                         BLOCK_N: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    v = tl.load(p_ptr + t * spt + cols, mask=cmask, other=0.0).to(tl.float32)
    mixed = depth_mix(v, w, b_ptr, NB, sbb, sbt, t, cols, cmask, N, eps)
    tl.store(o_ptr + t * sot + cols, mixed.to(o_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def depth_mix(v, w, b_ptr, NB, sbb, sbt, t, cols, cmask, N, eps):
    """The softmax-over-depth mix of the fp32 row v (the partial sum) and token t's NB stored blocks, as an online
    softmax: each block row is read once. Shared by the mix alone and by add + mix + RMSNorm."""
    m = tl.sum(v * w, axis=0) * tl.rsqrt(tl.sum(v * v, axis=0) / N + eps)
    l = tl.exp(m - m)                       # 1.0 as an fp32 scalar tensor (loop-carried type)
    acc = v
    for i in range(NB):
        v = tl.load(b_ptr + i * sbb + t * sbt + cols, mask=cmask, other=0.0).to(tl.float32)
        logit = tl.sum(v * w, axis=0) * tl.rsqrt(tl.sum(v * v, axis=0) / N + eps)
        m_new = tl.maximum(m, logit)
        alpha = tl.exp(m - m_new)
        beta = tl.exp(logit - m_new)
        acc = acc * alpha + v * beta
        l = l * alpha + beta
        m = m_new
    return acc / l


def attn_res_mix(blocks: torch.Tensor, partial: torch.Tensor, w: torch.Tensor, eps: float,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """blocks [NB, T, N] (NB may be 0), partial [T, N], w [N] fp32 -> [T, N] in partial's dtype."""
    NB = blocks.shape[0]
    T, N = partial.shape
    if out is None:
        out = torch.empty((T, N), dtype=partial.dtype, device=partial.device)
    if T == 0:
        return out
    block_n = pow2(N)
    sbb, sbt = (blocks.stride(0), blocks.stride(1)) if NB > 0 else (0, 0)
    _attn_res_mix_kernel[(T,)](blocks, partial, w, out, NB, N, sbb, sbt, partial.stride(0), out.stride(0),
                               float(eps), BLOCK_N=block_n, num_warps=warps_for(2 * block_n))
    return out
