"""MoE combine: the routing-weighted sum of each token's k expert rows."""

from __future__ import annotations

import torch

from kestrel.catalog._op import Arch, OpWrapper, assert_close, gpu, overlaps, tiny
from kestrel.catalog.moe._common import randn, rows_ok
from kestrel.kernels.moe.combine import moe_combine

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


class MoeCombine(OpWrapper):
    """out[t] = sum_j topk_weights[t, j] * y[slot_to_sorted[t*k + j]] with y [S, N] the expert outputs in
    sorted order, topk_weights fp32 [T, k], slot_to_sorted int32 [T*k] (MoePermute's inverse map); fp32
    accumulation, output [T, N] in y's dtype. Triton kernel (kestrel/kernels/moe/combine.py): a per-token
    gather, deterministic, no atomics."""

    ARCHS = (Arch.CPU, Arch.SM90)
    TOLERANCE = ("bf16 output of an fp32 sum of k<=16 weighted rows: bf16 rounding 2^-9 -> rtol 1e-2, "
                 "atol 1e-2 at |out| ~ 1; fp32 output: rtol/atol 1e-5")
    WIDTHS = ("k", "N", "dtype")
    CELLS = (
        tiny("unit: 5 tokens, top-2, N=64", T=5, k=2, N=64, dtype=torch.bfloat16),
        tiny("unit: fp32, top-16 as K3, N not a power of two", T=3, k=16, N=96, dtype=torch.float32),
        gpu("Kimi Linear 48B decode bs1: top-8 rows of hidden 2304", T=1, k=8, N=2304, dtype=torch.bfloat16),
        gpu("Kimi Linear 48B decode bs64: top-8 x 2304", T=64, k=8, N=2304, dtype=torch.bfloat16),
        gpu("Kimi Linear 48B decode bs256: top-8 x 2304", T=256, k=8, N=2304, dtype=torch.bfloat16),
        gpu("Kimi Linear 48B decode bs1: top-8 + the shared expert's row (weight 1.0) x 2304", T=1, k=9, N=2304,
            dtype=torch.bfloat16),
        gpu("Kimi Linear 48B decode bs64: top-8 + shared x 2304", T=64, k=9, N=2304, dtype=torch.bfloat16),
        gpu("Kimi Linear 48B prefill 8192: top-8 x 2304", T=8192, k=8, N=2304, dtype=torch.bfloat16),
        gpu("K3 latent MoE decode bs1: top-16 rows of latent 3584", T=1, k=16, N=3584, dtype=torch.bfloat16),
        gpu("K3 latent MoE decode bs64: top-16 x 3584", T=64, k=16, N=3584, dtype=torch.bfloat16),
        gpu("K3 latent MoE decode bs256: top-16 x 3584", T=256, k=16, N=3584, dtype=torch.bfloat16),
        gpu("K3 latent MoE prefill 8192: top-16 x 3584", T=8192, k=16, N=3584, dtype=torch.bfloat16),
    )

    @staticmethod
    def raw_call(y, topk_weights, slot_to_sorted, out=None):
        return moe_combine(y, topk_weights, slot_to_sorted, out=out)

    @staticmethod
    def reference(y, topk_weights, slot_to_sorted, out=None):
        T, k = topk_weights.shape
        rows = y[slot_to_sorted.long()].float().view(T, k, -1)
        res = (rows * topk_weights.float()[..., None]).sum(1).to(y.dtype)
        if out is not None:
            out.copy_(res)
            res = out
        return res

    @staticmethod
    def widths(y, topk_weights, slot_to_sorted, out=None):
        return {"k": topk_weights.shape[1], "N": y.shape[1], "dtype": y.dtype}

    @staticmethod
    def is_valid(y, topk_weights, slot_to_sorted, out=None):
        why = rows_ok(y, "y")
        if why:
            return why
        if y.dtype not in _FLOATS:
            return f"y dtype {y.dtype} unsupported"
        if topk_weights.dim() != 2 or topk_weights.dtype != torch.float32 or not topk_weights.is_contiguous():
            return "topk_weights must be contiguous fp32 [T, k]"
        T, k = topk_weights.shape
        S = y.shape[0]
        if slot_to_sorted.shape != (T * k,) or slot_to_sorted.dtype != torch.int32 \
                or not slot_to_sorted.is_contiguous():
            return f"slot_to_sorted must be contiguous int32 [{T * k}]"
        if T * k and (int(slot_to_sorted.min()) < 0 or int(slot_to_sorted.max()) >= S):
            return f"slot_to_sorted indexes rows outside y ({S})"
        if out is not None:
            if out.shape != (T, y.shape[1]) or out.stride(-1) != 1:
                return f"out must be [{T}, {y.shape[1]}] with a contiguous last dim"
            if overlaps(out, y):
                return "out overlaps y"
        return None

    @staticmethod
    def compare(out, ref):
        tol = 1e-5 if ref.dtype == torch.float32 else 1e-2
        assert_close(out, ref, rtol=tol, atol=tol, what="MoeCombine")

    @staticmethod
    def make_inputs(spec, device, generator):
        T, k, N, dtype = spec["T"], spec["k"], spec["N"], spec["dtype"]
        w = torch.rand((T, k), generator=generator) + 0.05
        w = (w / w.sum(-1, keepdim=True) * 2.446).to(device)
        return dict(
            y=randn((T * k, N), generator, device, dtype),
            topk_weights=w,
            slot_to_sorted=torch.randperm(T * k, generator=generator).to(torch.int32).to(device),
        )
