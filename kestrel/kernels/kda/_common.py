"""Small helpers shared by the KDA kernels.

Inside the kernels, sums and prefix sums are written `tl.reduce(x, axis, _sum_combine)` and
`tl.associative_scan(x, axis, _sum_combine)` rather than `tl.sum` / `tl.cumsum`: they compile to the same code,
but under the CPU interpreter every call of a `@triton.jit` helper (which `tl.sum` is) re-patches the language
(milliseconds each), while these two builtins run as one numpy call. For the same reason the kernels inline
their small index computations instead of calling jit helpers.
"""

from __future__ import annotations

import torch

from kestrel.kernels import interpreting
from triton.language.standard import _sum_combine  # noqa: F401  (the combine function `tl.sum` itself uses)


def triton_runs_on(t: torch.Tensor) -> bool:
    """Whether a Triton kernel can run on `t`'s device here: on CUDA, or on the CPU under the interpreter."""
    return t.is_cuda or interpreting()


def dot_precision(t: torch.Tensor) -> str:
    """fp32 `tl.dot` precision: 3xTF32 on GPUs (near-fp32 accuracy on tensor cores), IEEE in the interpreter."""
    return "tf32x3" if t.is_cuda else "ieee"
