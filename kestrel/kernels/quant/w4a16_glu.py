"""The FP4 experts' first grouped GEMM with the gated activation in its epilogue: h = act(x Wg^T) * (x Wu^T) for
the rows of each expert, W = dequant(w13) read from the checkpoint's packed MXFP4 / NVFP4 stack [E, 2I, K/2]
(gate rows 0..I, up rows I..2I), x read by token id; the [S, 2I] gate|up intermediate never reaches memory.

The W4A16 grouped GEMM (w4a16.py) with two accumulators: each program dequantizes the gate tile and the up tile of
the same BN intermediate columns in its load path (the same helpers, so the same exact bf16 weights), runs two bf16
dots per K step on one activation tile, applies NVFP4's per-row tensor scale to each accumulator, rounds both to
x's dtype (as the separate GEMM stores them) and applies the GLU (the activation kernels' formula). Tiles are
found on the device from expert_offsets (kernels/moe/_common.expert_tile); no host sync, so it runs inside the
decode CUDA graphs. K is never split: the GLU is not linear in the partial sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.kernels import interpreting
from kestrel.kernels.activation.glu import ACTS
from kestrel.kernels.moe._common import expert_tile, pow2, tile_rows
from kestrel.kernels.quant._common import SM_COUNT, glu_store
from kestrel.kernels.quant.w4a16 import (TC_DECODE_BM, decode_path, fp4_dot, fp4_tile_ptrs, is_nvfp4,
                                        w4a16_config)
from kestrel.kernels.quant.w4a16_gemv import ROW_CHOICES, decode_tiles, gemv_glu_launch
from kestrel.kernels.quant.w4a16_tc import tc_glu_launch


@triton.jit
def _w4a16_glu_kernel(a_ptr, rows_ptr, q_ptr, s_ptr, g_ptr, y_ptr, offs_ptr, E, I, K, s_a, s_qe, s_qn, s_se,
                      s_sn, s_ge, s_y, beta, lin_beta, ACT: tl.constexpr, NVFP4: tl.constexpr,
                      DIVISOR: tl.constexpr, E_PAD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                      BK: tl.constexpr, F32_DOT: tl.constexpr, RNE_BF16: tl.constexpr):
    G: tl.constexpr = 16 if NVFP4 else 32
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, row_hi, row0 = expert_tile(offs_ptr, E, pid_m, E_PAD, BM)
    if e >= E:
        return
    rm, mmask, src = tile_rows(rows_ptr, row0, row_hi, True, BM)
    rn = pid_n * BN + tl.arange(0, BN)          # intermediate columns: gate rows rn, up rows I + rn
    nmask = rn < I
    a_ptrs = a_ptr + src.to(tl.int64)[:, None] * s_a + tl.arange(0, BK)[None, :]
    qg_ptrs, sg_ptrs = fp4_tile_ptrs(q_ptr, s_ptr, e, rn, 0, s_qe, s_qn, s_se, s_sn, NVFP4, BK)
    qu_ptrs, su_ptrs = fp4_tile_ptrs(q_ptr, s_ptr, e, I + rn, 0, s_qe, s_qn, s_se, s_sn, NVFP4, BK)
    acc_g = tl.zeros([BM, BN], dtype=tl.float32)
    acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    for _ in range(0, K, BK):
        a = tl.load(a_ptrs, mask=mmask[:, None], other=0.0)
        acc_g = fp4_dot(a, qg_ptrs, sg_ptrs, nmask, acc_g, NVFP4, BN, BK, F32_DOT)
        acc_u = fp4_dot(a, qu_ptrs, su_ptrs, nmask, acc_u, NVFP4, BN, BK, F32_DOT)
        a_ptrs += BK
        qg_ptrs += BK // 2
        qu_ptrs += BK // 2
        sg_ptrs += BK // G
        su_ptrs += BK // G
    glu_store(acc_g, acc_u, g_ptr, e, s_ge, rn, I, nmask, beta, lin_beta, y_ptr, rm, mmask, s_y, NVFP4, DIVISOR, ACT,
              RNE_BF16)


def w4a16_glu_config(rows: int, experts: int, I: int, K: int, decode: bool = True,
                     path: str | None = None) -> tuple[int, int, int, int, int]:
    """(BM, BN, BK, num_warps, num_stages): the W4A16 GEMM's choice over the 2I rows of w13 (`path` as there). The
    decode kernels (BM 1, 2, 4: FMA; BM 16: tensor-core decode) and the 16-row tiles take BN halved, so that gate +
    up stream the separate GEMM's rows per program (the FMA kernel halved once more when that leaves fewer than
    two programs a SM); past that BN is halved too (the two accumulators hold the
    registers of the separate GEMM's one) with 8 warps (Triton 3.6 cannot lower the 64-row tile's two MXFP4 dots
    with 4 for sm_90: "Illegal shared layout")."""
    BM, BN, BK, warps, stages = w4a16_config(rows, experts, 2 * I, K, 32, decode, path)
    if BM in ROW_CHOICES and not interpreting():
        BN //= 2
        if decode_tiles(rows, experts, True, BM) * triton.cdiv(I, BN) < 2 * SM_COUNT:
            # too few programs for the SMs (Kimi Linear at batch 1: 8 experts x 32 tiles): halve the tiles again.
            # H200, in CUDA graphs, L2-cold (benchmarks/results/h200_w4a16_small_session13.json): 15.2 -> 13.7 us
            BN //= 2
    elif BM == TC_DECODE_BM and decode:
        BN = max(16, BN // 2)
    elif BM > 16:
        BN, warps = BN // 2, 8
    return BM, BN, BK, warps, stages


def w4a16_glu_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, second: torch.Tensor | None,
                   divisor: bool, expert_offsets: torch.Tensor, sorted_token_ids: torch.Tensor, act: str = "silu",
                   beta: float = 4.0, linear_beta: float = 25.0, out: torch.Tensor | None = None,
                   config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """x [T, K] gathered by sorted_token_ids [S]; packed [E, 2I, K/2] with scale [E, 2I, K/G] (and NVFP4's
    second [E, 2I, 1]) -> h [S, I] in x's dtype, in sorted order. `config` overrides (BM, BN, BK, num_warps,
    num_stages) (benchmarks/quant_gemm_bench.py --sweep; BK must divide K and be a multiple of 32)."""
    E, two_i, Kh = packed.shape
    I, K = two_i // 2, 2 * Kh
    S = sorted_token_ids.numel()
    if out is None:
        out = torch.empty((S, I), dtype=x.dtype, device=x.device)
    if S == 0:
        return out
    bf16 = x.dtype == torch.bfloat16
    BM, BN, BK, warps, stages = config or w4a16_glu_config(S, E, I, K, decode=bf16)
    if K % BK or BK % 32:
        raise ValueError(f"w4a16_glu_gemm: K step {BK} must divide K={K} and be a multiple of 32")
    if BM in ROW_CHOICES and not bf16:
        raise ValueError(f"w4a16_glu_gemm: the decode kernel (BM {BM}) takes bf16 activations, not {x.dtype}")
    nv = is_nvfp4(scale)
    g = second if nv else scale
    rne = interpreting() and x.dtype == torch.bfloat16
    if BM in ROW_CHOICES:
        gemv_glu_launch(x, packed, scale, g, divisor, expert_offsets, sorted_token_ids, out, ACTS[act], beta,
                        linear_beta, (BM, BN, BK, warps, stages), nv, rne)
        return out
    if BM == TC_DECODE_BM and bf16:
        sel = 0
        if config is None and decode_path(S, E) == "split":
            sel = 2         # as w4a16_gemm: the FMA kernel over the one-row experts, the tensor-core one the rest
            gemv_glu_launch(x, packed, scale, g, divisor, expert_offsets, sorted_token_ids, out, ACTS[act], beta,
                            linear_beta, (1,) + w4a16_glu_config(S, E, I, K, path="gemv")[1:], nv, rne, sel=1)
        tc_glu_launch(x, packed, scale, g, divisor, expert_offsets, sorted_token_ids, out, ACTS[act], beta,
                      linear_beta, (BM, BN, BK, warps, stages), nv, rne, sel=sel)
        return out
    grid = (triton.cdiv(S, BM) + min(E, S), triton.cdiv(I, BN))
    _w4a16_glu_kernel[grid](
        x, sorted_token_ids, packed, scale, g, out, expert_offsets, E, I, K, x.stride(0), packed.stride(0),
        packed.stride(1), scale.stride(0), scale.stride(1), g.stride(0), out.stride(0), float(beta),
        float(linear_beta), ACT=ACTS[act], NVFP4=nv, DIVISOR=divisor, E_PAD=pow2(E), BM=BM, BN=BN, BK=BK,
        F32_DOT=interpreting(), RNE_BF16=rne, num_warps=warps, num_stages=stages)
    return out
