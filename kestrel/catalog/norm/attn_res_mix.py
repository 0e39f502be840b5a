"""K3 attention residuals: the softmax mix over depth of the stored block states and the running partial."""

from __future__ import annotations

import torch

from kestrel.catalog._op import Arch, OpWrapper, assert_close, gpu, overlaps, tiny
from kestrel.catalog.moe._common import randn, rows_ok
from kestrel.kernels.norm.attn_res import MAX_N, attn_res_mix
from kestrel.ops import norm as norm_ops

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


class AttnResMix(OpWrapper):
    """blocks [NB, T, N] (NB >= 0 stored block states), partial [T, N], w [N] fp32 (= res_norm.weight *
    res_proj.weight), eps. Per token, over v_i in blocks + [partial]:
    logit_i = (v_i . w) * rsqrt(mean(v_i^2) + eps), a = softmax_i(logit), out = sum_i a_i v_i; fp32 math,
    output in partial's dtype; NB = 0 returns partial's values. Triton kernel (online softmax, each state read
    once): kestrel/kernels/norm/attn_res.py."""

    ARCHS = (Arch.CPU, Arch.SM90)
    TOLERANCE = ("bf16 output of an fp32 convex combination (logit dots over N=7168 err ~1e-6 rel, softmax "
                 "weights likewise): bf16 rounding 2^-9 -> rtol 1e-2, atol 1e-2 at |v| ~ 1..10; fp32 out: 1e-5")
    WIDTHS = ("N", "dtype")     # NB grows with depth, T with the step
    CELLS = (
        tiny("unit: first layer, no stored blocks: the mix is the partial itself", NB=0, T=3, N=64,
             dtype=torch.bfloat16),
        tiny("unit: two stored blocks + partial", NB=2, T=4, N=64, dtype=torch.bfloat16),
        tiny("unit: fp32, width not a power of two", NB=3, T=2, N=96, dtype=torch.float32),
        gpu("K3 decode bs1: mix at the last layers, 8 stored blocks (93 layers / 12) + partial", NB=8, T=1,
            N=7168, dtype=torch.bfloat16),
        gpu("K3 decode bs64: mix in the middle of the stack, 4 blocks", NB=4, T=64, N=7168, dtype=torch.bfloat16),
        gpu("K3 decode bs256: deepest mix (output_attn_res), 8 blocks", NB=8, T=256, N=7168,
            dtype=torch.bfloat16),
        gpu("K3 decode bs64: layer 0, no blocks yet", NB=0, T=64, N=7168, dtype=torch.bfloat16),
        gpu("K3 prefill chunk 8192: deepest mix, 8 blocks", NB=8, T=8192, N=7168, dtype=torch.bfloat16),
    )

    @staticmethod
    def raw_call(blocks, partial, w, eps, out=None):
        return attn_res_mix(blocks, partial, w, eps, out=out)

    @staticmethod
    def reference(blocks, partial, w, eps, out=None):
        y = norm_ops.attn_res_mix(blocks, partial, w, eps)
        if out is not None:
            out.copy_(y)
            y = out
        return y

    @staticmethod
    def widths(blocks, partial, w, eps, out=None):
        return {"N": partial.shape[1], "dtype": partial.dtype}

    @staticmethod
    def is_valid(blocks, partial, w, eps, out=None):
        why = rows_ok(partial, "partial") or rows_ok(blocks, "blocks", ndim=3)
        if why:
            return why
        T, N = partial.shape
        if partial.dtype not in _FLOATS:
            return f"partial dtype {partial.dtype} unsupported"
        if blocks.shape[1:] != partial.shape or blocks.dtype != partial.dtype:
            return f"blocks {tuple(blocks.shape)} {blocks.dtype} must be [NB, {T}, {N}] {partial.dtype}"
        if N > MAX_N:
            return f"N={N} > {MAX_N}: the kernel holds a row in registers"
        if w.shape != (N,) or w.dtype != torch.float32 or not w.is_contiguous():
            return f"w must be contiguous fp32 [{N}], got {tuple(w.shape)} {w.dtype}"
        if out is not None:
            if out.shape != partial.shape or out.stride(-1) != 1 or out.dtype not in _FLOATS:
                return f"out must be [{T}, {N}] with a contiguous last dim"
            if overlaps(out, partial) or overlaps(out, blocks):
                return "out overlaps an input"
        return None

    @staticmethod
    def compare(out, ref):
        tol = 1e-5 if ref.dtype == torch.float32 else 1e-2
        assert_close(out, ref, rtol=tol, atol=tol, what="AttnResMix")

    @staticmethod
    def make_inputs(spec, device, generator):
        NB, T, N, dtype = spec["NB"], spec["T"], spec["N"], spec["dtype"]
        # block states grow with depth: scale 1 + i
        scales = torch.arange(1, NB + 1, dtype=torch.float32).view(NB, 1, 1).to(device)
        blocks = (randn((NB, T, N), generator, device, torch.float32) * scales).to(dtype)
        return dict(
            blocks=blocks,
            partial=randn((T, N), generator, device, dtype, scale=2.0),
            w=randn((N,), generator, device, torch.float32, scale=2.0 / N ** 0.5),
            eps=1e-6,
        )
