"""K3's MLA output gate: attention output times sigmoid(g_proj x), before o_proj."""

from __future__ import annotations

import torch

from kestrel.catalog._op import Arch, OpWrapper, assert_close, gpu, overlaps, tiny
from kestrel.catalog.moe._common import randn
from kestrel.kernels.norm.gated import sigmoid_mul


class SigmoidGate(OpWrapper):
    """y = x * sigmoid(gate), elementwise, fp32 math, output in x's dtype. Triton: kestrel/kernels/norm/gated.py."""

    ARCHS = (Arch.CPU, Arch.SM90)
    TOLERANCE = "one fp32 product rounded once to bf16 (2^-9 rel) -> rtol 1e-2, atol 1e-3; fp32 1e-6"
    WIDTHS = ("N", "dtype")
    CELLS = (
        tiny("unit: K3-tiny MLA gate, 7 tokens x 4 heads x 16", T=7, N=64, dtype=torch.float32),
        tiny("unit: bf16, 3 tokens x 48", T=3, N=48, dtype=torch.bfloat16),
        gpu("K3 MLA decode bs64: 96 heads x 128 gate", T=64, N=12288, dtype=torch.bfloat16),
        gpu("K3 MLA prefill 8192: 96 heads x 128 gate", T=8192, N=12288, dtype=torch.bfloat16),
    )

    @staticmethod
    def raw_call(x, gate, out=None):
        return sigmoid_mul(x, gate, out=out)

    @staticmethod
    def reference(x, gate, out=None):
        return (x.float() * torch.sigmoid(gate.float())).to(x.dtype)

    @staticmethod
    def widths(x, gate, out=None):
        return {"N": x.shape[-1], "dtype": x.dtype}

    @staticmethod
    def is_valid(x, gate, out=None):
        if x.shape != gate.shape:
            return f"gate shape {tuple(gate.shape)} != x {tuple(x.shape)}"
        if not (x.is_contiguous() and gate.is_contiguous()):
            return "x and gate must be contiguous (the kernel walks flat memory)"
        if out is not None and (out.shape != x.shape or not out.is_contiguous() or overlaps(out, gate)):
            return "out must be contiguous, x's shape, and not overlap gate"
        return None

    @staticmethod
    def compare(out, ref):
        if ref.dtype == torch.float32:
            assert_close(out, ref, rtol=1e-6, atol=1e-6, what="SigmoidGate")
        else:
            assert_close(out, ref, rtol=1e-2, atol=1e-3, what="SigmoidGate")

    @staticmethod
    def make_inputs(spec, device, generator):
        T, N, dt = spec["T"], spec["N"], spec["dtype"]
        return dict(x=randn((T, N), generator, device, dt), gate=randn((T, N), generator, device, dt, scale=3.0))
