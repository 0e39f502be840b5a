"""Per-head matrix products of MLA's absorbed form: q_nope @ W_UK and o_latent @ W_UV^T."""

from __future__ import annotations

import torch

from kestrel.catalog._op import Arch, OpWrapper, assert_close, gpu, tiny
from kestrel.catalog.moe._common import randn


class HeadBmm(OpWrapper):
    """y[t, h] = x[t, h] @ w[h] for x [T, H, K], w [H, K, N] -> y [T, H, N] (fp32 accumulation). torch.bmm over
    the head dimension: cuBLAS's strided batched GEMM is already the best kernel for these shapes."""

    ARCHS = (Arch.CPU, Arch.SM90)
    TOLERANCE = "bf16 output of a K<=512 dot with fp32 accumulation: rel 1e-2 of the row scale; fp32 1e-5"
    WIDTHS = ("H", "K", "N", "dtype")
    CELLS = (
        tiny("unit: absorb q_nope 16 -> latent 32, 3 tokens x 4 heads", T=3, H=4, K=16, N=32, dtype=torch.float32),
        tiny("unit: un-absorb latent 32 -> v 16, bf16", T=5, H=2, K=32, N=16, dtype=torch.bfloat16),
        gpu("Kimi Linear 48B MLA decode bs64: q_nope 128 -> latent 512, 32 heads", T=64, H=32, K=128, N=512,
            dtype=torch.bfloat16),
        gpu("Kimi Linear 48B MLA decode bs64: latent 512 -> v 128, 32 heads", T=64, H=32, K=512, N=128,
            dtype=torch.bfloat16),
        gpu("Kimi Linear 48B KDA decode bs1: f_b and g_b as one batched GEMM, 2 x (rank 128 -> 32 x 128), the "
            "input a strided view of the joined projection", T=1, H=2, K=128, N=4096, dtype=torch.bfloat16),
        gpu("Kimi Linear 48B KDA decode bs64: f_b | g_b, 2 x (128 -> 4096)", T=64, H=2, K=128, N=4096,
            dtype=torch.bfloat16),
        gpu("Kimi Linear 48B KDA prefill 8192: f_b | g_b, 2 x (128 -> 4096)", T=8192, H=2, K=128, N=4096,
            dtype=torch.bfloat16),
        gpu("K3 MLA decode bs128: q_nope 128 -> latent 512, 96 heads", T=128, H=96, K=128, N=512,
            dtype=torch.bfloat16),
        gpu("K3 MLA decode bs128: latent 512 -> v 128, 96 heads", T=128, H=96, K=512, N=128, dtype=torch.bfloat16),
    )

    @staticmethod
    def raw_call(x, w, out=None):
        # the batched GEMM writes straight into the [T, H, N] layout (its per-head matrices are [T, N] with row
        # stride H*N): one launch, and a contiguous result the next projection reads without a copy
        if out is None:
            out = torch.empty((x.shape[0], w.shape[0], w.shape[2]), dtype=x.dtype, device=x.device)
        torch.bmm(x.transpose(0, 1), w, out=out.transpose(0, 1))
        return out

    @staticmethod
    def reference(x, w, out=None):
        return torch.einsum("thk,hkn->thn", x.float(), w.float()).to(x.dtype)

    @staticmethod
    def widths(x, w, out=None):
        return {"H": w.shape[0], "K": w.shape[1], "N": w.shape[2], "dtype": x.dtype}

    @staticmethod
    def is_valid(x, w, out=None):
        if x.dim() != 3 or w.dim() != 3 or x.shape[1] != w.shape[0] or x.shape[2] != w.shape[1]:
            return f"shapes x {tuple(x.shape)} and w {tuple(w.shape)} do not chain as [T,H,K] @ [H,K,N]"
        if x.dtype != w.dtype:
            return f"x {x.dtype} and w {w.dtype} differ"
        return None

    @staticmethod
    def compare(out, ref):
        tol = 1e-5 if ref.dtype == torch.float32 else 2e-2
        assert_close(out, ref, rtol=tol, atol=tol * ref.float().abs().max().item(), what="HeadBmm")

    @staticmethod
    def make_inputs(spec, device, generator):
        T, H, K, N, dt = spec["T"], spec["H"], spec["K"], spec["N"], spec["dtype"]
        return dict(x=randn((T, H, K), generator, device, dt), w=randn((H, K, N), generator, device, dt,
                                                                         scale=K ** -0.5))
