"""MoE combine: out[t] = sum_j topk_weights[t, j] * y[slot_to_sorted[t*k + j]]  (fp32 accumulate).

A gather, not a scatter: each program owns one token and a BLOCK_N column slab and reads its k expert rows,
so the sum is deterministic and needs no atomics or zero-fill.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.kernels.moe._common import pow2, warps_for


@triton.jit
def _combine_kernel(y_ptr, w_ptr, pos_ptr, o_ptr, N, s_y, s_o, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in range(TOP_K):
        p = tl.load(pos_ptr + t * TOP_K + j).to(tl.int64)
        wt = tl.load(w_ptr + t * TOP_K + j).to(tl.float32)
        v = tl.load(y_ptr + p * s_y + cols, mask=cmask, other=0.0).to(tl.float32)
        acc += wt * v
    tl.store(o_ptr + t * s_o + cols, acc.to(o_ptr.dtype.element_ty), mask=cmask)


def moe_combine(y: torch.Tensor, topk_weights: torch.Tensor, slot_to_sorted: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """y [S, N] (sorted rows), topk_weights [T, k] contiguous, slot_to_sorted int32 [T*k] -> out [T, N]."""
    T, k = topk_weights.shape
    N = y.shape[1]
    if out is None:
        out = torch.empty((T, N), dtype=y.dtype, device=y.device)
    if T == 0:
        return out
    block_n = min(1024, pow2(N))
    _combine_kernel[(T, triton.cdiv(N, block_n))](y, topk_weights, slot_to_sorted, out, N, y.stride(0),
                                                    out.stride(0), TOP_K=k, BLOCK_N=block_n,
                                                    num_warps=warps_for(block_n * 2))
    return out
