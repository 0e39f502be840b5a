"""The batch-1 bf16 GEMV (kestrel/kernels/gemm/gemv.py) against the fp32 product, the Linear entry's choice of it,
and the kernel compiling for the H200 at the configs the projections get."""

from __future__ import annotations

import pytest
import torch

from kestrel.catalog.gemm.linear import Linear, use_gemv
from kestrel.kernels.gemm.gemv import gemv, gemv_config
from helpers import compile_for_sm90


@pytest.mark.parametrize("M,N,K,config", [(1, 37, 2048, None), (2, 64, 1024, None), (1, 33, 768, None),
                                          (1, 50, 512, (8, 256, 4)), (2, 9, 1024, (4, 512, 4))])
def test_gemv_matches_the_fp32_product(M, N, K, config):
    """N not a multiple of the rows a program, both row counts, each K step (1024, 256 for K = 768, overrides)."""
    g = torch.Generator().manual_seed(N * K + M)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(torch.bfloat16)
    got = gemv(x, w, config=config)
    ref = x.double() @ w.double().t()
    # fp32 sums of exact bf16 products, then one bf16 rounding: half an ulp on the GPU, a whole one here (the
    # interpreter's bf16 cast truncates)
    bound = 2 ** -7 * ref.abs() + 8 * torch.finfo(torch.float32).eps * (x.double().abs() @ w.double().abs().t())
    assert got.dtype == torch.bfloat16 and ((got.double() - ref).abs() <= bound + 1e-30).all()
    out = torch.empty(M, N, dtype=torch.bfloat16)
    assert gemv(x, w, out=out, config=config) is out and torch.equal(out, got)


def test_linear_takes_the_gemv_for_one_row_with_k_a_multiple_of_1024_on_cuda_only():
    x, w = torch.randn(1, 4096).bfloat16(), torch.randn(64, 4096).bfloat16()
    assert not use_gemv(x, w, None)                      # the CPU: torch.mm
    meta = torch.device("meta")
    xc = torch.empty(1, 4096, dtype=torch.bfloat16, device=meta)
    wc = torch.empty(64, 4096, dtype=torch.bfloat16, device=meta)
    is_cuda = type(xc).is_cuda
    try:
        type(xc).is_cuda = property(lambda self: True)   # the shape rule alone, without a GPU
        assert use_gemv(xc, wc, None)
        assert not use_gemv(xc.expand(2, 4096), wc, None)                                     # two rows: cuBLAS
        assert not use_gemv(xc[:, :2304], torch.empty(64, 2304, dtype=torch.bfloat16, device=meta), None)
    finally:
        type(xc).is_cuda = is_cuda
    assert gemv_config(2304, 4096) == (2, 1024, 4)
    assert torch.equal(Linear.raw_call(x, w), torch.mm(x, w.t()))


_COMPILE = """
import inspect
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kestrel.kernels.gemm import gemv as G

n = 0
for N, K in ((2304, 4096), (2304, 9216), (7168, 12288), (7168, 33792), (7168, 6144)):   # Kimi Linear 48B, K3
    bn, bk, warps = G.gemv_config(N, K)
    const = dict(M=1, BN=bn, BK=bk)
    sig = {p: "constexpr" if p in const else "*bf16" if p.endswith("_ptr") else "i32"
           for p in inspect.signature(G._gemv_kernel.fn).parameters}
    k = triton.compile(ASTSource(fn=G._gemv_kernel, signature=sig, constexprs=const),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    assert k.asm["cubin"] and "ld.local" not in k.asm["ptx"], (N, K)
    n += 1
print("cubins", n)
"""


def test_gemv_kernel_compiles_for_the_h200():
    assert "cubins 5" in compile_for_sm90(_COMPILE)
