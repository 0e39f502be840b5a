"""Exact merge of attention partials computed over disjoint key shards, by their log-sum-exps.

`outs [R, T, H, D]` (each shard's normalized output) and `lses [R, T, H]` (natural LSE, -inf for an empty shard)
give `out [T, H, D] = sum_r exp(lse_r - L) outs_r / sum_r exp(lse_r - L)`, L the max LSE, in fp32. Grid `(T, H)`:
one program reads R LSEs and R rows of D; an empty shard is weighed by zero and its row not read (it may hold
anything); a row with every shard empty writes 0. Any strides (the last dim contiguous), so the partials can be a
view of what an all-to-all received.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _merge_kernel(
    o_ptr, lse_ptr, out_ptr,
    s_or, s_ot, s_oh, s_lr, s_lt, s_lh, s_outt, s_outh,
    R, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    lses = tl.load(lse_ptr + offs_r * s_lr + t * s_lt + h * s_lh, mask=offs_r < R, other=float("-inf"))
    m = tl.max(lses, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)           # every shard empty: all weights 0 below
    w_sum = tl.sum(tl.exp(lses - m), axis=0)
    inv = 1.0 / tl.where(w_sum > 0, w_sum, 1.0)        # (no shard: the weights are 0 anyway)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for r in range(R):
        w = tl.exp(tl.load(lse_ptr + r * s_lr + t * s_lt + h * s_lh) - m) * inv
        row = tl.load(o_ptr + r * s_or + t * s_ot + h * s_oh + offs_d, mask=offs_d < tl.where(w > 0, D, 0),
                      other=0.0)           # an empty shard's row is not read
        acc += w * row.to(tl.float32)
    tl.store(out_ptr + t * s_outt + h * s_outh + offs_d, acc.to(out_ptr.dtype.element_ty), mask=mask_d)


def merge_partials(outs: torch.Tensor, lses: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """out [T, H, D] in outs' dtype (or `out`'s) from outs [R, T, H, D] and lses [R, T, H] fp32."""
    R, T, H, D = outs.shape
    if out is None:
        out = torch.empty((T, H, D), dtype=outs.dtype, device=outs.device)
    if T == 0 or H == 0:
        return out
    _merge_kernel[(T, H)](
        outs, lses, out,
        outs.stride(0), outs.stride(1), outs.stride(2), lses.stride(0), lses.stride(1), lses.stride(2),
        out.stride(0), out.stride(1),
        R, D=D, BLOCK_D=triton.next_power_of_2(D), BLOCK_R=max(triton.next_power_of_2(R), 2),
        num_warps=4 if D >= 256 else 1)
    return out
