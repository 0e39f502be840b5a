"""RMSNorm with an optional fused residual add (residual=None gives the plain RMSNorm)."""

from __future__ import annotations

import torch

from kestrel.catalog._op import Arch, OpWrapper, assert_close, gpu, overlaps, tiny
from kestrel.catalog.moe._common import first, randn, rows_ok
from kestrel.kernels.norm.rmsnorm import MAX_N, add_rmsnorm
from kestrel.ops.norm import rms_norm

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


class AddRmsNorm(OpWrapper):
    """r = x + residual (rounded once to residual's dtype and written back into `residual` in place), then
    y = weight * (r_f32 * rsqrt(mean(r_f32^2) + eps)) in fp32, cast once to x's dtype. Returns (y, r); r is
    the `residual` tensor itself, or `x` when residual is None. Rows may be strided (last dim contiguous), so
    the per-head norm runs on a [T*H, 128] view. Triton kernel: kestrel/kernels/norm/rmsnorm.py."""

    ARCHS = (Arch.CPU, Arch.SM90)
    TOLERANCE = ("y: bf16 output of fp32 math (row sum over N<=7168 errs ~1e-6 rel), bf16 rounding 2^-9 "
                 "-> rtol 1e-2, atol 1e-2 at |y| ~ 1 (fp32 y: 1e-5); r: one fp32 add rounded once -> exact")
    WIDTHS = ("N", "residual", "dtype")
    CELLS = (
        tiny("unit: fused add + norm, 5 tokens x 64", T=5, N=64, residual=True, dtype=torch.bfloat16),
        tiny("unit: per-head norm on a [T*H, 128] view without residual (KDA output norm)", T=12, N=128,
             residual=False, dtype=torch.bfloat16),
        tiny("unit: fp32, width not a power of two", T=3, N=96, residual=True, dtype=torch.float32),
        gpu("Kimi Linear 48B decode bs1: residual add + input/post-attention norm, hidden 2304", T=1, N=2304,
            residual=True, dtype=torch.bfloat16),
        gpu("Kimi Linear 48B decode bs64: residual add + norm, hidden 2304", T=64, N=2304, residual=True,
            dtype=torch.bfloat16),
        gpu("Kimi Linear 48B decode bs256: residual add + norm, hidden 2304", T=256, N=2304, residual=True,
            dtype=torch.bfloat16),
        gpu("Kimi Linear 48B prefill chunk 8192: residual add + norm, hidden 2304", T=8192, N=2304,
            residual=True, dtype=torch.bfloat16),
        gpu("Kimi Linear 48B decode bs64: layer 0's input_layernorm (no residual yet), hidden 2304", T=64, N=2304,
            residual=False, dtype=torch.bfloat16),
        gpu("Kimi Linear 48B prefill 8192: layer 0's input_layernorm, hidden 2304", T=8192, N=2304,
            residual=False, dtype=torch.bfloat16),
        gpu("K3 / Kimi Linear MLA decode bs64: kv_a_layernorm on the 512 latent (eps 1e-6)", T=64, N=512,
            residual=False, eps=1e-6, dtype=torch.bfloat16),
        gpu("K3 / Kimi Linear MLA prefill 8192: kv_a_layernorm on the 512 latent (eps 1e-6)", T=8192, N=512,
            residual=False, eps=1e-6, dtype=torch.bfloat16),
        gpu("K3 MLA decode bs64: q_a_layernorm on the 1536 q LoRA rank (eps 1e-6)", T=64, N=1536,
            residual=False, eps=1e-6, dtype=torch.bfloat16),
        gpu("K3 MLA prefill 8192: q_a_layernorm on the 1536 q LoRA rank (eps 1e-6)", T=8192, N=1536,
            residual=False, eps=1e-6, dtype=torch.bfloat16),
        gpu("K3 decode bs1: input_layernorm on the attention-residual mix, hidden 7168", T=1, N=7168,
            residual=False, dtype=torch.bfloat16),
        gpu("K3 decode bs64: input/post-attention norm, hidden 7168", T=64, N=7168, residual=False,
            dtype=torch.bfloat16),
        gpu("K3 decode bs256: input/post-attention norm, hidden 7168", T=256, N=7168, residual=False,
            dtype=torch.bfloat16),
        gpu("K3 prefill chunk 8192: input/post-attention norm, hidden 7168", T=8192, N=7168, residual=False,
            dtype=torch.bfloat16),
        gpu("K3 latent MoE decode bs64: routed_expert_norm on the 3584 latent", T=64, N=3584, residual=False,
            dtype=torch.bfloat16),
        gpu("K3 latent MoE prefill 8192: routed_expert_norm on the 3584 latent", T=8192, N=3584,
            residual=False, dtype=torch.bfloat16),
    )

    @staticmethod
    def raw_call(x, residual, weight, eps, out=None):
        return add_rmsnorm(x, residual, weight, eps, out=out)

    @staticmethod
    def reference(x, residual, weight, eps, out=None):
        if residual is not None:
            residual.copy_((x.float() + residual.float()).to(residual.dtype))
            r = residual
        else:
            r = x
        y = rms_norm(r, weight, eps).to(x.dtype)
        if out is not None:
            out.copy_(y)
            y = out
        return y, r

    @staticmethod
    def widths(x, residual, weight, eps, out=None):
        return {"N": x.shape[1], "residual": residual is not None, "dtype": x.dtype}

    @staticmethod
    def is_valid(x, residual, weight, eps, out=None):
        why = first(rows_ok(x, "x"), rows_ok(residual, "residual") if residual is not None else None)
        if why:
            return why
        T, N = x.shape
        if x.dtype not in _FLOATS:
            return f"x dtype {x.dtype} unsupported"
        if N > MAX_N:
            return f"N={N} > {MAX_N}: the kernel holds a row in registers"
        if weight.shape != (N,) or not weight.is_contiguous() or weight.dtype not in _FLOATS:
            return f"weight must be a contiguous float [{N}], got {tuple(weight.shape)} {weight.dtype}"
        if residual is not None:
            if residual.shape != x.shape:
                return f"residual shape {tuple(residual.shape)} != x {tuple(x.shape)}"
            if residual.dtype not in (x.dtype, torch.float32):
                return f"residual dtype {residual.dtype} must be x's ({x.dtype}) or fp32"
            if overlaps(x, residual):
                return "x and residual overlap: residual is written in place"
        if out is not None:
            if out.shape != x.shape or out.stride(-1) != 1:
                return f"out must be [{T}, {N}] with a contiguous last dim"
            if overlaps(out, x) or overlaps(out, residual):
                return "out overlaps an input"
        if not eps > 0:
            return f"eps must be > 0, got {eps}"
        return None

    @staticmethod
    def compare(out, ref):
        (y, r), (y_ref, r_ref) = out, ref
        tol = 1e-5 if y_ref.dtype == torch.float32 else 1e-2
        assert_close(y, y_ref, rtol=tol, atol=tol, what="AddRmsNorm y")
        assert_close(r, r_ref, rtol=0, atol=0, what="AddRmsNorm r")

    @staticmethod
    def make_inputs(spec, device, generator):
        T, N, dtype = spec["T"], spec["N"], spec["dtype"]
        return dict(
            x=randn((T, N), generator, device, dtype),
            residual=randn((T, N), generator, device, dtype, scale=4.0) if spec["residual"] else None,
            weight=randn((N,), generator, device, dtype, scale=0.1, shift=1.0),
            eps=spec.get("eps", 1e-5),
        )
