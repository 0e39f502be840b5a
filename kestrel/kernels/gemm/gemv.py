"""Dense bf16 GEMV for batch-1 decode: y [M, N] = x [M, K] @ W [N, K]^T for M <= 2, fp32 accumulation.

cuBLAS runs a one-row projection whose N is small against K (o_proj: 4096 -> 2304) as split-K tiles plus a
reduce launch, at about 2 TB/s on the H200 (benchmarks/decode_small_probe.py). Here each program streams BN whole
weight rows over K in [BN, BK] tiles, the next tile loaded before this one's FMAs (Triton does not pipeline loads
that feed no dot, so without it one tile a program is in flight), products summed per lane in fp32 and reduced
once at the end: no split of K, so no second launch and a fixed summation order (graphs and eager steps give the
same bits). K must be a multiple of BK (the models' widths are).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, s_x, s_w, s_y, M: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    nmask = rn < N
    rk = tl.arange(0, BK)
    w_ptrs = w_ptr + rn.to(tl.int64)[:, None] * s_w + rk[None, :]
    acc0 = tl.zeros([BN, BK], dtype=tl.float32)
    acc1 = tl.zeros([BN, BK], dtype=tl.float32)
    w = tl.load(w_ptrs, mask=nmask[:, None], other=0.0)
    for k0 in range(0, K, BK):
        # the next tile (the last step reloads its own: an L1 / L2 hit, instead of a mask)
        w_next = tl.load(w_ptrs + tl.minimum(k0 + BK, K - BK), mask=nmask[:, None], other=0.0)
        wf = w.to(tl.float32)
        acc0 += wf * tl.load(x_ptr + k0 + rk).to(tl.float32)[None, :]
        if M > 1:
            acc1 += wf * tl.load(x_ptr + s_x + k0 + rk).to(tl.float32)[None, :]
        w = w_next
    y = y_ptr + rn
    tl.store(y, tl.sum(acc0, axis=1).to(y_ptr.dtype.element_ty), mask=nmask)
    if M > 1:
        tl.store(y + s_y, tl.sum(acc1, axis=1).to(y_ptr.dtype.element_ty), mask=nmask)


WIDE_BK = 1024      # the K step of the measured-best config; catalog/gemm/linear.py serves K a multiple of it


def gemv_config(N: int, K: int) -> tuple[int, int, int]:
    """(BN, BK, num_warps): 2 rows a program over K in WIDE_BK steps where K allows (the H200's best of 8 configs
    at o_proj and the dense down projection, benchmarks/decode_small_probe.py), else 8 rows and the widest
    power-of-two step that divides K."""
    if K % WIDE_BK == 0:
        return 2, WIDE_BK, 4
    return 8, 512 if K % 512 == 0 else 256, 4


def gemv(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
         config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x [M <= 2, K] @ weight [N, K]^T -> [M, N] in x's dtype, K a multiple of the config's BK, last dims
    contiguous; `config` overrides (BN, BK, num_warps) (the benchmark's sweep)."""
    M, K = x.shape
    N = weight.shape[0]
    bn, bk, warps = config or gemv_config(N, K)
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    _gemv_kernel[(triton.cdiv(N, bn),)](x, weight, out, N, K, x.stride(0), weight.stride(0), out.stride(0),
                                         M=M, BN=bn, BK=bk, num_warps=warps)
    return out
