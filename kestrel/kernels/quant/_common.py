"""Launch helpers and epilogue pieces the quantized GEMMs share."""

from __future__ import annotations

import triton
import triton.language as tl

from kestrel.kernels import interpreting
from kestrel.kernels.activation.glu import glu_epilogue

SM_COUNT = 132          # H100 SXM / H200


def split_k_plan(tiles: int, K: int, BK: int, split_k: int | None) -> tuple[int, int]:
    """(number of K splits, K extent of each, a multiple of BK). None picks one: enough splits that about two
    programs per SM stream the weights, each keeping at least 4 K steps; 1 under the interpreter."""
    steps = K // BK
    if split_k is None:
        split_k = 1 if interpreting() or tiles >= 2 * SM_COUNT else max(1, min(2 * SM_COUNT // tiles, steps // 4))
    per_split = triton.cdiv(steps, split_k) * BK
    return triton.cdiv(K, per_split), per_split


@triton.jit
def tensor_scale(acc, g_ptr, e, s_ge, rn, nmask, DIVISOR: tl.constexpr):
    """NVFP4's per-row tensor scale on the accumulator columns rn of expert e: divided (compressed-tensors'
    `weight_global_scale`, rounded as the reference's division) or multiplied (ModelOpt's `weight_scale_2`)."""
    g = tl.load(g_ptr + e.to(tl.int64) * s_ge + rn, mask=nmask, other=1.0)
    if DIVISOR:
        acc = tl.math.div_rn(acc, g[None, :])
    else:
        acc = acc * g[None, :]
    return acc


@triton.jit
def glu_store(acc_g, acc_u, g_ptr, e, s_ge, rn, I, nmask, beta, lin_beta, y_ptr, rm, mmask, s_y, NVFP4: tl.constexpr,
              DIVISOR: tl.constexpr, ACT: tl.constexpr, RNE_BF16: tl.constexpr):
    """The GLU-fused W4A16 GEMMs' epilogue: NVFP4's tensor scale on the gate (columns rn) and up (I + rn)
    accumulators, the GLU (the activation kernels' formula), h stored at rows rm."""
    if NVFP4:
        acc_g = tensor_scale(acc_g, g_ptr, e, s_ge, rn, nmask, DIVISOR)
        acc_u = tensor_scale(acc_u, g_ptr, e, s_ge, I + rn, nmask, DIVISOR)
    h = glu_epilogue(acc_g, acc_u, beta, lin_beta, ACT, y_ptr.dtype.element_ty, RNE_BF16)
    y_ptrs = y_ptr + rm.to(tl.int64)[:, None] * s_y + rn[None, :]
    tl.store(y_ptrs, h.to(y_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])
