"""The experts' first grouped GEMM with the gated activation in its epilogue: h = act(x W_gate^T) * (x W_up^T)
for the rows of each expert, reading x by token id (no permuted copy) and w13 [E, 2I, K] in the checkpoint's
layout (gate rows 0..I, up rows I..2I), so the [S, 2I] gate|up intermediate is never written.

Same tiling as grouped_gemm.py (expert row tiles found on the device from expert_offsets, grid bounded on the
host without reading the routing); each program keeps two fp32 accumulators, the gate tile and the up tile of the
same BN intermediate columns. Both are rounded to x's dtype before the activation, as the separate GEMM stores
them, so the result equals MoeGroupedGemm -> SiluGlu / SituGlu up to summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.kernels import interpreting
from kestrel.kernels.activation.glu import ACTS, glu_epilogue
from kestrel.kernels.moe._common import expert_tile, pow2, tile_of_program, tile_rows
from kestrel.kernels.moe.grouped_gemm import _config


@triton.jit
def _grouped_gemm_glu_kernel(a_ptr, rows_ptr, w_ptr, y_ptr, offs_ptr, E, I, K, s_a, s_we, s_wn, s_y,
                             beta, lin_beta,
                             ACT: tl.constexpr, E_PAD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                             BK: tl.constexpr, EVEN_K: tl.constexpr, F32_DOT: tl.constexpr,
                             RNE_BF16: tl.constexpr):
    pid_m, pid_n = tile_of_program(I, BN)
    e, row_hi, row0 = expert_tile(offs_ptr, E, pid_m, E_PAD, BM)
    if e >= E:
        return
    rm, mmask, src = tile_rows(rows_ptr, row0, row_hi, True, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    nmask = rn < I
    rk = tl.arange(0, BK)
    a_ptrs = a_ptr + src.to(tl.int64)[:, None] * s_a + rk[None, :]
    g_ptrs = w_ptr + e.to(tl.int64) * s_we + rn.to(tl.int64)[None, :] * s_wn + rk[:, None]
    u_ptrs = g_ptrs + I * s_wn
    acc_g = tl.zeros([BM, BN], dtype=tl.float32)
    acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=mmask[:, None], other=0.0)
            bg = tl.load(g_ptrs, mask=nmask[None, :], other=0.0)
            bu = tl.load(u_ptrs, mask=nmask[None, :], other=0.0)
        else:
            kmask = rk + k0 < K
            a = tl.load(a_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0)
            bg = tl.load(g_ptrs, mask=nmask[None, :] & kmask[:, None], other=0.0)
            bu = tl.load(u_ptrs, mask=nmask[None, :] & kmask[:, None], other=0.0)
        if F32_DOT:
            a32 = a.to(tl.float32)
            acc_g = tl.dot(a32, bg.to(tl.float32), acc_g, input_precision="ieee")
            acc_u = tl.dot(a32, bu.to(tl.float32), acc_u, input_precision="ieee")
        else:
            acc_g = tl.dot(a, bg, acc_g)
            acc_u = tl.dot(a, bu, acc_u)
        a_ptrs += BK
        g_ptrs += BK
        u_ptrs += BK
    h = glu_epilogue(acc_g, acc_u, beta, lin_beta, ACT, y_ptr.dtype.element_ty, RNE_BF16)
    y_ptrs = y_ptr + rm.to(tl.int64)[:, None] * s_y + rn[None, :]
    tl.store(y_ptrs, h.to(y_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def grouped_gemm_glu(x: torch.Tensor, w13: torch.Tensor, expert_offsets: torch.Tensor,
                     sorted_token_ids: torch.Tensor, act: str = "silu", beta: float = 4.0,
                     linear_beta: float = 25.0, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] gathered by sorted_token_ids [S]; w13 [E, 2I, K] contiguous -> h [S, I] in x's dtype."""
    E, two_i, K = w13.shape
    I = two_i // 2
    S = sorted_token_ids.numel()
    if out is None:
        out = torch.empty((S, I), dtype=x.dtype, device=x.device)
    if S == 0:
        return out
    BM, BN, BK, warps, stages = _config(S, E, I, K)
    if not interpreting():
        # two weight tiles a stage: at most 128 columns and 4 stages stay under 227 KB of shared memory (the H200
        # sweep: 128 x 128 x 64, 8 warps, 4 stages is this kernel's best at prefill sizes)
        BN, stages = min(BN, 128), min(stages, 4)
    grid = ((triton.cdiv(S, BM) + min(E, S)) * triton.cdiv(I, BN),)        # tile_of_program's order
    _grouped_gemm_glu_kernel[grid](
        x, sorted_token_ids, w13, out, expert_offsets, E, I, K, x.stride(0), w13.stride(0), w13.stride(1),
        out.stride(0), float(beta), float(linear_beta), ACT=ACTS[act], E_PAD=pow2(E), BM=BM, BN=BN, BK=BK,
        EVEN_K=K % BK == 0, F32_DOT=interpreting(), RNE_BF16=interpreting() and x.dtype == torch.bfloat16,
        num_warps=warps, num_stages=stages)
    return out
