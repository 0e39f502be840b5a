"""The decode router's logits GEMV (kestrel/kernels/moe/router.py `router_logits_small`) against the fp32 GEMM it
replaces for up to SMALL_T tokens, and the kernel compiling for the H200 at every batch class it is launched with."""

from __future__ import annotations

import pytest
import torch

from kestrel.kernels.moe.router import router_logits_small
from helpers import compile_for_sm90


@pytest.mark.parametrize("T,H,E,dtype", [(1, 2304, 256, torch.bfloat16), (3, 2304, 256, torch.bfloat16),
                                         (8, 448, 96, torch.bfloat16), (16, 320, 40, torch.float32),
                                         (5, 2000, 8, torch.bfloat16), (1, 7168, 34, torch.bfloat16),
                                         (1, 2000, 7, torch.float32)])
def test_router_logits_small_matches_the_fp32_gemm(T, H, E, dtype):
    """Real widths (Kimi Linear's 2304 x 256) at batch 1 and 3, K3's 7168 (K in several steps at one token); odd K
    (2000, 320: the masked K step), E not a multiple of the experts a program (7, 34), fp32 weights."""
    g = torch.Generator().manual_seed(T * 1000 + E)
    x = torch.randn(T, H, generator=g).to(dtype)
    w = (torch.randn(E, H, generator=g) * H ** -0.5).to(dtype)
    got = router_logits_small(x, w)
    ref = x.double() @ w.double().t()
    assert got.dtype == torch.float32 and got.shape == (T, E)
    # fp32 sums of exact products, in another order than the GEMM: a few ulps of the sum of |products|
    bound = 8 * torch.finfo(torch.float32).eps * (x.double().abs() @ w.double().abs().t())
    assert ((got.double() - ref).abs() <= bound).all()


def test_router_logits_small_refuses_a_prefill_batch():
    with pytest.raises(ValueError, match="at most"):
        router_logits_small(torch.randn(17, 64), torch.randn(8, 64))


_COMPILE = """
import inspect
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kestrel.kernels.moe import router as R

n = 0
for H in (2304, 7168):                                       # Kimi Linear 48B, K3
    for bt in (1, 2, 4, 8, 16):
        be, bk, warps = R.small_config(bt, H)
        const = dict(BT=bt, BE=be, BK=bk, EVEN_K=H % bk == 0)
        sig = {name: "constexpr" if name in const else "*bf16" if name in ("x_ptr", "w_ptr")
               else "*fp32" if name.endswith("_ptr") else "i32"
               for name in inspect.signature(R._router_logits_kernel.fn).parameters}
        src = ASTSource(fn=R._router_logits_kernel, signature=sig, constexprs=const)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        assert k.asm["cubin"] and "ld.local" not in k.asm["ptx"], (H, bt)     # no register spills
        n += 1
print("cubins", n)
"""


def test_router_logits_kernel_compiles_for_the_h200():
    """Every (K, batch class) the decode steps launch, compiled for sm_90 without spills (no GPU needed)."""
    assert "cubins 10" in compile_for_sm90(_COMPILE)
