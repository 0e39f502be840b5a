"""Small Triton helpers shared by the KDA kernels."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    """True when Triton kernels run through the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_runs_on(t: torch.Tensor) -> bool:
    """Whether a Triton kernel can run on `t`'s device here: on CUDA, or on the CPU under the interpreter."""
    return t.is_cuda or interpreting()


def dot_precision(t: torch.Tensor) -> str:
    """fp32 `tl.dot` precision: 3xTF32 on GPUs (near-fp32 accuracy on tensor cores), IEEE in the interpreter."""
    return "tf32x3" if t.is_cuda else "ieee"


@triton.jit
def request_of_scalar(cu_ptr, idx, B, BLOCK_B: tl.constexpr):
    """Index of the request that owns flat position `idx` (a scalar), given the [B+1] prefix array `cu_ptr`:
    the number of requests whose end cu[b+1] <= idx."""
    offs = tl.arange(0, BLOCK_B)
    ends = tl.load(cu_ptr + 1 + offs, mask=offs < B, other=2147483647)
    return tl.sum((ends <= idx).to(tl.int32), axis=0)


@triton.jit
def request_of_vec(cu_ptr, idx, B, BLOCK_B: tl.constexpr):
    """`request_of_scalar` for a 1-D tensor of positions."""
    offs = tl.arange(0, BLOCK_B)
    ends = tl.load(cu_ptr + 1 + offs, mask=offs < B, other=2147483647)
    return tl.sum((ends[None, :] <= idx[:, None]).to(tl.int32), axis=1)
