"""Gated activations of the expert / shared-expert / dense MLPs over a fused gate|up tensor.

Two entries on one Triton kernel (kestrel/kernels/activation/glu.py): `SiluGlu` (Kimi Linear) and `SituGlu`
(K3). The input gu [T, 2I] holds the gate half first, then the up half (w13's row order)."""

from __future__ import annotations

import torch

from kestrel.catalog._op import Arch, OpWrapper, assert_close, gpu, overlaps, tiny
from kestrel.catalog.moe._common import randn, rows_ok
from kestrel.kernels.activation.glu import glu
from kestrel.ops import moe as moe_ops

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
_TOL = ("bf16 output of elementwise fp32 math (tanh/sigmoid ~1e-7 rel): bf16 rounding 2^-9 -> rtol 1e-2, "
        "atol 1e-3; fp32 output: rtol 1e-5, atol 1e-5")


def _check(gu, out):
    why = rows_ok(gu, "gu")
    if why:
        return why
    if gu.dtype not in _FLOATS:
        return f"gu dtype {gu.dtype} unsupported"
    T, two_i = gu.shape
    if two_i % 2:
        return f"gu last dim {two_i} must be even (gate | up)"
    if out is not None:
        if out.shape != (T, two_i // 2) or out.stride(-1) != 1:
            return f"out must be [{T}, {two_i // 2}] with a contiguous last dim"
        if overlaps(out, gu):
            return "out overlaps gu"
    return None


def _compare(out, ref, what):
    tol = (1e-5, 1e-5) if ref.dtype == torch.float32 else (1e-2, 1e-3)
    assert_close(out, ref, rtol=tol[0], atol=tol[1], what=what)


def _finish(y, out):
    if out is not None:
        out.copy_(y)
        return out
    return y


class SiluGlu(OpWrapper):
    """y = silu(g) * u for gu = [g | u] [T, 2I] -> [T, I]; fp32 math, output in gu's dtype."""

    ARCHS = (Arch.CPU, Arch.SM90)
    TOLERANCE = _TOL
    WIDTHS = ("I", "dtype")
    CELLS = (
        tiny("unit: 6 rows x I=32", T=6, I=32, dtype=torch.bfloat16),
        tiny("unit: fp32, I not a power of two", T=3, I=48, dtype=torch.float32),
        gpu("Kimi Linear 48B decode bs1: routed experts, 8 slots x moe_intermediate 1024", T=8, I=1024,
            dtype=torch.bfloat16),
        gpu("Kimi Linear 48B decode bs64: routed experts, 512 slots x 1024", T=512, I=1024, dtype=torch.bfloat16),
        gpu("Kimi Linear 48B decode bs256: routed experts, 2048 slots x 1024", T=2048, I=1024,
            dtype=torch.bfloat16),
        gpu("Kimi Linear 48B prefill 8192: routed experts, 65536 slots x 1024", T=65536, I=1024,
            dtype=torch.bfloat16),
        gpu("Kimi Linear 48B prefill 8192: shared expert, 8192 x 1024", T=8192, I=1024, dtype=torch.bfloat16),
        gpu("Kimi Linear 48B decode bs64: dense layer 0, intermediate 9216", T=64, I=9216, dtype=torch.bfloat16),
        gpu("Kimi Linear 48B prefill 8192: dense layer 0, intermediate 9216", T=8192, I=9216,
            dtype=torch.bfloat16),
    )

    @staticmethod
    def raw_call(gu, out=None):
        return glu(gu, "silu", out=out)

    @staticmethod
    def reference(gu, out=None):
        return _finish(moe_ops.glu(*gu.chunk(2, dim=-1), "silu"), out)

    @staticmethod
    def widths(gu, out=None):
        return {"I": gu.shape[1] // 2, "dtype": gu.dtype}

    @staticmethod
    def is_valid(gu, out=None):
        return _check(gu, out)

    @staticmethod
    def compare(out, ref):
        _compare(out, ref, "SiluGlu")

    @staticmethod
    def make_inputs(spec, device, generator):
        return dict(gu=randn((spec["T"], 2 * spec["I"]), generator, device, spec["dtype"], scale=2.0))


class SituGlu(OpWrapper):
    """y = beta * tanh(g / beta) * sigmoid(g) * linear_beta * tanh(u / linear_beta) for gu = [g | u]
    (K3: beta = activation_situ_beta = 4, linear_beta = activation_situ_linear_beta = 25); fp32 math."""

    ARCHS = (Arch.CPU, Arch.SM90)
    TOLERANCE = _TOL
    WIDTHS = ("I", "beta", "linear_beta", "dtype")
    CELLS = (
        tiny("unit: 6 rows x I=32, K3 betas", T=6, I=32, beta=4.0, linear_beta=25.0, dtype=torch.bfloat16),
        tiny("unit: fp32, saturating inputs", T=3, I=48, beta=4.0, linear_beta=25.0, scale=40.0,
             dtype=torch.float32),
        gpu("K3 decode bs1: routed experts, 16 slots x expert width 3072", T=16, I=3072, beta=4.0,
            linear_beta=25.0, dtype=torch.bfloat16),
        gpu("K3 decode bs64: routed experts, 1024 slots x 3072", T=1024, I=3072, beta=4.0, linear_beta=25.0,
            dtype=torch.bfloat16),
        gpu("K3 decode bs256: routed experts, 4096 slots x 3072", T=4096, I=3072, beta=4.0, linear_beta=25.0,
            dtype=torch.bfloat16),
        gpu("K3 prefill 8192: routed experts, 131072 slots x 3072", T=131072, I=3072, beta=4.0,
            linear_beta=25.0, dtype=torch.bfloat16),
        gpu("K3 decode bs64: 2 shared experts fused, 64 x 2*3072", T=64, I=6144, beta=4.0, linear_beta=25.0,
            dtype=torch.bfloat16),
        gpu("K3 prefill 8192: 2 shared experts fused, 8192 x 2*3072", T=8192, I=6144, beta=4.0, linear_beta=25.0,
            dtype=torch.bfloat16),
        gpu("K3 decode bs64: dense layer 0, intermediate 33792", T=64, I=33792, beta=4.0, linear_beta=25.0,
            dtype=torch.bfloat16),
        gpu("K3 prefill 8192: dense layer 0, intermediate 33792", T=8192, I=33792, beta=4.0, linear_beta=25.0,
            dtype=torch.bfloat16),
    )

    @staticmethod
    def raw_call(gu, beta, linear_beta, out=None):
        return glu(gu, "situ", beta, linear_beta, out=out)

    @staticmethod
    def reference(gu, beta, linear_beta, out=None):
        return _finish(moe_ops.glu(*gu.chunk(2, dim=-1), "situ", beta, linear_beta), out)

    @staticmethod
    def widths(gu, beta, linear_beta, out=None):
        return {"I": gu.shape[1] // 2, "beta": beta, "linear_beta": linear_beta, "dtype": gu.dtype}

    @staticmethod
    def is_valid(gu, beta, linear_beta, out=None):
        if not (beta > 0 and linear_beta > 0):
            return f"beta ({beta}) and linear_beta ({linear_beta}) must be > 0"
        return _check(gu, out)

    @staticmethod
    def compare(out, ref):
        _compare(out, ref, "SituGlu")

    @staticmethod
    def make_inputs(spec, device, generator):
        return dict(gu=randn((spec["T"], 2 * spec["I"]), generator, device, spec["dtype"],
                             scale=spec.get("scale", 3.0)),
                    beta=spec["beta"], linear_beta=spec["linear_beta"])
