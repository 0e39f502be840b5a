"""KDA's output norm: per-head RMSNorm times sigmoid of the output gate."""

from __future__ import annotations

import torch

from kestrel.catalog._op import Arch, OpWrapper, assert_close, gpu, overlaps, tiny
from kestrel.catalog.moe._common import first, randn, rows_ok
from kestrel.kernels.norm.gated import gated_rmsnorm
from kestrel.ops.norm import gated_rms_norm


class GatedRmsNorm(OpWrapper):
    """y = weight * (x * rsqrt(mean(x^2) + eps)) * sigmoid(gate), rows of width N (one KDA head), fp32 math.
    x is the fp32 recurrence output viewed [T*H, D]; gate the bf16 output-gate projection; y in gate's dtype.
    Triton kernel: kestrel/kernels/norm/gated.py."""

    ARCHS = (Arch.CPU, Arch.SM90)
    TOLERANCE = "fp32 math over a 128-wide row, one bf16 rounding of y (2^-9 rel) -> rtol/atol 1e-2; fp32 1e-5"
    WIDTHS = ("N", "dtype")     # T counts tokens x heads
    CELLS = (
        tiny("unit: 3 tokens x 4 heads x 16", T=12, N=16, dtype=torch.float32),
        tiny("unit: bf16 gate, 5 tokens x 2 heads x 32", T=10, N=32, dtype=torch.bfloat16),
        gpu("Kimi Linear 48B decode bs64: 32 heads x 128", T=64 * 32, N=128, dtype=torch.bfloat16),
        gpu("Kimi Linear 48B prefill 8192: 32 heads x 128", T=8192 * 32, N=128, dtype=torch.bfloat16),
        gpu("K3 decode bs64: 96 heads x 128", T=64 * 96, N=128, dtype=torch.bfloat16),
        gpu("K3 prefill 4096: 96 heads x 128", T=4096 * 96, N=128, dtype=torch.bfloat16),
    )

    @staticmethod
    def raw_call(x, gate, weight, eps, out=None):
        return gated_rmsnorm(x, gate, weight, eps, out=out)

    @staticmethod
    def reference(x, gate, weight, eps, out=None):
        return gated_rms_norm(x, gate, weight, eps).to(gate.dtype)

    @staticmethod
    def widths(x, gate, weight, eps, out=None):
        return {"N": x.shape[1], "dtype": gate.dtype}

    @staticmethod
    def is_valid(x, gate, weight, eps, out=None):
        why = first(rows_ok(x, "x"), rows_ok(gate, "gate"))
        if why:
            return why
        if gate.shape != x.shape:
            return f"gate shape {tuple(gate.shape)} != x {tuple(x.shape)}"
        if weight.shape != (x.shape[1],) or not weight.is_contiguous():
            return f"weight must be a contiguous [{x.shape[1]}]"
        if x.shape[1] > 16384:
            return "row wider than 16384: the kernel holds a row in registers"
        if out is not None and (out.shape != x.shape or overlaps(out, x) or overlaps(out, gate)):
            return "out must be a separate [T, N] tensor"
        return None

    @staticmethod
    def compare(out, ref):
        tol = 1e-5 if ref.dtype == torch.float32 else 1e-2
        assert_close(out, ref, rtol=tol, atol=tol, what="GatedRmsNorm")

    @staticmethod
    def make_inputs(spec, device, generator):
        T, N, dt = spec["T"], spec["N"], spec["dtype"]
        return dict(x=randn((T, N), generator, device, torch.float32, scale=0.3),
                    gate=randn((T, N), generator, device, dt, scale=2.0),
                    weight=randn((N,), generator, device, torch.float32, scale=0.1, shift=1.0), eps=1e-5)
