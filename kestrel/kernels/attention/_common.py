"""Small Triton helpers shared by the attention kernels."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def mma(a, b, acc, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b with fp32 accumulation. UPCAST is set only under the CPU interpreter for bf16 operands (its
    tl.dot multiplies bf16's raw uint16 storage); bf16 products are exact in fp32, so the result is the GPU's."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc=acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc=acc, input_precision=DOT_PREC)


def dot_flags(dtype: torch.dtype, device: torch.device) -> dict:
    """DOT_PREC: exact fp32 products for fp32 inputs (no TF32); UPCAST: see `mma` (FP8 operands too: their products
    are exact in fp32 as well)."""
    return dict(DOT_PREC="ieee" if dtype == torch.float32 else "tf32",
                UPCAST=device.type != "cuda" and dtype in (torch.bfloat16, torch.float8_e4m3fn))
