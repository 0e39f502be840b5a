"""W8A8 FP8 GEMM on Hopper's FP8 tensor cores, and the per-token activation quantization it reads.

`quantize_rows`: x [M, K] (bf16 / fp16 / fp32) -> (e4m3 [M, K], fp32 scale [M, 1]) with scale = amax / 448 of the
row (1 for an all-zero row) and q = e4m3(x / scale), round to nearest even, saturating; the division is IEEE
(`div_rn`), so the codes are bit for bit those of the plain-torch form.

`fp8_gemm`: y [M, N] = (xq * x_scale) @ (w * w_scale)^T with e4m3 operands in `tl.dot` and fp32 accumulation.
The weight scale comes in one of the in-memory forms of `QuantizedWeight`, told apart by dtype and width:
- per row (per channel; a per-tensor scale widened to rows): fp32 [N, 1], applied in the epilogue;
- per 128 x 128 block, widened to rows: fp32 [N, ceil(K/128)];
- MXFP8: e8m0 codes uint8 [N, K/32].
For the last two the scale changes along K, so each K step (BK divides the scale block) is its own dot, scaled per
output column and added to the fp32 accumulator; that also bounds Hopper's reduced-precision FP8 accumulation
(DeepSeek-V3 reports ~14 bits inside a wgmma chain) to one K step. Per-row weights pass max_num_imprecise_acc=32:
promotion after every 32-deep MMA. Decode shapes with too few output tiles to fill the GPU split K over a third grid
axis into an fp32 workspace, summed in a fixed order (deterministic).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.kernels import interpreting
from kestrel.kernels.moe._common import pow2, warps_for
from kestrel.kernels.quant._common import split_k_plan

E4M3_MAX = 448.0


@triton.jit
def _round_to_e4m3(v):
    """fp32 v (|v| <= 448) rounded to the nearest e4m3 value, ties to even, in fp32 arithmetic: the fp8
    conversion after it is then exact. (The GPU's cvt.rn.satfinite would round the same way; Triton's CPU
    interpreter rounds ties up and drops the mantissa carry, so the kernel does not rely on the conversion.)"""
    bits = v.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)            # e4m3 subnormals share the 2**-9 step
    ulp = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)   # 3 mantissa bits
    t = tl.abs(v) * ((127 - (e - 3)) << 23).to(tl.float32, bitcast=True)   # |v| / ulp, exact, < 16
    r = ((t + 12582912.0) - 12582912.0) * ulp                  # 1.5 * 2**23: fp32 addition rounds t to even
    return (r.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)   # v's sign, -0 too


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, K, s_x, s_q, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    rk = tl.arange(0, BLOCK)
    kmask = rk < K
    x = tl.load(x_ptr + row * s_x + rk, mask=kmask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    s = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)
    q = _round_to_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(x, s), -448.0), 448.0))
    tl.store(q_ptr + row * s_q + rk, q.to(tl.float8e4nv), mask=kmask)
    tl.store(s_ptr + row, s)


def quantize_rows(x: torch.Tensor, out: torch.Tensor | None = None,
                  scale_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    M, K = x.shape
    if out is None:
        out = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    if scale_out is None:
        scale_out = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    if M:
        block = pow2(K, 16)
        _quant_rows_kernel[(M,)](x, out, scale_out, K, x.stride(0), out.stride(0), BLOCK=block,
                                 num_warps=warps_for(block))
    return out, scale_out


@triton.jit
def _fp8_gemm_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, y_ptr, M, N, K, K_SPLIT, s_a, s_b, s_sb, s_y, s_ys,
                     SCALE_BLOCK: tl.constexpr, E8M0: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     BK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    mmask = rm < M
    nmask = rn < N
    k_lo = pid_k * K_SPLIT
    rk = k_lo + tl.arange(0, BK)
    a_ptrs = a_ptr + rm.to(tl.int64)[:, None] * s_a + rk[None, :]
    b_ptrs = b_ptr + rn.to(tl.int64)[:, None] * s_b + rk[None, :]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(k_lo, tl.minimum(k_lo + K_SPLIT, K), BK):
        a = tl.load(a_ptrs, mask=mmask[:, None], other=0.0)
        b = tl.load(b_ptrs, mask=nmask[:, None], other=0.0)
        if SCALE_BLOCK:
            sb_raw = tl.load(sb_ptr + rn.to(tl.int64) * s_sb + k0 // SCALE_BLOCK, mask=nmask, other=0)
            if E8M0:
                sb = (sb_raw.to(tl.int32) << 23).to(tl.float32, bitcast=True)      # 2**(code - 127)
            else:
                sb = sb_raw
            acc += tl.dot(a, tl.trans(b)) * sb[None, :]
        else:
            # promote Hopper's reduced-precision FP8 partial sums to fp32 after every 32-deep MMA: promoting once
            # per K step (max_num_imprecise_acc=BK=128) was 2e-3 off the fp32 reference at K=256 on the H200
            acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=32)
        a_ptrs += BK
        b_ptrs += BK
    sa = tl.load(sa_ptr + rm, mask=mmask, other=0.0)
    acc = acc * sa[:, None]
    if not SCALE_BLOCK:
        sb = tl.load(sb_ptr + rn.to(tl.int64) * s_sb, mask=nmask, other=0.0)
        acc = acc * sb[None, :]
    y_ptrs = y_ptr + pid_k.to(tl.int64) * s_ys + rm.to(tl.int64)[:, None] * s_y + rn[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def scale_block(weight_scale: torch.Tensor, K: int) -> int:
    """The K extent of one weight scale: 0 per row, 32 MXFP8, 128 block FP8 (a block scale of one column, K <= 128,
    is a per-row scale)."""
    if weight_scale.dtype == torch.uint8:
        return 32
    return 0 if weight_scale.shape[-1] == 1 else 128


def fp8_config(M: int, N: int, K: int, block: int) -> tuple[int, int, int, int, int]:
    """(BM, BN, BK, num_warps, num_stages), no autotune; BK divides the scale block and K."""
    bk = min(block or 128, 128)
    while K % bk:
        bk //= 2
    if interpreting():
        return 16, min(32, pow2(N, 16)), bk, 4, 1
    if M <= 64:
        return 64, 64, bk, 4, 4 if bk >= 64 else 6
    if M <= 256:
        return 64, 128, bk, 4, 4
    return 128, 128, bk, 8, 3 if bk >= 64 else 4


def fp8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
             out: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
             split_k: int | None = None, config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """y [M, N] (see the module docstring); `config` overrides (BM, BN, BK, num_warps, num_stages) for sweeps
    (BK must divide K and the scale block)."""
    M, K = xq.shape
    N = weight.shape[0]
    if out is None:
        out = torch.empty((M, N), dtype=out_dtype, device=xq.device)
    if M == 0:
        return out
    block = scale_block(weight_scale, K)
    BM, BN, BK, warps, stages = config or fp8_config(M, N, K, block)
    if K % BK or (block and block % BK):
        raise ValueError(f"fp8_gemm: K step {BK} must divide K={K} and the weight scale block {block or K}")
    tiles = triton.cdiv(M, BM) * triton.cdiv(N, BN)
    split_k, per_split = split_k_plan(tiles, K, BK, split_k)
    dst = out if split_k == 1 else torch.empty((split_k, M, N), dtype=torch.float32, device=xq.device)
    _fp8_gemm_kernel[(triton.cdiv(M, BM), triton.cdiv(N, BN), split_k)](
        xq, x_scale, weight, weight_scale, dst, M, N, K, per_split, xq.stride(0), weight.stride(0),
        weight_scale.stride(0), dst.stride(-2), dst.stride(0) if split_k > 1 else 0, SCALE_BLOCK=block,
        E8M0=weight_scale.dtype == torch.uint8, BM=BM, BN=BN, BK=BK, num_warps=warps, num_stages=stages)
    if split_k > 1:
        out.copy_(dst.sum(0))
    return out
