"""Grouped GEMM over the experts of one MoE layer (rows grouped by expert_offsets)."""

from __future__ import annotations

import torch

from kestrel.catalog._op import Arch, OpWrapper, assert_close, gpu, overlaps, tiny
from kestrel.catalog.moe._common import randn, rows_ok, topk_ids
from kestrel.catalog.moe.permute import permute_reference
from kestrel.kernels.moe.grouped_gemm import grouped_gemm

_DTYPES = (torch.bfloat16, torch.float16)


class MoeGroupedGemm(OpWrapper):
    """y[rows of e] = x[rows of e] @ w[e]^T for every expert e, w [E, N, K] (checkpoint layout: w13 stacked as
    [E, 2I, H], w2 as [E, H, I]), rows e = expert_offsets[e]..expert_offsets[e+1]. With sorted_token_ids the
    row p reads x[sorted_token_ids[p]] (the first GEMM gathers tokens in its load, no permuted copy of x);
    without it x is already [S, K] in sorted order (the second GEMM). Returns y [S, N] in sorted order, in
    out's dtype (x's by default; fp32 allowed). Triton kernel (kestrel/kernels/moe/grouped_gemm.py): tiles over
    (expert row tiles, N tiles) found on the device from expert_offsets, fp32 accumulation."""

    ARCHS = (Arch.CPU, Arch.SM90)
    TOLERANCE = ("bf16 output of a K<=3584 dot with fp32 accumulation (products of bf16 exact in fp32): bf16 "
                 "rounding 2^-9 -> rtol 1e-2, atol 1e-2 at |y| ~ 1; fp32 output: summation order, rtol/atol 1e-4")
    WIDTHS = ("E", "N", "K", "gather", "dtype")   # rows = tokens x top-k
    CELLS = (
        tiny("unit: first GEMM (gather by token), 6 tokens, E=8, top-2, H=64 -> 2I=64", T=6, E=8, k=2, N=64, K=64,
             gather=True, dtype=torch.bfloat16),
        tiny("unit: second GEMM (contiguous), I=32 -> H=64, fp32 output", T=6, E=8, k=2, N=64, K=32,
             gather=False, dtype=torch.bfloat16, out_dtype=torch.float32),
        tiny("unit: ragged widths (N=40, K=48), skewed routing so some experts are empty", T=9, E=8, k=2, N=40,
             K=48, gather=True, skew=4.0, dtype=torch.bfloat16),
        gpu("Kimi Linear 48B decode bs1: w13, 8 slots, H 2304 -> 2x1024", T=1, E=256, k=8, N=2048, K=2304,
            gather=True, dtype=torch.bfloat16),
        gpu("Kimi Linear 48B decode bs64: w13, 512 slots over 256 experts", T=64, E=256, k=8, N=2048, K=2304,
            gather=True, dtype=torch.bfloat16),
        gpu("Kimi Linear 48B decode bs256: w2, 2048 slots, 1024 -> 2304", T=256, E=256, k=8, N=2304, K=1024,
            gather=False, dtype=torch.bfloat16),
        gpu("Kimi Linear 48B decode bs1: w2 with the shared expert stacked as expert 256, 9 slots", T=1, E=257, k=9,
            N=2304, K=1024, gather=False, dtype=torch.bfloat16),
        gpu("Kimi Linear 48B decode bs64: w2 with the shared expert as expert 256, 576 slots", T=64, E=257, k=9,
            N=2304, K=1024, gather=False, dtype=torch.bfloat16),
        gpu("Kimi Linear 48B prefill 8192: w13, 65536 slots", T=8192, E=256, k=8, N=2048, K=2304, gather=True,
            dtype=torch.bfloat16),
        gpu("Kimi Linear 48B prefill 8192: w2, 65536 slots", T=8192, E=256, k=8, N=2304, K=1024, gather=False,
            dtype=torch.bfloat16),
        gpu("K3 latent MoE decode bs1: w13, 16 slots, latent 3584 -> 2x3072", T=1, E=896, k=16, N=6144, K=3584,
            gather=True, dtype=torch.bfloat16),
        gpu("K3 latent MoE decode bs64: w13, 1024 slots over 896 experts", T=64, E=896, k=16, N=6144, K=3584,
            gather=True, dtype=torch.bfloat16),
        gpu("K3 latent MoE decode bs64: w2, 3072 -> 3584", T=64, E=896, k=16, N=3584, K=3072, gather=False,
            dtype=torch.bfloat16),
        gpu("K3 latent MoE decode bs256: w13, 4096 slots", T=256, E=896, k=16, N=6144, K=3584, gather=True,
            dtype=torch.bfloat16),
        gpu("K3 latent MoE prefill 8192: w13, 131072 slots", T=8192, E=896, k=16, N=6144, K=3584, gather=True,
            dtype=torch.bfloat16),
        gpu("K3 latent MoE prefill 8192: w2, 131072 slots", T=8192, E=896, k=16, N=3584, K=3072, gather=False,
            dtype=torch.bfloat16),
    )

    @staticmethod
    def raw_call(x, w, expert_offsets, sorted_token_ids=None, out=None):
        return grouped_gemm(x, w, expert_offsets, sorted_token_ids=sorted_token_ids, out=out)

    @staticmethod
    def reference(x, w, expert_offsets, sorted_token_ids=None, out=None):
        S = sorted_token_ids.numel() if sorted_token_ids is not None else x.shape[0]
        E, N, _ = w.shape
        y = torch.zeros((S, N), dtype=torch.float32, device=x.device)
        bounds = expert_offsets.tolist()
        for e in range(E):
            lo, hi = bounds[e], bounds[e + 1]
            if hi == lo:
                continue
            rows = x[sorted_token_ids[lo:hi].long()] if sorted_token_ids is not None else x[lo:hi]
            y[lo:hi] = rows.float() @ w[e].float().t()
        y = y.to(out.dtype if out is not None else x.dtype)
        if out is not None:
            out.copy_(y)
            y = out
        return y

    @staticmethod
    def widths(x, w, expert_offsets, sorted_token_ids=None, out=None):
        return {"E": w.shape[0], "N": w.shape[1], "K": w.shape[2], "gather": sorted_token_ids is not None,
                "dtype": x.dtype}

    @staticmethod
    def is_valid(x, w, expert_offsets, sorted_token_ids=None, out=None):
        why = rows_ok(x, "x")
        if why:
            return why
        if x.dtype not in _DTYPES or w.dtype != x.dtype:
            return f"x / w must both be bf16 or fp16, got {x.dtype} / {w.dtype}"
        if w.dim() != 3 or not w.is_contiguous():
            return f"w must be a contiguous [E, N, K], got {tuple(w.shape)}"
        E, N, K = w.shape
        if x.shape[1] != K:
            return f"x width {x.shape[1]} != K {K}"
        if expert_offsets.shape != (E + 1,) or expert_offsets.dtype != torch.int32 \
                or not expert_offsets.is_contiguous():
            return f"expert_offsets must be contiguous int32 [{E + 1}]"
        if sorted_token_ids is not None:
            if sorted_token_ids.dim() != 1 or sorted_token_ids.dtype != torch.int32 \
                    or not sorted_token_ids.is_contiguous():
                return "sorted_token_ids must be contiguous int32 [S]"
            S = sorted_token_ids.numel()
            if S and (int(sorted_token_ids.min()) < 0 or int(sorted_token_ids.max()) >= x.shape[0]):
                return "sorted_token_ids index rows outside x"
        else:
            S = x.shape[0]
        offs = expert_offsets.cpu().long()
        if int(offs[0]) != 0 or int(offs[-1]) != S or bool((offs[1:] < offs[:-1]).any()):
            return f"expert_offsets must rise from 0 to S={S}"
        if out is not None:
            if out.shape != (S, N) or out.stride(-1) != 1 or out.dtype not in (x.dtype, torch.float32):
                return f"out must be [{S}, {N}] with a contiguous last dim, in x's dtype or fp32"
            if overlaps(out, x) or overlaps(out, w):
                return "out overlaps an input"
        return None

    @staticmethod
    def compare(out, ref):
        tol = 1e-4 if ref.dtype == torch.float32 else 1e-2
        assert_close(out, ref, rtol=tol, atol=tol, what="MoeGroupedGemm")

    @staticmethod
    def make_inputs(spec, device, generator):
        T, E, k, N, K = spec["T"], spec["E"], spec["k"], spec["N"], spec["K"]
        dtype = spec["dtype"]
        perm = permute_reference(topk_ids(T, E, k, generator, device, spec.get("skew", 0.0)), E)
        S = T * k
        out_dtype = spec.get("out_dtype")
        return dict(
            x=randn((T if spec["gather"] else S, K), generator, device, dtype),
            w=randn((E, N, K), generator, device, dtype, scale=K ** -0.5),
            expert_offsets=perm.expert_offsets,
            sorted_token_ids=perm.sorted_token_ids if spec["gather"] else None,
            out=torch.empty((S, N), dtype=out_dtype, device=device) if out_dtype else None,
        )
